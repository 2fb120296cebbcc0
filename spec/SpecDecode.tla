----------------------------- MODULE SpecDecode -----------------------------
(***************************************************************************)
(* Speculative decoding under async scheduling (docs/spec-decode.md):     *)
(* drafts in flight, acceptance the host learns one step late.            *)
(*                                                                         *)
(* - The engine core schedules step N+1 while step N is in flight (a batch *)
(*   queue of Depth = 2). A row is a prefill (samples one token and        *)
(*   drafts K), a spec row (verifies K drafts: 1 + a tokens, a in 0..K,    *)
(*   unknown to the host until the output is materialized) or a plain row  *)
(*   (one token; speculation is off for its request, for good).            *)
(* - The device keeps each request's accepted count (devN) and its future  *)
(*   row: the last accepted token, then K drafts when the row drafted.     *)
(*   A launched row reads its inputs there, never from the host.           *)
(* - The scheduler counts 1 + drafts placeholders per row in flight and    *)
(*   reconciles them with the accepted count when it applies the output;   *)
(*   a stop or max_tokens inside an accepted run ends the request there.   *)
(*                                                                         *)
(* - A client may abort a request (MayAbort) at the top of the engine loop *)
(*   with its rows in flight, and a request may arrive after the first     *)
(*   step (Late): it is admitted at the top of the loop, its first row a   *)
(*   prefill beside the others' spec rows.                                 *)
(*                                                                         *)
(* Taken as given (AsyncScheduling.tla): row maps, breaks, locks,          *)
(* failures. A row computes the right tokens exactly when its              *)
(* first input is its request's last accepted token; which drafts are      *)
(* accepted is the device's choice (any a in 0..K).                        *)
(***************************************************************************)
EXTENDS Integers, Sequences, FiniteSets, TLC

CONSTANTS
    Requests,      \* request ids in admission order; all are admitted at the start
    K,             \* num_speculative_tokens
    MaxTokens,     \* [request -> max_tokens]
    Room,          \* [request -> max_model_len - prompt length]: output k is an input at position prompt + k - 1
    MayStop,       \* requests whose token may turn out to be EOS or a stop token
    \* The guards. The implementation has all of them; each must-fail model drops one.
    InputIsLastAccepted,   \* a plain row after a drafting row reads the future's last accepted token
    ReconcilePlaceholders, \* applying a row removes its rejected drafts' placeholders too
    TrimAtStop,            \* tokens after a stop (EOS, max_tokens) inside an accepted run are dropped
    TrimToAccepted,        \* the output row is cut to its 1 + a accepted tokens (the rest is -1 padding)
    SpecOffNearLimit,      \* speculation turns off, for good, when fewer than K + 1 positions may be left
    SwitchAtExactN         \* ... at the row whose first output is known to leave too few: as sync mode does

ReqSet == {Requests[i] : i \in 1..Len(Requests)}
Depth == 2
\* Requests a client may abort, and requests that arrive after the first step. Not constants: a
\* model replaces them (<-), so the models without aborts or late arrivals keep their graphs.
MayAbort == {}
Late == {}

Tok(r, k) == <<r, k>>            \* r's k-th output (k = 0: the prompt's last token), computed from the right input
Bad(r, k) == <<r, -k>>           \* what a row computes for output k from a wrong input
Draft(r, k) == <<r, k, "draft">> \* a draft for output k that the target rejected
Drafts(kind) == IF kind = "spec" THEN K ELSE 0

Range(f) == {f[i] : i \in DOMAIN f}
Override(f, S, g(_)) == [x \in DOMAIN f |-> IF x \in S THEN g(x) ELSE f[x]]
RowOf(st, r) == CHOOSE i \in DOMAIN st.rows : st.rows[i] = r

ASSUME K \in Nat \ {0} /\ MayStop \subseteq ReqSet
ASSUME \A r \in ReqSet : 1 <= MaxTokens[r] /\ MaxTokens[r] <= Room[r]

VARIABLES
    status,        \* [r -> "waiting" | "running" | "finished"]: "waiting" until a late request is admitted
    delivered,     \* [r -> Seq(token)]: what the client received
    placeholders,  \* [r -> Int]: the scheduler's placeholders (num_output_placeholders)
    computed,      \* [r -> Int]: the scheduler's optimistic count of computed outputs
    specOff,       \* [r -> BOOLEAN]: speculation turned off for r (never back on)
    stopLen,       \* [r -> Nat]: outputs r had when it stopped or was aborted (MaxTokens until then)
    devN,          \* [r -> Nat]: the device's count of r's accepted outputs (positions, KV by slot)
    devDrafted,    \* [r -> BOOLEAN]: r's future row holds drafts after its last accepted token
    steps,         \* Seq of step records, by step id
    batchQueue,    \* launched steps the engine core has not applied, oldest first
    outQueue,      \* launched steps the output thread has not materialized, oldest first
    pc             \* the engine loop: "top" or "wait" (for the oldest output)

vars == <<status, delivered, placeholders, computed, specOff, stopLen, devN, devDrafted, steps, batchQueue,
          outQueue, pc>>

Token == (ReqSet \X Int) \cup (ReqSet \X Int \X {"draft"})

TypeOK ==
    /\ status \in [ReqSet -> {"waiting", "running", "finished"}]
    /\ \A r \in ReqSet : delivered[r] \in Seq(Token)
    /\ placeholders \in [ReqSet -> Int] /\ computed \in [ReqSet -> Int]
    /\ specOff \in [ReqSet -> BOOLEAN] /\ devDrafted \in [ReqSet -> BOOLEAN]
    /\ stopLen \in [ReqSet -> Nat] /\ devN \in [ReqSet -> Nat]
    /\ \A s \in 1..Len(steps) :
        /\ DOMAIN steps[s] = {"rows", "kind", "inIdx", "input", "acc", "out", "mat", "applied"}
        /\ Range(steps[s].kind) \subseteq {"prefill", "spec", "plain"}
        /\ {steps[s].mat, steps[s].applied} \subseteq Nat
    /\ Range(batchQueue) \cup Range(outQueue) \subseteq 1..Len(steps)
    /\ pc \in {"top", "wait"}

Init ==
    /\ status = [r \in ReqSet |-> IF r \in Late THEN "waiting" ELSE "running"]
    /\ delivered = [r \in ReqSet |-> <<>>]
    /\ placeholders = [r \in ReqSet |-> 0]
    /\ computed = [r \in ReqSet |-> 0]
    /\ specOff = [r \in ReqSet |-> FALSE]
    /\ stopLen = [r \in ReqSet |-> MaxTokens[r]]
    /\ devN = [r \in ReqSet |-> 0]
    /\ devDrafted = [r \in ReqSet |-> FALSE]
    /\ steps = <<>>
    /\ batchQueue = <<>>
    /\ outQueue = <<>>
    /\ pc = "top"

-----------------------------------------------------------------------------
(* Scheduling: running requests in admission order, as far as the budget   *)
(* goes (a prefix).                                                        *)

InFlightSteps(r) == {s \in Range(batchQueue) : r \in Range(steps[s].rows)}
\* 1 + drafts of r's rows in the steps S: the placeholders they should hold.
RECURSIVE Reserved(_, _)
Reserved(S, r) ==
    IF S = {} THEN 0
    ELSE LET s == CHOOSE s \in S : TRUE IN 1 + Drafts(steps[s].kind[RowOf(steps[s], r)]) + Reserved(S \ {s}, r)
\* Outputs r surely has once its steps in flight are applied (each gives at least one token) ...
Sure(r) == Len(delivered[r]) + Cardinality(InFlightSteps(r))
\* ... and at most (every draft accepted): an upper bound of devN[r] at the next launch.
Upper(r) == Len(delivered[r]) + placeholders[r]

\* Hazard: async != sync near max_model_len. The row's first output n is known only as
\* Sure(r) <= n <= Upper(r); sync mode knows it and builds a spec row exactly when n + K <= Room - 1,
\* and a seeded position verified against a draft draws another token than a plain one. While the
\* bounds disagree on that, the request waits for the reconcile.
SwitchKnown(r) == ~SwitchAtExactN \/ ~SpecOffNearLimit \/ specOff[r] \/ computed[r] = 0
                  \/ Upper(r) + K <= Room[r] - 1 \/ Sure(r) + K > Room[r] - 1
\* Not scheduled: a request whose steps in flight surely reach max_tokens (the pipelining gap), or
\* whose next input may lie past max_model_len (it waits for the output that says).
Schedulable(r) == status[r] = "running" /\ Sure(r) < MaxTokens[r] /\ Upper(r) <= Room[r] - 1 /\ SwitchKnown(r)
Runnable == SelectSeq(Requests, Schedulable)
Schedules == {SubSeq(Runnable, 1, j) : j \in 1..Len(Runnable)}

\* A spec row writes KV at outputs devN .. devN + K: all must be < Room. The host knows only Upper.
\* Hazard: KV past max_model_len. Near the limit speculation turns off, and stays off.
SpecFits(r) == ~SpecOffNearLimit \/ Upper(r) + K <= Room[r] - 1
KindOf(r) == IF computed[r] = 0 THEN "prefill"
             ELSE IF ~specOff[r] /\ SpecFits(r) THEN "spec" ELSE "plain"

\* What the device does for row r of kind `kind` accepting `a` drafts, at launch (the device runs
\* programs in order, so a step's values are fixed when it is enqueued).
InputOf(r, kind) ==
    \* Hazard: garbage token at the spec -> non-spec switch. The future row of a drafting step is
    \* [last accepted, d1 .. dK]; a plain row takes its first column, never its last (a draft).
    IF kind = "plain" /\ devDrafted[r] /\ ~InputIsLastAccepted THEN Draft(r, devN[r] + K) ELSE Tok(r, devN[r])
OutOf(r, kind, a) ==
    LET n == devN[r]
        good == InputOf(r, kind) = Tok(r, n)
        run == [j \in 1..a + 1 |-> IF good THEN Tok(r, n + j) ELSE Bad(r, n + j)]
        \* the verified ids past the accepted run: rejected drafts, -1 padding in the real output
        rejected == [j \in 1..Drafts(kind) - a |-> Draft(r, n + a + 1 + j)]
    \* Hazard: a rejected draft reaches the output. The row is cut to its 1 + a accepted tokens.
    IN IF TrimToAccepted THEN run ELSE run \o rejected

Launch ==
    /\ pc = "top" /\ Len(batchQueue) < Depth
    /\ \E order \in Schedules :
        LET rs == Range(order)
            kind == [i \in DOMAIN order |-> KindOf(order[i])]
            KindR(r) == kind[CHOOSE i \in DOMAIN order : order[i] = r]
        IN \E acc \in [DOMAIN order -> 0..K] :
            /\ \A i \in DOMAIN order : acc[i] <= Drafts(kind[i])
            /\ steps' = Append(steps, [rows |-> order, kind |-> kind,
                                      inIdx |-> [i \in DOMAIN order |-> devN[order[i]]],
                                      input |-> [i \in DOMAIN order |-> InputOf(order[i], kind[i])],
                                      acc |-> acc,
                                      out |-> [i \in DOMAIN order |-> OutOf(order[i], kind[i], acc[i])],
                                      mat |-> 0, applied |-> 0])
            /\ placeholders' = Override(placeholders, rs, LAMBDA r : placeholders[r] + 1 + Drafts(KindR(r)))
            /\ computed' = Override(computed, rs, LAMBDA r : computed[r] + 1 + Drafts(KindR(r)))
            /\ specOff' = Override(specOff, rs, LAMBDA r : specOff[r] \/ KindR(r) = "plain")
            /\ devN' = [r \in ReqSet |-> IF r \in rs THEN devN[r] + acc[CHOOSE i \in DOMAIN order : order[i] = r] + 1
                                         ELSE devN[r]]
            \* the drafter runs after every row of a request whose speculation is still on
            /\ devDrafted' = Override(devDrafted, rs, LAMBDA r : KindR(r) # "plain")
    /\ batchQueue' = Append(batchQueue, Len(steps) + 1)
    /\ outQueue' = Append(outQueue, Len(steps) + 1)
    /\ pc' = IF Len(batchQueue) + 1 < Depth THEN "top" ELSE "wait"
    /\ UNCHANGED <<status, delivered, stopLen>>

WaitOldest ==  \* the queue is full, or nothing can be scheduled: wait for the oldest output
    /\ pc = "top"
    /\ batchQueue # <<>>
    /\ Len(batchQueue) = Depth \/ Schedules = {}
    /\ pc' = "wait"
    /\ UNCHANGED <<status, delivered, placeholders, computed, specOff, stopLen, devN, devDrafted, steps,
                   batchQueue, outQueue>>

\* update_from_output for the oldest step, once materialized: reconcile, deliver token by token up
\* to a stop, finish.
AdvanceStep ==
    /\ pc = "wait"
    /\ batchQueue # <<>>
    /\ LET h == Head(batchQueue)
           st == steps[h]
           rs == Range(st.rows)
           getting == {r \in rs : status[r] = "running"}  \* a finished request's tokens are discarded
           Out(r) == st.out[RowOf(st, r)]
           \* what the host learns from the output: the accepted count, hence the rejected one
           Rejected(r) == Drafts(st.kind[RowOf(st, r)]) - (Len(Out(r)) - 1)
       IN
       /\ st.mat = 1  \* future.result(): the output thread has materialized it
       /\ \E eos \in [getting -> 0..K + 1] :  \* where in the run an EOS falls (0: nowhere)
           LET \* the stop inside the run: EOS, or max_tokens
               Cut(r) == LET m == MaxTokens[r] - Len(delivered[r]) IN
                         IF eos[r] # 0 /\ eos[r] < m THEN eos[r] ELSE m
               stopped == {r \in getting : Cut(r) <= Len(Out(r))}
               \* Hazard: a token after a stop. The run is cut at the stop.
               Taken(r) == IF TrimAtStop /\ r \in stopped THEN SubSeq(Out(r), 1, Cut(r)) ELSE Out(r)
           IN
           /\ \A r \in getting : eos[r] <= Len(Out(r)) /\ (r \notin MayStop => eos[r] = 0)
           /\ delivered' = Override(delivered, getting, LAMBDA r : delivered[r] \o Taken(r))
           /\ status' = Override(status, stopped, LAMBDA r : "finished")
           /\ stopLen' = Override(stopLen, stopped, LAMBDA r : Len(delivered[r]) + Cut(r))
           /\ computed' = Override(computed, rs, LAMBDA r : computed[r] - Rejected(r)
                                   - (IF r \in getting THEN Len(Out(r)) - Len(Taken(r)) ELSE 0))
       \* Hazard: placeholders never reconciled. A row gave 1 + a tokens of the 1 + drafts counted.
       /\ placeholders' = Override(placeholders, rs, LAMBDA r : placeholders[r] - Len(Out(r))
                                   - (IF ReconcilePlaceholders THEN Rejected(r) ELSE 0))
       /\ steps' = [steps EXCEPT ![h].applied = @ + 1]
       /\ batchQueue' = Tail(batchQueue)
    /\ pc' = "top"
    /\ UNCHANGED <<specOff, devN, devDrafted, outQueue>>

\* The async output thread: to_host of the oldest launched step.
\* A late request is admitted at the top of the engine loop: its first row (a prefill) is in the
\* next step, beside whatever the others have in flight.
Admit(r) ==
    /\ pc = "top"
    /\ status[r] = "waiting"
    /\ status' = [status EXCEPT ![r] = "running"]
    /\ UNCHANGED <<delivered, placeholders, computed, specOff, stopLen, devN, devDrafted, steps, batchQueue,
                   outQueue, pc>>

\* A client's abort, applied at the top of the engine loop (our engine core): the request finishes
\* with the tokens it has; its rows in flight still run, and their tokens are discarded when the
\* engine core applies them (AdvanceStep delivers only to running requests), their placeholders
\* reconciled as any row's.
Abort(r) ==
    /\ pc = "top"
    /\ r \in MayAbort
    /\ status[r] \in {"waiting", "running"}
    /\ status' = [status EXCEPT ![r] = "finished"]
    /\ stopLen' = [stopLen EXCEPT ![r] = Len(delivered[r])]
    /\ UNCHANGED <<delivered, placeholders, computed, specOff, devN, devDrafted, steps, batchQueue, outQueue, pc>>

Materialize ==
    /\ outQueue # <<>>
    /\ steps' = [steps EXCEPT ![Head(outQueue)].mat = @ + 1]
    /\ outQueue' = Tail(outQueue)
    /\ UNCHANGED <<status, delivered, placeholders, computed, specOff, stopLen, devN, devDrafted, batchQueue, pc>>

Terminated ==
    /\ \A r \in ReqSet : status[r] = "finished"
    /\ batchQueue = <<>> /\ outQueue = <<>> /\ pc = "top"

Done == Terminated /\ UNCHANGED vars  \* keeps TLC from calling a finished run a deadlock

Next == Launch \/ WaitOldest \/ AdvanceStep \/ Materialize \/ (\E r \in ReqSet : Admit(r) \/ Abort(r)) \/ Done

Spec == Init /\ [][Next]_vars

-----------------------------------------------------------------------------
(* Invariants                                                                *)

\* Every row's first input is its request's last accepted token: never a draft, rejected or not.
NextInputInv ==
    \A s \in 1..Len(steps) : \A i \in DOMAIN steps[s].rows :
        steps[s].input[i] = Tok(steps[s].rows[i], steps[s].inIdx[i])

\* Each client has received tokens 1..n of its own request, each exactly once and in order: every
\* accepted token, and never a rejected draft or a token computed from one.
AcceptedOnceInv ==
    \A r \in ReqSet : delivered[r] = [k \in 1..Len(delivered[r]) |-> Tok(r, k)]

\* Nothing reaches a client after its stop (EOS, stop token, max_tokens), wherever in an accepted
\* run the stop falls.
NoTokenAfterStopInv ==
    \A r \in ReqSet : Len(delivered[r]) <= stopLen[r] /\ Len(delivered[r]) <= MaxTokens[r]

\* The placeholders of r are exactly the 1 + drafts of its rows in flight (so never negative), and
\* the scheduler's computed count of a running request never runs past its received tokens plus them.
PlaceholderInv ==
    \A r \in ReqSet :
        /\ placeholders[r] = Reserved(InFlightSteps(r), r)
        /\ status[r] = "running" => computed[r] = Len(delivered[r]) + placeholders[r]

\* No row writes KV at a position past max_model_len: its inputs are outputs devN .. devN + drafts.
KVInBoundsInv ==
    \A s \in 1..Len(steps) : \A i \in DOMAIN steps[s].rows :
        steps[s].inIdx[i] + Drafts(steps[s].kind[i]) <= Room[steps[s].rows[i]] - 1

\* A decode row is a spec row exactly when its first output n fits one (n + K <= Room - 1): the row
\* sync mode, which knows n, builds there, so a seeded request draws the same tokens in both modes.
SwitchAtNInv ==
    \A s \in 1..Len(steps) : \A i \in DOMAIN steps[s].rows :
        steps[s].kind[i] # "prefill" =>
            (steps[s].kind[i] = "spec" <=> steps[s].inIdx[i] + K <= Room[steps[s].rows[i]] - 1)

-----------------------------------------------------------------------------
(* Reachability witnesses: each claims a situation is never reached; its     *)
(* witness model must make TLC violate it (manifest).                        *)

\* A stop inside an accepted run with accepted tokens after it (they are dropped).
StopInsideRunUnreached ==
    ~\E s \in 1..Len(steps) : \E i \in DOMAIN steps[s].rows :
        LET r == steps[s].rows[i] IN
        /\ steps[s].applied = 1 /\ steps[s].kind[i] = "spec"
        /\ stopLen[r] < steps[s].inIdx[i] + Len(steps[s].out[i])
        /\ stopLen[r] > steps[s].inIdx[i]
\* A row with rejected drafts applied while its request's next spec row is already on the device
\* (launched on the optimistic count).
RejectedBehindSpecUnreached ==
    ~\E s, t \in 1..Len(steps) :
        /\ s < t /\ steps[s].applied = 1 /\ t \in Range(batchQueue)
        /\ \E i \in DOMAIN steps[s].rows, j \in DOMAIN steps[t].rows :
            /\ steps[s].rows[i] = steps[t].rows[j]
            /\ steps[s].kind[i] = "spec" /\ steps[s].acc[i] < K /\ steps[t].kind[j] = "spec"

\* An abort of a request whose rows are in flight (a spec row among them), and a late request's
\* prefill launched while another request's spec row is in flight.
AbortAndLateUnreached ==
    ~/\ \E r \in MayAbort :
         /\ status[r] = "finished" /\ stopLen[r] < MaxTokens[r]
         /\ \E s \in InFlightSteps(r) : steps[s].kind[RowOf(steps[s], r)] = "spec"
     /\ \E r \in Late, s, t \in 1..Len(steps) :
         /\ s < t /\ t \in Range(batchQueue)
         /\ r \in Range(steps[t].rows) /\ steps[t].kind[RowOf(steps[t], r)] = "prefill"
         /\ \E i \in DOMAIN steps[s].rows : steps[s].rows[i] # r /\ steps[s].kind[i] = "spec" /\ s \in Range(batchQueue)

=============================================================================
