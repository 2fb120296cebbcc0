-------------------------- MODULE StructuredOutput --------------------------
(***************************************************************************)
(* Structured output under async scheduling (docs/structured-output.md):  *)
(* the grammar mask a row samples under, when the engine core runs one    *)
(* step ahead.                                                            *)
(*                                                                         *)
(* - The engine core schedules step N+1 while step N is in flight (a batch *)
(*   queue of Depth = 2). A constrained request's mask for N+1 needs the   *)
(*   grammar state after its token of step N, which is still a future.    *)
(* - The machine's launch decision: SampleInProgram (every masked row's    *)
(*   grammar already holds its newest token: the mask is built now and    *)
(*   the program samples under it) or SampleDeferred (the forward is       *)
(*   launched; the engine core applies step N's output, which advances the *)
(*   grammars, then builds the mask and launches the sampling:             *)
(*   DeferredSample).                                                      *)
(* - The async output thread materializes each sampled step; the engine    *)
(*   core applies outputs oldest first (AdvanceStep), delivering tokens,   *)
(*   discovering stops, advancing grammars.                                *)
(*                                                                         *)
(* What AsyncScheduling.tla checks (input ids, row maps, breaks, locks,    *)
(* failures) is taken as given here: a row's forward input is right, so    *)
(* its token is right exactly when the mask it samples under is.           *)
(***************************************************************************)
EXTENDS Integers, Sequences, FiniteSets, TLC

CONSTANTS
    Requests,      \* request ids in admission order; all are admitted at the start
    Constrained,   \* the requests with a grammar (response_format, regex, choice, grammar)
    MaxTokens,     \* [request -> max_tokens]
    MayStop,       \* requests whose token may turn out to be EOS or a stop token
    \* The guards. The implementation has all of them; each must-fail model drops one.
    DeferWhenMaskWaits,        \* a step whose masked row's newest token is in flight samples after it is applied
    MaskRowsByRequestId,       \* a bitmask row reaches the batch row of its request, not the row at its index
    GrammarTakesDeliveredOnly, \* the grammar advances with the delivered (stop-trimmed) tokens only
    PopAppliedStep             \* the deferred path takes the step it applies out of the batch queue

ReqSet == {Requests[i] : i \in 1..Len(Requests)}
Depth == 2

Tok(r, k) == <<r, k>>      \* the k-th output token of r, sampled under the right mask
Bad(r, k) == <<r, -k>>     \* what a row samples under any other mask (or none, when it needs one)
NoMask == [req |-> "", after |-> -1]                  \* the row samples unconstrained (all bits set)
Mask(r, g) == [req |-> r, after |-> g]                \* built for r from its grammar after g tokens
\* The mask row k of r must be sampled under: r's grammar after its tokens 1..k-1, or none.
Expected(r, k) == IF r \in Constrained THEN Mask(r, k - 1) ELSE NoMask

Range(f) == {f[i] : i \in DOMAIN f}
Override(f, S, g(_)) == [x \in DOMAIN f |-> IF x \in S THEN g(x) ELSE f[x]]

ASSUME Constrained \subseteq ReqSet /\ MayStop \subseteq ReqSet

VARIABLES
    status,        \* [r -> "running" | "finished"]
    delivered,     \* [r -> Seq(token)]: what the client received
    grammar,       \* [r -> Seq(token)]: the tokens r's grammar matcher has accepted
    placeholders,  \* [r -> Nat]: tokens of r in steps scheduled and not yet applied
    stopLen,       \* [r -> Nat]: outputs r had when it stopped (MaxTokens until then)
    steps,         \* Seq of step records, by step id
    batchQueue,    \* sampled steps the engine core has not applied, oldest first
    outQueue,      \* sampled steps the output thread has not materialized, oldest first
    deferred,      \* the step whose forward is launched and whose sampling waits (0: none)
    pc             \* the engine loop: "top", "wait" (for the oldest output), "defer" (the
                   \* same, with a deferred step), "mask" (that output applied: build the mask)

vars == <<status, delivered, grammar, placeholders, stopLen, steps, batchQueue, outQueue, deferred, pc>>

Token == ReqSet \X Int
MaskValue == [req : ReqSet \cup {""}, after : Int]

TypeOK ==
    /\ status \in [ReqSet -> {"running", "finished"}]
    /\ \A r \in ReqSet : delivered[r] \in Seq(Token) /\ grammar[r] \in Seq(Token)
    /\ placeholders \in [ReqSet -> Int] /\ stopLen \in [ReqSet -> Nat]
    /\ \A s \in 1..Len(steps) :
        /\ DOMAIN steps[s] = {"rows", "outIdx", "masks", "result", "deferred", "sampled", "mat", "applied"}
        /\ Range(steps[s].masks) \subseteq MaskValue
        /\ steps[s].deferred \in BOOLEAN
        /\ {steps[s].sampled, steps[s].mat, steps[s].applied} \subseteq Nat
    /\ Range(batchQueue) \cup Range(outQueue) \subseteq 1..Len(steps)
    /\ deferred \in 0..Len(steps)
    /\ pc \in {"top", "wait", "defer", "mask"}

Init ==
    /\ status = [r \in ReqSet |-> "running"]
    /\ delivered = [r \in ReqSet |-> <<>>]
    /\ grammar = [r \in ReqSet |-> <<>>]
    /\ placeholders = [r \in ReqSet |-> 0]
    /\ stopLen = [r \in ReqSet |-> MaxTokens[r]]
    /\ steps = <<>>
    /\ batchQueue = <<>>
    /\ outQueue = <<>>
    /\ deferred = 0
    /\ pc = "top"

-----------------------------------------------------------------------------
(* Scheduling: running requests in admission order, as far as the budget   *)
(* goes (a prefix); a request whose tokens in flight reach max_tokens is   *)
(* left out (the pipelining gap).                                          *)

Schedulable(r) == status[r] = "running" /\ Len(delivered[r]) + placeholders[r] < MaxTokens[r]
Runnable == SelectSeq(Requests, Schedulable)
Schedules == {SubSeq(Runnable, 1, j) : j \in 1..Len(Runnable)}

\* The observation that decides the launch: a row that samples under a grammar whose request's
\* newest token is in the pending step (not yet applied, so not in its grammar).
MaskWaits(order) == \E r \in Range(order) : r \in Constrained /\ placeholders[r] > 0

\* The bitmask for rows `order`, from the grammars as they are now. Rows of finished requests (a
\* stop discovered while the step waited) are unconstrained: their tokens are discarded.
Masked(r) == r \in Constrained /\ status[r] = "running"
MasksNow(order) ==
    LET byId == [i \in DOMAIN order |-> IF Masked(order[i]) THEN Mask(order[i], Len(grammar[order[i]])) ELSE NoMask]
        \* the bitmask's own row order (structured_output_request_ids), indexed by batch row
        ids == SelectSeq(order, Masked)
        byIndex == [i \in DOMAIN order |-> IF i <= Len(ids) THEN Mask(ids[i], Len(grammar[ids[i]])) ELSE NoMask]
    \* Hazard: mask ownership. The bitmask is indexed by request id, never by position.
    IN IF MaskRowsByRequestId THEN byId ELSE byIndex

Sampled(order, outIdx, masks) ==
    [i \in DOMAIN order |-> IF masks[i] = Expected(order[i], outIdx[i]) THEN Tok(order[i], outIdx[i])
                            ELSE Bad(order[i], outIdx[i])]

NewStep(order, sample) ==
    LET outIdx == [i \in DOMAIN order |-> Len(delivered[order[i]]) + placeholders[order[i]] + 1]
        masks == IF sample THEN MasksNow(order) ELSE <<>>
    IN [rows |-> order, outIdx |-> outIdx, masks |-> masks,
        result |-> IF sample THEN Sampled(order, outIdx, masks) ELSE <<>>,
        deferred |-> ~sample, sampled |-> IF sample THEN 1 ELSE 0, mat |-> 0, applied |-> 0]

Enqueue(s) ==  \* a sampled step goes to the batch queue and to the output thread
    /\ batchQueue' = Append(batchQueue, s)
    /\ outQueue' = Append(outQueue, s)
    /\ pc' = IF Len(batchQueue) + 1 < Depth THEN "top" ELSE "wait"

-----------------------------------------------------------------------------
(* The engine loop (main thread).                                          *)

\* launch: every masked row's grammar holds its newest token; the mask is an input of the program.
SampleInProgram ==
    /\ pc = "top" /\ Len(batchQueue) < Depth
    /\ \E order \in Schedules :
        \* Hazard: stale mask. Without the guard the mask is built from the grammar before the token in flight.
        /\ ~(DeferWhenMaskWaits /\ MaskWaits(order))
        /\ steps' = Append(steps, NewStep(order, TRUE))
        /\ placeholders' = Override(placeholders, Range(order), LAMBDA r : placeholders[r] + 1)
        /\ Enqueue(Len(steps) + 1)
    /\ UNCHANGED <<status, delivered, grammar, stopLen, deferred>>

\* launch: a masked row's newest token is in flight. The forward runs now; sampling waits.
SampleDeferred ==
    /\ DeferWhenMaskWaits
    /\ pc = "top" /\ Len(batchQueue) < Depth
    /\ \E order \in Schedules :
        /\ MaskWaits(order)
        /\ steps' = Append(steps, NewStep(order, FALSE))
        /\ placeholders' = Override(placeholders, Range(order), LAMBDA r : placeholders[r] + 1)
    /\ deferred' = Len(steps) + 1
    /\ pc' = "defer"
    /\ UNCHANGED <<status, delivered, grammar, stopLen, batchQueue, outQueue>>

\* sample_tokens(grammar_output) for the deferred step: the pending output has been applied.
DeferredSample ==
    /\ pc = "mask"
    /\ LET st == steps[deferred]
           masks == MasksNow(st.rows)
       IN steps' = [steps EXCEPT ![deferred].masks = masks,
                                 ![deferred].result = Sampled(st.rows, st.outIdx, masks),
                                 ![deferred].sampled = @ + 1]
    /\ Enqueue(deferred)
    /\ deferred' = 0
    /\ UNCHANGED <<status, delivered, grammar, placeholders, stopLen>>

WaitOldest ==  \* the queue is full, or nothing can be scheduled: wait for the oldest output
    /\ pc = "top"
    /\ batchQueue # <<>>
    /\ Len(batchQueue) = Depth \/ Schedules = {}
    /\ pc' = "wait"
    /\ UNCHANGED <<status, delivered, grammar, placeholders, stopLen, steps, batchQueue, outQueue, deferred>>

\* update_from_output for the oldest step, once materialized: deliver, discover stops, advance grammars.
AdvanceStep ==
    /\ pc \in {"wait", "defer"}
    /\ batchQueue # <<>>
    /\ LET h == Head(batchQueue)
           st == steps[h]
           live == {i \in DOMAIN st.rows : status[st.rows[i]] = "running"}  \* others' tokens are discarded
           getting == {st.rows[i] : i \in live}
           TokOf(r) == st.result[CHOOSE i \in DOMAIN st.rows : st.rows[i] = r]
           atMax == {r \in getting : Len(delivered[r]) + 1 >= MaxTokens[r]}
           \* Hazard: grammar ownership. Only the tokens the client gets advance the grammar.
           advancing == IF GrammarTakesDeliveredOnly THEN getting ELSE Range(st.rows)
       IN
       /\ st.mat = 1  \* future.result(): the output thread has materialized it
       /\ \E eos \in SUBSET (getting \cap MayStop) :
           LET stopped == eos \cup atMax IN
           /\ status' = Override(status, stopped, LAMBDA r : "finished")
           /\ stopLen' = Override(stopLen, stopped, LAMBDA r : Len(delivered[r]) + 1)
       /\ delivered' = Override(delivered, getting, LAMBDA r : Append(delivered[r], TokOf(r)))
       /\ grammar' = Override(grammar, advancing \cap Constrained, LAMBDA r : Append(grammar[r], TokOf(r)))
       /\ placeholders' = Override(placeholders, Range(st.rows), LAMBDA r : placeholders[r] - 1)
       /\ steps' = [steps EXCEPT ![h].applied = @ + 1]
       \* Hazard: double application. The deferred path applies the oldest step out of turn.
       /\ batchQueue' = IF pc = "defer" /\ ~PopAppliedStep THEN batchQueue ELSE Tail(batchQueue)
    /\ pc' = IF pc = "defer" THEN "mask" ELSE "top"
    /\ UNCHANGED <<outQueue, deferred>>

\* The async output thread: to_host and write-back of the oldest sampled step.
Materialize ==
    /\ outQueue # <<>>
    /\ steps' = [steps EXCEPT ![Head(outQueue)].mat = @ + 1]
    /\ outQueue' = Tail(outQueue)
    /\ UNCHANGED <<status, delivered, grammar, placeholders, stopLen, batchQueue, deferred, pc>>

Terminated ==
    /\ \A r \in ReqSet : status[r] = "finished"
    /\ batchQueue = <<>> /\ outQueue = <<>> /\ deferred = 0 /\ pc = "top"

Done == Terminated /\ UNCHANGED vars  \* keeps TLC from calling a finished run a deadlock

Next ==
    \/ SampleInProgram \/ SampleDeferred \/ DeferredSample
    \/ WaitOldest \/ AdvanceStep \/ Materialize
    \/ Done

Spec == Init /\ [][Next]_vars

-----------------------------------------------------------------------------
(* Invariants                                                                *)

\* The mask a row samples under was built for that row's request from its grammar after the
\* request's previous token (never an older state, never another request's), and an
\* unconstrained row samples unmasked: for every token that can still reach the client.
FreshMaskInv ==
    \A s \in 1..Len(steps) : \A i \in DOMAIN steps[s].masks :
        LET r == steps[s].rows[i]
            k == steps[s].outIdx[i]
        IN k <= stopLen[r] => steps[s].masks[i] = Expected(r, k)

\* Every step is sampled once, materialized once, applied at most once and only after both.
ExactlyOnceInv ==
    \A s \in 1..Len(steps) :
        /\ steps[s].sampled <= 1 /\ steps[s].mat <= 1 /\ steps[s].applied <= 1
        /\ steps[s].applied = 1 => steps[s].mat = 1 /\ steps[s].sampled = 1
        /\ s \in Range(batchQueue) \cup Range(outQueue) => steps[s].sampled = 1

\* Each client receives tokens 1..n of its own request, in order, nothing after its stop; each
\* grammar has accepted exactly the tokens its client received.
GrammarSyncInv ==
    \A r \in ReqSet :
        /\ delivered[r] = [k \in 1..Len(delivered[r]) |-> Tok(r, k)]
        /\ Len(delivered[r]) <= stopLen[r]
        /\ grammar[r] = IF r \in Constrained THEN delivered[r] ELSE <<>>

-----------------------------------------------------------------------------
(* Reachability witnesses: each claims a situation is never reached; its     *)
(* witness model must make TLC violate it (manifest).                        *)

\* A deferred step sampled with a constrained and an unconstrained row: the mixed batch.
DeferredMixedStepUnreached ==
    ~\E s \in 1..Len(steps) :
        /\ steps[s].deferred /\ steps[s].sampled = 1
        /\ \E i, j \in DOMAIN steps[s].rows : steps[s].rows[i] \in Constrained /\ steps[s].rows[j] \notin Constrained
\* A constrained request stopped (EOS) while its row of a deferred step waited for its mask.
StopBeforeDeferredMaskUnreached ==
    ~\E s \in 1..Len(steps) :
        /\ steps[s].deferred /\ steps[s].sampled = 1
        /\ \E i \in DOMAIN steps[s].rows : steps[s].rows[i] \in Constrained /\ steps[s].masks[i] = NoMask
\* A constrained row masked in the program itself after the request's first token: its newest
\* token was already applied (it sat out the previous step).
MaskInProgramAfterSkipUnreached ==
    ~\E s \in 1..Len(steps) :
        /\ ~steps[s].deferred
        /\ \E i \in DOMAIN steps[s].rows : steps[s].rows[i] \in Constrained /\ steps[s].outIdx[i] > 1

=============================================================================
