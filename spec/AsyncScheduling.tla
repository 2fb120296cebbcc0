--------------------------- MODULE AsyncScheduling ---------------------------
(***************************************************************************)
(* Async scheduling of LLM inference steps, at the level where its bugs    *)
(* live (neuron_async_sm; docs/spec.md maps every name below to the code). *)
(*                                                                         *)
(* - The engine core (main thread) schedules one step ahead: a batch queue *)
(*   of Depth steps, each scheduled while the previous one is in flight.   *)
(* - The worker (same thread) decides each step's path with the machine of *)
(*   worker/async_machine.py; the path actions carry the state names.      *)
(* - The device runs programs in order; a program that takes the previous  *)
(*   step's sampled-token future as input waits for it.                    *)
(* - The async output thread materializes every step's output, under the   *)
(*   output's lock; the main thread materializes the pending output itself *)
(*   when it breaks the async flow.                                        *)
(* - Requests arrive, finish (EOS is known only after materialization,     *)
(*   max_tokens ahead of time), are aborted, and condense() reorders rows. *)
(* - With AsyncRelay, a step whose future cannot be the input as it is     *)
(*   builds its input ids on the device instead: each row takes its token  *)
(*   from the previous future by a row map, or its host-known id (Relay).  *)
(* - EngineCore: our engine core or vLLM's drives the worker; they differ  *)
(*   in when a finishing request leaves the batch and when aborts apply.   *)
(* - Structured output: a step with a row that samples under a grammar     *)
(*   fires the machine's launch; when that row's newest token is in the    *)
(*   pending step, the step's sampling waits until the engine core has     *)
(*   applied it (SampleDeferred). Most models have no grammar (Constrained *)
(*   is empty; the vLLM ones with "Constrained" have one); trace           *)
(*   validation replaces it. StructuredOutput.tla checks the mask design   *)
(*   on its own.                                                           *)
(* - HostDrafter: speculation drafts on the host from each request's whole *)
(*   history (n-gram), so every step with a pending future materializes   *)
(*   it first (HostDraftBreak). Tokens per row: SpecDecode.tla's concern.  *)
(* - DeviceDrafter: speculation drafts on the device (draft_model): every  *)
(*   program drafts, its future holds each row's last accepted token then  *)
(*   the drafts. A step of the same rows that all verify drafts takes the  *)
(*   future as it is (SpecSteady); one whose rows all compute one token    *)
(*   (speculation off near max_model_len, for good) takes its first column *)
(*   (SpecExit). The abstract tokens stay one per row per step.            *)
(*                                                                         *)
(* Tokens are abstract: Tok(r, k) is the k-th output token of request r.   *)
(* A row that computes from a wrong input samples a Corrupt token.         *)
(***************************************************************************)
EXTENDS Integers, Sequences, FiniteSets, TLC

CONSTANTS
    Requests,      \* request ids (strings) in arrival order
    MaxSeqs,       \* KV slots: at most this many requests run at once
    Buckets,       \* padded row counts of a decode input
    Depth,         \* batch queue depth of the engine core (max_concurrent_batches = 2)
    MaxTokens,     \* [request -> max_tokens], capped by max_model_len
    MaxChunks,     \* a prompt is computed in at most this many prefill chunks
    MayAbort,      \* requests a client may abort
    AllowFailure,  \* programs may fail and the engine may die, which drains the pipeline
    AsyncRelay,    \* the switch --async-relay: the Relay path replaces the breaks, rebuilds and remaps
    \* The guards. The implementation has all of them; each must-fail model drops one.
    GetOutputLock,             \* get_output() materializes under the output's lock
    CompositionGuard,          \* CompositionBreak materializes before inputs are built
    RebuildOnShapeMismatch,    \* ShapeMismatchRebuild materializes, then builds inputs
    RebuildWhenNotAllDecode,   \* ... also when the same set is not all-decode (our deviation)
    RemapOnReorder,            \* ReorderRemap gathers the future's rows into the new order
    WriteBackBySnapshot,       \* write-back goes by the snapshot's ids, never by current row
    StateLockFreeWhileWaiting, \* the main thread never holds the CPU-state lock in get_output
    RemapIsSyncFallback,       \* a ReorderRemap step is counted as sync fallback, not async
    BatchQueueBounded,         \* the engine core waits for the oldest output when its queue is full
    RelayByRequestId,          \* the relay's row map finds a row's token by request id, never by row
    RelayOnlyNewestToken,      \* ... and only for a row whose previous step sampled the token it reads
    ExitReadsLastAccepted      \* SpecExit's rows read the drafted future's first column, never a draft's

ReqSet == {Requests[i] : i \in 1..Len(Requests)}
Threads == {"main", "output"}
PathStates == {"NoPendingFuture", "CompositionBreak", "ShapeMismatchRebuild", "ReorderRemap", "Steady", "Relay",
               "HostDraftBreak", "SpecSteady", "SpecExit"}
\* the paths counted as an async step: no host round trip
AsyncStates == {"Steady", "Relay", "SpecSteady", "SpecExit"}
LaunchStates == {"SampleInProgram", "SampleDeferred"}  \* structured output: when a masked step samples
MachineStates == PathStates \cup LaunchStates \cup {"Idle", "Reinstate"}
None == ""                  \* an empty row (a hole before condense())

Tok(r, k) == <<r, k>>       \* the k-th output token of r, sampled from r's own inputs
Corrupt(r, k) == <<r, -k>>  \* what a row samples from an input that is not r's previous token
Poison == <<None, 0>>       \* POISON_TOKEN: a token the host does not have yet
Draft(r, k) == <<r, k, "draft">>  \* a draft r's drafter proposed after its output k (DeviceDrafter)
Prompt == <<None, -1>>      \* prompt tokens: always on the host

Range(f) == {f[i] : i \in DOMAIN f}
Min(a, b) == IF a < b THEN a ELSE b
IndexOf(s, x) == CHOOSE i \in DOMAIN s : s[i] = x
Bucket(n) == CHOOSE b \in Buckets : b >= n /\ \A c \in Buckets : c >= n => b <= c
MaxOf(S) == CHOOSE m \in S : \A x \in S : x <= m
\* f with the entries on DOMAIN g (a subset of DOMAIN f) replaced by g's: the same function as
\* [x \in DOMAIN f |-> IF x \in DOMAIN g THEN g[x] ELSE f[x]], built with one EXCEPT per entry of g.
\* An action changes the requests it names, not every request: TLC then evaluates only their entries
\* (a long trace's part knows many requests; a step names a batch).
RECURSIVE OverrideOn(_, _, _)
OverrideOn(f, g, S) ==
    IF S = {} THEN f ELSE LET x == CHOOSE x \in S : TRUE IN OverrideOn([f EXCEPT ![x] = g[x]], g, S \ {x})
Override(f, g) == OverrideOn(f, g, DOMAIN g)
\* Every step schedules at least one prefill chunk or decode token.
StepBound == Len(Requests) * (MaxChunks + MaxOf(Range(MaxTokens)))

\* Which engine core drives the worker. Not a constant: a model replaces it (<-), as it does MayStop.
\* "ours" (engine/): with the relay on, a request left out by the pipelining gap gives its KV slot
\* back at once (Released), and a client's abort is applied at the top of the loop only. "vllm"
\* (vLLM's EngineCore and scheduler driving our worker, vllm_plugin/): a request keeps its KV blocks,
\* and its row in the worker's batch, until it finishes, relay or not; and an abort that arrives while
\* the engine core waits on its oldest step is applied once that step's output has resolved, just
\* before it is applied (EngineCore._process_aborts_queue in step_with_batch_queue), besides the
\* ones applied at the top of the loop. That wait is also the deferred path's (structured output):
\* there vLLM pops the oldest step, waits on it, applies aborts, applies the step, then builds the
\* deferred step's mask, the order of our engine core's _sample_deferred but for the aborts.
EngineCore == "ours"
\* Who calls get_output() on every output in order: a thread of its own (our async output thread,
\* vLLM's mp worker's output-copy thread), or, under vLLM's uni-process executor, the engine thread
\* itself, inside its wait for the oldest step (AsyncOutputFuture.result()). The spec's "output"
\* thread is that role; on the engine thread it acts only while the engine waits (or dies).
OutputOnEngineThread == FALSE
\* The requests that sample under a grammar (structured output): none in most models, whose state
\* counts this leaves alone; a model replaces it (<-) to check the deferred path (MCConstrained), and
\* trace validation with the requests its trace masks.
Constrained == {}
NoGrammar == -1  \* a mask row built for no grammar state: its request finished before the mask was built
\* Speculative decoding with a drafter that reads the host's token history (method "ngram"). Not a
\* constant: a model replaces it (<-), so the models without speculation keep their state graphs.
HostDrafter == FALSE
\* Speculative decoding with a drafter on the device (method "draft_model"): every step's program
\* drafts. Not a constant either: a model replaces it (<-), so the other models keep their graphs.
DeviceDrafter == FALSE

ASSUME /\ Depth = 2
       /\ MaxOf(Buckets) >= MaxSeqs
       /\ MayAbort \subseteq ReqSet

-----------------------------------------------------------------------------
(* condense(): input_batch.next_row_order, step for step.                  *)

Front(s) == SubSeq(s, 1, Len(s) - 1)
RECURSIVE TrimTail(_)
TrimTail(s) == IF s # <<>> /\ s[Len(s)] = None THEN TrimTail(Front(s)) ELSE s
FirstHole(s) == CHOOSE i \in DOMAIN s : s[i] = None /\ \A j \in 1..(i - 1) : s[j] # None
Place(s, r) == IF None \in Range(s) THEN [s EXCEPT ![FirstHole(s)] = r] ELSE Append(s, r)
RECURSIVE Fill(_, _)
Fill(s, added) == IF added = <<>> THEN s ELSE Fill(Place(s, Head(added)), Tail(added))
RECURSIVE Condense(_, _)
Condense(s, hole) ==
    LET t == TrimTail(s) IN
    IF hole > Len(t) THEN t
    ELSE IF t[hole] = None THEN Condense([Front(t) EXCEPT ![hole] = t[Len(t)]], hole + 1)
    ELSE Condense(t, hole + 1)

\* Removed requests leave holes, new ones fill the lowest holes then append, condense() closes the rest.
NextRowOrder(rs, removed, added) ==
    Condense(Fill([i \in DOMAIN rs |-> IF rs[i] \in removed THEN None ELSE rs[i]], added), 1)

-----------------------------------------------------------------------------
(* The machine's decision: async_machine.decide(), conditions in table order. *)

CompositionChanged(o) == Range(o.prevReqIds) # Range(o.currReqIds)
Rows(shape) == IF shape = <<>> THEN <<>> ELSE <<shape[1]>>  \* shape[:1]
\* A drafted future ([rows, 1 + k] after the tokens) fits a step of its row count whose rows all
\* verify drafts or all compute one token; a mixture, or a prefill row, does not.
FutureDoesNotFit(o) ==
    IF o.pendingDrafted
    THEN ~(o.allSpec \/ o.allDecode) \/ Rows(o.pendingShape) # Rows(o.inputShape) \/ o.pendingDtype # o.inputDtype
    ELSE ~o.allDecode \/ o.pendingShape # o.inputShape \/ o.pendingDtype # o.inputDtype
OrderChanged(o) == o.prevReqIds # o.currReqIds
\* Same set, order and rows (the rows before caught any change): every row verifies the drafts the
\* pending program proposed (spec_steady), or every row computes one token (spec_exit).
VerifiesDrafts(o) == o.pendingDrafted /\ o.allSpec
LeavesDrafts(o) == o.pendingDrafted /\ o.allDecode
\* The engine relays and the future cannot be the input as it is (what would otherwise break).
RelayCovers(o) == o.relay /\ (CompositionChanged(o) \/ FutureDoesNotFit(o) \/ OrderChanged(o))

Decide(o) ==
    IF ~o.hasPending THEN "NoPendingFuture"
    ELSE IF o.hostDrafter THEN "HostDraftBreak"
    ELSE IF RelayCovers(o) THEN "Relay"
    ELSE IF CompositionChanged(o) THEN "CompositionBreak"
    ELSE IF FutureDoesNotFit(o) THEN "ShapeMismatchRebuild"
    ELSE IF OrderChanged(o) THEN "ReorderRemap"
    ELSE IF VerifiesDrafts(o) THEN "SpecSteady"
    ELSE IF LeavesDrafts(o) THEN "SpecExit"
    ELSE "Steady"

SampledDtype == "int32"     \* the program's output dtype, equal to the input_ids dtype
\* A decode input is [bucket]; a prefill or mixed input is 2-D. Its sampled tokens are [rows]:
\* a prefill step is not padded in rows. With a drafter on the device every input is [rows, L]
\* (a row's last accepted token, then its drafts), and the future one row per row.
InputShape(n, allDecode) == IF allDecode /\ ~DeviceDrafter THEN <<Bucket(n)>> ELSE <<n, 0>>
OutputShape(n, allDecode) == IF allDecode /\ ~DeviceDrafter THEN <<Bucket(n)>> ELSE <<n>>

-----------------------------------------------------------------------------
VARIABLES
    \* Scheduler (engine core, main thread)
    arrived,       \* how many of Requests have been added
    status,        \* [r -> "absent" | "waiting" | "running" | "finished"]
    phase,         \* [r -> "prefill" | "decode" | "plain"]: is the prompt computed (as far as the scheduler
                   \* knows); "plain": and speculation (DeviceDrafter) turned off for good
    chunks,        \* [r -> Nat]: prefill chunks scheduled so far
    placeholders,  \* [r -> Nat]: sampled tokens of steps in flight (num_output_placeholders)
    delivered,     \* [r -> Seq(token)]: what the client received
    stopLen,       \* [r -> Nat]: outputs r had when it stopped or was aborted (history)
    finishedIds,   \* requests finished since the previous schedule (finished_req_ids)
    batchQueue,    \* steps the engine core enqueued and has not applied, oldest first
    \* Worker
    mstate,        \* AsyncStepMachine state
    rows,          \* InputBatch row order
    host,          \* [r -> Seq(token)]: the worker's CPU token state, by output index
    pending,       \* the step whose future and output the async buffer holds (0: none)
    cur,           \* the step being executed: scheduler output, observation, path
    stateLock,     \* holder of the worker's CPU-state lock while it waits on an output
    numAsync,      \* async_steps
    numSync,       \* sync_fallback_steps
    \* Device and outputs
    steps,         \* Seq of step records, indexed by step id (step_id + 1)
    ran,           \* programs the device has run (it runs them in order): steps 1..ran
    outQueue,      \* steps queued to the async output thread, oldest first
    pc             \* [thread -> program counter]

vars == <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
          mstate, rows, host, pending, cur, stateLock, numAsync, numSync, steps, ran, outQueue, pc>>

NoCur == [path |-> None]
\* The main thread's program counter; "defer" and "mask" only for a step whose sampling waits or
\* whose mask is being built (structured output).
MainPcs == {"top", "get", "transfer", "exec", "defer", "mask", "wait", "failing", "dead"}
Token == (ReqSet \X Int) \cup {Poison, Prompt}

TypeOK ==
    /\ arrived \in 0..Len(Requests)
    /\ status \in [ReqSet -> {"absent", "waiting", "running", "finished"}]
    /\ phase \in [ReqSet -> {"prefill", "decode", "plain"}]
    /\ chunks \in [ReqSet -> 0..MaxChunks]
    /\ placeholders \in [ReqSet -> Nat]
    /\ \A r \in ReqSet : delivered[r] \in Seq(Token) /\ stopLen[r] \in Nat
    /\ finishedIds \subseteq ReqSet
    /\ Range(batchQueue) \subseteq 1..Len(steps)
    /\ mstate \in MachineStates
    /\ Range(rows) \subseteq ReqSet
    /\ \A r \in ReqSet : host[r] \in Seq(Token)
    /\ pending \in 0..Len(steps)
    /\ stateLock \in {"none", "main"}
    /\ numAsync \in Nat /\ numSync \in Nat
    /\ \A s \in 1..Len(steps) :
        /\ DOMAIN steps[s] = {"rows", "outIdx", "input", "result", "path", "shape", "ok", "mat", "lock"}
        /\ steps[s].path \in PathStates
        /\ steps[s].mat \in Nat /\ steps[s].lock \in Threads \cup {"none"}
        /\ steps[s].ok \in BOOLEAN
    /\ ran \in 0..Len(steps)
    /\ Range(outQueue) \subseteq 1..Len(steps)
    /\ pc \in [Threads -> MainPcs]

Init ==
    /\ arrived = 0
    /\ status = [r \in ReqSet |-> "absent"]
    /\ phase = [r \in ReqSet |-> "prefill"]
    /\ chunks = [r \in ReqSet |-> 0]
    /\ placeholders = [r \in ReqSet |-> 0]
    /\ delivered = [r \in ReqSet |-> <<>>]
    /\ stopLen = [r \in ReqSet |-> MaxTokens[r]]
    /\ finishedIds = {}
    /\ batchQueue = <<>>
    /\ mstate = "Idle"
    /\ rows = <<>>
    /\ host = [r \in ReqSet |-> <<>>]
    /\ pending = 0
    /\ cur = NoCur
    /\ stateLock = "none"
    /\ numAsync = 0
    /\ numSync = 0
    /\ steps = <<>>
    /\ ran = 0
    /\ outQueue = <<>>
    /\ pc = [main |-> "top", output |-> "get"]

-----------------------------------------------------------------------------
(* The client, between two turns of the engine loop (main thread).         *)

AddRequest ==
    /\ pc["main"] = "top"
    /\ arrived < Len(Requests)
    /\ status' = [status EXCEPT ![Requests[arrived + 1]] = "waiting"]
    /\ arrived' = arrived + 1
    /\ UNCHANGED <<phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue, mstate, rows, host,
                   pending, cur, stateLock, numAsync, numSync, steps, outQueue, pc, ran>>

Stop(r) ==  \* r finishes now: nothing it samples later is delivered
    /\ status' = [status EXCEPT ![r] = "finished"]
    /\ stopLen' = [stopLen EXCEPT ![r] = Len(delivered[r])]
    /\ finishedIds' = IF status[r] = "running" THEN finishedIds \cup {r} ELSE finishedIds

\* A step's output is resolved once no thread still has to materialize it.
Resolved(s) == s \notin Range(outQueue)

\* Where the engine core applies a client's abort: at the top of its loop; vLLM's also after its
\* oldest step's output resolved and before that output is applied (with two steps in flight), on
\* the deferred path too, before the deferred step's mask is built.
AbortPoint ==
    \/ pc["main"] = "top"
    \/ EngineCore = "vllm" /\ pc["main"] \in {"wait", "defer"} /\ batchQueue # <<>> /\ Resolved(Head(batchQueue))

Abort(r) ==
    /\ AbortPoint
    /\ r \in MayAbort
    /\ status[r] \in {"waiting", "running"}
    /\ Stop(r)
    /\ UNCHANGED <<arrived, phase, chunks, placeholders, delivered, batchQueue, mstate, rows, host, pending, cur,
                   stateLock, numAsync, numSync, steps, outQueue, pc, ran>>

-----------------------------------------------------------------------------
(* The scheduler's choices for one step (scheduler.schedule). Running       *)
(* requests are served in admission order, then waiting ones are admitted   *)
(* FIFO into free slots. The token budget is abstract: it can run out, but  *)
(* only on a prefill chunk, and a partial prefill chunk is always the last  *)
(* request served. A decode is not scheduled when the tokens in flight      *)
(* already reach max_tokens (the pipelining gap).                           *)

IsRunning(r) == status[r] = "running"
IsWaiting(r) == status[r] = "waiting"
Schedulable(r) == phase[r] = "prefill" \/ Len(delivered[r]) + placeholders[r] < MaxTokens[r]
\* Under speculation a request with a grammar runs one step at a time (Scheduler._spec_row): its drafts
\* and its mask rows need its newest token, so it sits out while a step of it is in flight. It keeps
\* its slot meanwhile (not Released: its next step comes).
OneStepAtATime(r) == r \in Constrained /\ (HostDrafter \/ DeviceDrafter) => placeholders[r] = 0
MayRun(r) == Schedulable(r) /\ OneStepAtATime(r)

\* With the relay on, a request whose last token is in flight gives its KV slot back when our
\* scheduler leaves it out (scheduler._release_slot): it no longer holds a slot and leaves the
\* worker's rows, while it stays running until that token is applied. With the relay off, and under
\* vLLM's scheduler (its blocks are freed when the request finishes), it holds the slot until then.
Released == IF AsyncRelay /\ EngineCore = "ours" THEN {r \in ReqSet : IsRunning(r) /\ ~Schedulable(r)} ELSE {}

Schedules ==
    LET run == SelectSeq(Requests, IsRunning)
        wait == SelectSeq(Requests, IsWaiting)
        HoldsSlot(r) == r \notin Released
        maxAdmit == Min(Len(wait), MaxSeqs - Len(SelectSeq(run, HoldsSlot)))
        Choice(j, k) == [order |-> SelectSeq(SubSeq(run, 1, j), MayRun) \o SubSeq(wait, 1, k),
                         admitted |-> SubSeq(wait, 1, k),
                         full |-> j = Len(run) /\ k = maxAdmit]
        choices == {Choice(j, k) : j \in 0..Len(run), k \in 0..maxAdmit}
        valid == {c \in choices : /\ c.order # <<>>
                                  /\ Len(c.admitted) > 0 => \A i \in 1..Len(run) : run[i] \in Range(c.order)
                                                                                   \/ ~MayRun(run[i])
                                  /\ ~c.full => \E i \in DOMAIN c.order : phase[c.order[i]] = "prefill"}
        Last(c) == c.order[Len(c.order)]
        \* A prefill request completes (samples its first token) unless it is the last one served
        \* and the budget cut its chunk short.
        Partial(c) == IF phase[Last(c)] = "prefill" /\ chunks[Last(c)] + 1 < MaxChunks
                      THEN {{}, {Last(c)}} ELSE {{}}
    IN UNION {{[order |-> c.order, admitted |-> c.admitted, partial |-> p] : p \in Partial(c)} : c \in valid}

-----------------------------------------------------------------------------
(* step: the engine core schedules, the worker observes and decides. One    *)
(* action per path state (the machine's `step` trigger and its destination). *)

\* The request id the machine sees for a request: its name here. (Trace validation overrides it: a
\* client may reuse an id once its request finished, and the trace names the new request "id#2".)
IdOf(r) == r

Observation(curr, allDecode, allSpec) ==
    [hasPending |-> pending # 0,
     prevReqIds |-> IF pending # 0 THEN [i \in DOMAIN steps[pending].rows |-> IdOf(steps[pending].rows[i])] ELSE <<>>,
     currReqIds |-> [i \in DOMAIN curr |-> IdOf(curr[i])],
     allDecode |-> allDecode,
     pendingShape |-> IF pending # 0 THEN steps[pending].shape ELSE <<>>,
     pendingDtype |-> IF pending # 0 THEN SampledDtype ELSE None,
     inputShape |-> InputShape(Len(curr), allDecode),
     inputDtype |-> SampledDtype,
     relay |-> AsyncRelay,
     hostDrafter |-> HostDrafter,
     \* with a device drafter every program drafts: its future's first column is each row's last token
     pendingDrafted |-> pending # 0 /\ DeviceDrafter,
     allSpec |-> allSpec]

\* Does the path materialize the pending output before inputs are built on the CPU?
Materializes(path, allDecode) ==
    \/ path = "HostDraftBreak"
    \/ path = "CompositionBreak" /\ CompositionGuard
    \/ path = "ShapeMismatchRebuild" /\ RebuildOnShapeMismatch /\ (allDecode \/ RebuildWhenNotAllDecode)

\* Where the path's decode rows take their input ids from (a prefill row's input is its prompt):
\* the CPU-built ones, the pending future as it is, the future's rows gathered into the new order,
\* or built on the device from the future by a row map, each unmapped row keeping its CPU-built id.
\* With Materializes, what async_machine.PLANS declares per path state (model_check checks both agree).
\* A drafted future's rows are the last accepted token and the drafts: SpecSteady takes them as they
\* are, SpecExit only the first column (the mutant: the last column, a draft).
InputSource(path) ==
    CASE path = "Steady" -> "future"
      [] path = "ReorderRemap" -> IF RemapOnReorder THEN "remapped_future" ELSE "future"
      [] path = "Relay" -> "relayed_future"
      [] path = "SpecSteady" -> "drafted_future"
      [] path = "SpecExit" -> IF ExitReadsLastAccepted THEN "future_last_accepted" ELSE "future_last_draft"
      [] OTHER -> "cpu"

\* With a device drafter, the speculating decode rows whose speculation may turn off at this step
\* (the scheduler's room check near max_model_len; any of them, here): then for good.
SpecOffChoices(scheduled) ==
    IF DeviceDrafter THEN SUBSET {r \in scheduled : phase[r] = "decode"} ELSE {{}}

\* With a device drafter, the decode rows under a grammar whose drafts the scheduler cut this step
\* (to the grammar-valid prefix: Scheduler._grammar_drafts): to none (`zero`, a one-token row) or to
\* fewer than k (`some`). For this step only: the next row of the request may verify k again.
CutChoices(scheduled) ==
    LET C == {r \in scheduled \cap Constrained : phase[r] = "decode"}
    IN IF DeviceDrafter THEN {x \in [zero : SUBSET C, some : SUBSET C] : x.zero \cap x.some = {}}
       ELSE {[zero |-> {}, some |-> {}]}

\* What the worker makes of one scheduler choice: the row order after update, the observation,
\* and the path the machine takes. Building the set evaluates every plan completely. `off`: the
\* requests whose speculation turns off now (SpecOffChoices); `cut`: the rows whose drafts a grammar
\* cut (CutChoices).
Plan(sch, off, cut) ==
    LET scheduled == Range(sch.order)
        order == NextRowOrder(rows, (finishedIds \cup Released) \cap Range(rows), sch.admitted)
        InStep(r) == r \in scheduled
        curr == SelectSeq(order, InStep)
        \* a one-token decode row; with a device drafter, a decode row verifies drafts until it is plain
        Plain(r) == phase[r] = "plain" \/ r \in off \/ (~DeviceDrafter /\ phase[r] = "decode")
        allDecode == \A r \in scheduled : Plain(r) \/ r \in cut.zero
        allSpec == \A r \in scheduled : phase[r] = "decode" /\ ~Plain(r) /\ r \notin cut.zero \cup cut.some
        sampling == scheduled \ sch.partial
        o == Observation(curr, allDecode, allSpec)
    IN [path |-> Decide(o), obs |-> o, order |-> order, curr |-> curr, allDecode |-> allDecode,
        admitted |-> Range(sch.admitted), scheduled |-> scheduled, sampling |-> sampling,
        decode |-> {r \in scheduled : phase[r] # "prefill"}, off |-> off,
        \* the output index each row samples (0: a partial prefill chunk samples nothing)
        outIdx |-> [i \in 1..Len(curr) |-> IF curr[i] \in sampling
                                          THEN Len(delivered[curr[i]]) + placeholders[curr[i]] + 1
                                          ELSE 0],
        \* structured output: the requests sampling under a grammar, and each one's mask once built
        masked |-> sampling \cap Constrained, mask |-> <<>>]
\* The scheduler choices the worker may see: all of them. (Trace validation overrides it with the
\* ones whose request set its next step event shows, so that only those are planned.)
ScheduleChoices == Schedules
Plans == UNION {{Plan(sch, off, cut) : off \in SpecOffChoices(Range(sch.order)), cut \in CutChoices(Range(sch.order))}
                : sch \in ScheduleChoices}

\* Hazard: unbounded pipeline. A full batch queue waits for its oldest output (WaitOldest) instead.
StepReady == pc["main"] = "top" /\ (Len(batchQueue) < Depth \/ ~BatchQueueBounded)

TakePath(p) ==
    /\ status' = Override(status, [r \in p.admitted |-> "running"])
    /\ phase' = Override(phase, [r \in p.sampling |-> IF phase[r] = "plain" \/ r \in p.off THEN "plain" ELSE "decode"])
    \* p.sampling \subseteq p.scheduled: a sampling request's count restarts, any other scheduled one counts a chunk
    /\ chunks' = Override(chunks, [r \in p.scheduled |-> IF r \in p.sampling THEN 0 ELSE chunks[r] + 1])
    /\ placeholders' = Override(placeholders, [r \in p.sampling |-> placeholders[r] + 1])
    /\ finishedIds' = {}
    /\ cur' = p
    /\ mstate' = p.path
    /\ LET async == p.path \in AsyncStates \/ (p.path = "ReorderRemap" /\ ~RemapIsSyncFallback) IN
       /\ numAsync' = numAsync + (IF async THEN 1 ELSE 0)
       /\ numSync' = numSync + (IF async THEN 0 ELSE 1)
    \* Hazard: stale input ids. Break and rebuild paths bring the pending output to the host
    \* before anything reads the CPU token state.
    /\ pc' = [pc EXCEPT !["main"] = IF Materializes(p.path, p.allDecode) THEN "get" ELSE "exec"]
    \* Hazard: deadlock. Holding the CPU-state lock across get_output() blocks the output thread's write-back.
    /\ stateLock' = IF Materializes(p.path, p.allDecode) /\ ~StateLockFreeWhileWaiting THEN "main" ELSE stateLock
    /\ UNCHANGED <<arrived, delivered, stopLen, batchQueue, rows, host, pending, steps, outQueue, ran>>

NoPendingFuture == StepReady /\ \E p \in Plans : p.path = "NoPendingFuture" /\ TakePath(p)
CompositionBreak == StepReady /\ \E p \in Plans : p.path = "CompositionBreak" /\ TakePath(p)
ShapeMismatchRebuild == StepReady /\ \E p \in Plans : p.path = "ShapeMismatchRebuild" /\ TakePath(p)
ReorderRemap == StepReady /\ \E p \in Plans : p.path = "ReorderRemap" /\ TakePath(p)
Steady == StepReady /\ \E p \in Plans : p.path = "Steady" /\ TakePath(p)
Relay == StepReady /\ \E p \in Plans : p.path = "Relay" /\ TakePath(p)
HostDraftBreak == StepReady /\ \E p \in Plans : p.path = "HostDraftBreak" /\ TakePath(p)
SpecSteady == StepReady /\ \E p \in Plans : p.path = "SpecSteady" /\ TakePath(p)
SpecExit == StepReady /\ \E p \in Plans : p.path = "SpecExit" /\ TakePath(p)

-----------------------------------------------------------------------------
(* get_output(): the output thread on every output in order, the main thread *)
(* on the pending one when it breaks the async flow.                         *)

Target(t) == IF t = "main" THEN pending ELSE Head(outQueue)
\* The output role on the engine thread (OutputOnEngineThread) runs inside the engine core's wait for
\* its oldest step, or while the dying engine resolves what it holds.
OutputRoleFree == ~OutputOnEngineThread \/ pc["main"] \in {"wait", "defer", "failing"}
Calling(t) == IF t = "main" THEN pc["main"] = "get" ELSE pc["output"] = "get" /\ outQueue # <<>> /\ OutputRoleFree
Returned(t, ok) ==  \* get_output() returned (ok) or raised; the output thread resolves the engine's future
    IF t = "main" THEN pc' = [pc EXCEPT !["main"] = IF ok THEN "exec" ELSE "failing"] /\ outQueue' = outQueue
    ELSE pc' = [pc EXCEPT !["output"] = "get"] /\ outQueue' = Tail(outQueue)
LockFree(s) == GetOutputLock => steps[s].lock = "none"

GetOutput(t) ==  \* enter get_output(): take the output's lock; nothing materialized yet
    /\ Calling(t)
    /\ LockFree(Target(t))  \* Hazard: double materialization. Only one thread gets past this.
    /\ steps[Target(t)].mat = 0
    /\ steps' = IF GetOutputLock THEN [steps EXCEPT ![Target(t)].lock = t] ELSE steps
    /\ pc' = [pc EXCEPT ![t] = "transfer"]
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   mstate, rows, host, pending, cur, stateLock, numAsync, numSync, outQueue, ran>>

GetOutputCached(t) ==  \* get_output() on an output that is already materialized returns its result
    /\ Calling(t)
    /\ LockFree(Target(t))
    /\ steps[Target(t)].mat > 0
    /\ Returned(t, steps[Target(t)].ok)
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   mstate, rows, host, pending, cur, stateLock, numAsync, numSync, steps, ran>>

\* CachedRequestState.write_token: positions not written yet hold POISON_TOKEN.
WriteAt(seq, k, v) == [j \in 1..(IF k > Len(seq) THEN k ELSE Len(seq)) |->
                          IF j = k THEN v ELSE IF j <= Len(seq) THEN seq[j] ELSE Poison]
HostTok(r, k) == IF k \in DOMAIN host[r] THEN host[r][k] ELSE Poison

\* Write-back of step s's sampled tokens into the CPU token state.
WriteBack(s) ==
    LET st == steps[s]
        \* Hazard: tokens written to the wrong request. The snapshot's ids, never the current rows.
        Owner(i) == IF WriteBackBySnapshot THEN st.rows[i] ELSE IF i <= Len(rows) THEN rows[i] ELSE None
        Written(r) == {i \in DOMAIN st.rows : st.outIdx[i] > 0 /\ Owner(i) = r}
        owners == {Owner(i) : i \in {i \in DOMAIN st.rows : st.outIdx[i] > 0}} \cap ReqSet  \* Written(r) # {}
    IN Override(host, [r \in owners |-> LET i == CHOOSE i \in Written(r) : TRUE
                                         IN WriteAt(host[r], st.outIdx[i], st.result[i])])

Materialize(t) ==  \* transfer to the host and write back; blocks until the program ran
    /\ pc[t] = "transfer"
    /\ Target(t) <= ran
    /\ stateLock = "main" => t = "main"  \* the write-back takes the CPU-state lock (re-entrant)
    /\ host' = IF steps[Target(t)].ok THEN WriteBack(Target(t)) ELSE host  \* a failed program raises instead
    /\ steps' = [steps EXCEPT ![Target(t)].mat = @ + 1, ![Target(t)].lock = "none"]
    /\ Returned(t, steps[Target(t)].ok)
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   mstate, rows, pending, cur, stateLock, numAsync, numSync, ran>>

\* A step the engine core has applied and that no longer feeds the next one keeps only what the
\* counters and the materialization checks read: its rows, inputs and tokens go (long traces stay cheap).
Retire(st) == [st EXCEPT !.rows = <<>>, !.outIdx = <<>>, !.input = <<>>, !.result = <<>>]

\* The relay's row map (model_runner._relay_rows): for each row of step c, the row of the previous
\* step prev whose sampled token it computes on, or 0 when it has none there (it keeps its
\* CPU-built id: a prompt chunk, or a token already on the host).
RelayFrom(c, prev) ==
    LET \* Hazard: stale input ids. Only a decode row whose token the previous step sampled.
        Newest(r, j) == RelayOnlyNewestToken => r \in c.decode /\ prev.outIdx[j] > 0
        Source(i) ==
            LET r == c.curr[i] IN
            \* Hazard: token ownership. By request id: rows move and leave between the two steps.
            IF RelayByRequestId
            THEN IF r \in Range(prev.rows) /\ Newest(r, IndexOf(prev.rows, r)) THEN IndexOf(prev.rows, r) ELSE 0
            ELSE IF i <= Len(prev.rows) /\ Newest(r, i) THEN i ELSE 0
    IN [i \in DOMAIN c.curr |-> Source(i)]

-----------------------------------------------------------------------------
(* launch (structured output): a step with a row that samples under a      *)
(* grammar decides when it samples, after its path and before reinstate.   *)
(* A step without one never launches: it goes from its path to Reinstate.  *)

\* The machine's mask_waits: a masked row's newest token is in the pending step (its grammar lacks it).
MaskWaits(c) ==
    /\ pending # 0
    /\ \E i \in DOMAIN steps[pending].rows : steps[pending].rows[i] \in c.masked /\ steps[pending].outIdx[i] > 0

\* The mask of each masked row, from its grammar as it is now: the grammar has taken the request's
\* delivered tokens (StructuredOutput.tla's GrammarSyncInv), so it stands at Len(delivered[r]). A
\* request finished meanwhile gets no grammar row: its token is discarded. (Trace validation replaces
\* it with the grammar states the engine logged.)
StepMask(c) == [r \in c.masked |-> IF status[r] = "finished" THEN NoGrammar ELSE Len(delivered[r])]

\* The mask step c built for r's output k (if r is masked) is r's grammar after its tokens 1..k-1, or
\* none because r finished before it was built (its token is discarded).
MaskFresh(c, r, k) ==
    r \in DOMAIN c.mask => c.mask[r] = k - 1 \/ (c.mask[r] = NoGrammar /\ status[r] = "finished")

Launch(dest) ==
    /\ pc["main"] = "exec"
    /\ mstate \in PathStates
    /\ cur.masked # {}
    /\ mstate' = dest
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   rows, host, pending, cur, stateLock, numAsync, numSync, steps, ran, outQueue>>

\* Every masked row's grammar holds its newest token: the mask is built now, an input of the program.
SampleInProgram ==
    /\ Launch("SampleInProgram")
    /\ ~MaskWaits(cur)
    /\ pc' = [pc EXCEPT !["main"] = "mask"]

\* A masked row's newest token is in the pending step: the forward is enqueued, and the engine core
\* applies the pending step (AdvanceStep) before it builds the mask; with nothing left to apply (the
\* pending step was applied after an empty schedule) it builds the mask at once. The inputs this spec
\* builds at Reinstate are the same then: a path that builds them on the CPU has materialized first.
SampleDeferred ==
    /\ Launch("SampleDeferred")
    /\ MaskWaits(cur)
    /\ pc' = [pc EXCEPT !["main"] = IF batchQueue = <<>> THEN "mask" ELSE "defer"]

\* The scheduler fills the step's bitmask (the trace's `mask` event); the sampling is enqueued at Reinstate.
BuildMask ==
    /\ pc["main"] = "mask"
    /\ cur' = [cur EXCEPT !.mask = StepMask(cur)]
    /\ pc' = [pc EXCEPT !["main"] = "exec"]
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   mstate, rows, host, pending, stateLock, numAsync, numSync, steps, ran, outQueue>>

-----------------------------------------------------------------------------
(* reinstate: update the batch, build inputs as the path says, enqueue the   *)
(* program, snapshot the row owners, refill the async buffer.                *)

\* Row j of the previous step's future: the token it sampled, or nothing (Poison).
FutureRow(prev, j) == IF j \in DOMAIN prev.rows /\ prev.outIdx[j] > 0 THEN prev.result[j] ELSE Poison
\* A drafted future's row j past its first column: a draft proposed after the token row j sampled.
FutureDraft(prev, j) ==
    IF j \in DOMAIN prev.rows /\ prev.outIdx[j] > 0 THEN Draft(prev.rows[j], prev.outIdx[j]) ELSE Poison

\* The input id each row of step c computes on, as the path's plan builds it. (Trace validation
\* overrides it with the inputs the engine logged, so that the invariants judge the real ones.)
StepInputs(c, prev) ==
    LET relay == RelayFrom(c, prev)
        Input(i) ==
            LET r == c.curr[i] IN
            \* Built on the device: where(map >= 0, future[map], host ids).
            IF InputSource(c.path) = "relayed_future" /\ relay[i] > 0 THEN FutureRow(prev, relay[i])
            ELSE IF r \notin c.decode THEN Prompt
            \* Device-to-device: the future is the input (a drafted one: each row's last accepted
            \* token, then its drafts, which the abstract tokens leave out).
            ELSE IF InputSource(c.path) \in {"future", "drafted_future", "future_last_accepted"} THEN FutureRow(prev, i)
            \* Hazard: a draft as input. A one-token row after a drafting step reads a draft's column.
            ELSE IF InputSource(c.path) = "future_last_draft" THEN FutureDraft(prev, i)
            \* Hazard: token ownership after condense(). Row i must get curr[i]'s token, not prev[i]'s.
            ELSE IF InputSource(c.path) = "remapped_future" THEN FutureRow(prev, IndexOf(prev.rows, r))
            \* CPU-built: the host copy of r's previous output (POISON_TOKEN when not there yet).
            ELSE HostTok(r, c.outIdx[i] - 1)
    IN [i \in DOMAIN c.curr |-> Input(i)]

Reinstate ==
    /\ pc["main"] = "exec"
    /\ cur.masked # {} => mstate \in LaunchStates  \* a masked step has launched, and its mask is built
    /\ LET c == cur
           s == Len(steps) + 1
           prev == IF pending # 0 THEN steps[pending] ELSE [rows |-> <<>>]
           inputs == StepInputs(c, prev)
           Result(i) ==
               LET r == c.curr[i]
                   k == c.outIdx[i]
               IN IF k = 0 THEN Poison
                  \* Hazard: stale mask. A row sampled under another grammar state samples another token.
                  ELSE IF (inputs[i] = Prompt \/ inputs[i] = Tok(r, k - 1)) /\ MaskFresh(c, r, k) THEN Tok(r, k)
                  ELSE Corrupt(r, k)
       IN
       /\ steps' = Append(IF pending # 0 /\ pending \notin Range(batchQueue)
                          THEN [steps EXCEPT ![pending] = Retire(@)] ELSE steps,
                          [rows |-> c.curr, outIdx |-> c.outIdx, input |-> inputs,
                           result |-> [i \in DOMAIN c.curr |-> Result(i)],
                           path |-> c.path, shape |-> OutputShape(Len(c.curr), c.allDecode),
                           ok |-> TRUE, mat |-> 0, lock |-> "none"])
       /\ rows' = c.order
       /\ pending' = s
       /\ batchQueue' = Append(batchQueue, s)
       /\ outQueue' = Append(outQueue, s)
       /\ pc' = [pc EXCEPT !["main"] = IF Len(batchQueue) + 1 < Depth \/ ~BatchQueueBounded THEN "top" ELSE "wait"]
    /\ mstate' = "Reinstate"
    /\ cur' = NoCur
    /\ stateLock' = "none"
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, host,
                   numAsync, numSync, ran>>

-----------------------------------------------------------------------------
(* The device and the rest of the engine loop.                               *)

DeviceRun ==  \* programs run in enqueue order; each one's input future is the previous output
    /\ ran < Len(steps)
    /\ ran' = ran + 1
    /\ \E ok \in IF AllowFailure THEN BOOLEAN ELSE {TRUE} : steps' = [steps EXCEPT ![ran + 1].ok = ok]
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   mstate, rows, host, pending, cur, stateLock, numAsync, numSync, outQueue, pc>>

\* With a device drafter, a speculating request near max_model_len waits for its row in flight before
\* its switch to plain rows, so that the switch falls where sync mode's exact count puts it
\* (SpecDecode.tla's SwitchKnown; any such request may wait, here).
SwitchWait == DeviceDrafter /\ \E r \in ReqSet : IsRunning(r) /\ phase[r] = "decode"

WaitOldest ==  \* the queue is full, or nothing can be scheduled: wait for the oldest output (future.result())
    /\ pc["main"] = "top"
    /\ batchQueue # <<>>
    /\ Len(batchQueue) = Depth \/ Schedules = {} \/ SwitchWait
    /\ pc' = [pc EXCEPT !["main"] = "wait"]
    /\ UNCHANGED <<arrived, status, phase, chunks, placeholders, delivered, stopLen, finishedIds, batchQueue,
                   mstate, rows, host, pending, cur, stateLock, numAsync, numSync, steps, outQueue, ran>>

\* Requests whose newest token may turn out to be EOS or a stop token: any of them. (Trace
\* validation overrides it with the ones its trace never schedules again, to prune early.)
MayStop == ReqSet

\* Does the engine core hand row i's token of step st to its request? Only while it is unfinished.
\* (Trace validation overrides it with the requests the engine logged a token for.)
Delivers(st, i) == status[st.rows[i]] # "finished"

AdvanceStep ==  \* update_from_output: deliver the oldest step's tokens, discover stops
    /\ pc["main"] \in {"wait", "defer"}
    /\ Resolved(Head(batchQueue))
    /\ steps[Head(batchQueue)].ok  \* a failed output raises in the engine core instead: Drain
    /\ LET st == steps[Head(batchQueue)]
           sampled == {i \in DOMAIN st.rows : st.outIdx[i] > 0}
           owner == [i \in sampled |-> st.rows[i]]
           live == {i \in sampled : Delivers(st, i)}  \* others' tokens are discarded
           \* each gets one token: Len(newDelivered[r]) = Len(delivered[r]) + 1 (TLC re-evaluates a LET per use)
           getting == {owner[i] : i \in live}
           newDelivered == Override(delivered, [r \in getting |->
                                                  Append(delivered[r], st.result[CHOOSE i \in live : owner[i] = r])])
           atMax == {owner[i] : i \in {j \in live : Len(delivered[owner[j]]) + 1 >= MaxTokens[owner[j]]}}
           \* Structured output: a running request whose token is not delivered ends with an error (its
           \* grammar rejected the token, or allowed it none). None here: Delivers is every running row.
           errored == {owner[i] : i \in {j \in sampled : status[owner[j]] # "finished"}} \ getting
       IN
       \* EOS or a stop token: known only now that the token is on the host.
       \E eos \in SUBSET (getting \cap MayStop) :
           LET stopped == eos \cup atMax IN
           /\ delivered' = newDelivered
           /\ placeholders' = Override(placeholders, [r \in Range(owner) |-> placeholders[r] - 1])
           /\ status' = Override(status, [r \in stopped \cup errored |-> "finished"])
           \* stopped \subseteq getting: its token is its last; errored ones got none
           /\ stopLen' = Override(stopLen, [r \in stopped \cup errored |->
                                              IF r \in errored THEN Len(delivered[r]) ELSE Len(delivered[r]) + 1])
           /\ finishedIds' = finishedIds \cup stopped \cup errored
    /\ batchQueue' = Tail(batchQueue)
    /\ steps' = IF Head(batchQueue) # pending THEN [steps EXCEPT ![Head(batchQueue)] = Retire(@)] ELSE steps
    \* a deferred step's mask is built next, from the grammars that have taken this output
    /\ pc' = [pc EXCEPT !["main"] = IF pc["main"] = "defer" THEN "mask" ELSE "top"]
    /\ UNCHANGED <<arrived, phase, chunks, mstate, rows, host, pending, cur, stateLock, numAsync, numSync, outQueue, ran>>

drainable == {"top", "get", "exec", "defer", "mask", "wait", "failing"}

\* The engine died (a failed program, or any other error): every queued output resolves, the
\* buffer is dropped, every unfinished request ends.
Drain ==
    /\ AllowFailure
    /\ pc["main"] \in drainable
    /\ outQueue = <<>> /\ pc["output"] = "get"
    /\ mstate' = "Idle"
    /\ pending' = 0
    /\ batchQueue' = <<>>
    /\ stateLock' = "none"
    /\ status' = [r \in ReqSet |-> IF status[r] \in {"waiting", "running"} THEN "finished" ELSE status[r]]
    /\ stopLen' = [r \in ReqSet |-> IF status[r] \in {"waiting", "running"} THEN Len(delivered[r]) ELSE stopLen[r]]
    /\ pc' = [pc EXCEPT !["main"] = "dead"]
    /\ UNCHANGED <<arrived, phase, chunks, placeholders, delivered, finishedIds, rows, host, cur, numAsync, numSync,
                   steps, outQueue, ran>>

Terminated ==
    \/ pc["main"] = "dead"
    \/ /\ arrived = Len(Requests)
       /\ \A r \in ReqSet : status[r] = "finished"
       /\ batchQueue = <<>> /\ outQueue = <<>>
       /\ pc["main"] = "top"

Done == Terminated /\ UNCHANGED vars  \* keeps TLC from calling a finished run a deadlock

\* get_output() on either thread (the main thread only ever calls it to break the async flow).
OutputThread == \E t \in Threads : GetOutput(t) \/ GetOutputCached(t) \/ Materialize(t)

Next ==
    \/ NoPendingFuture \/ CompositionBreak \/ ShapeMismatchRebuild \/ ReorderRemap \/ Steady \/ Relay  \* step
    \/ SampleInProgram \/ SampleDeferred                                                              \* launch
    \/ BuildMask
    \/ HostDraftBreak \/ SpecSteady \/ SpecExit                                                         \* step
    \/ Reinstate                                                                                       \* reinstate
    \/ Drain                                                                                           \* drain
    \/ OutputThread
    \/ DeviceRun \/ WaitOldest \/ AdvanceStep
    \/ AddRequest \/ \E r \in ReqSet : Abort(r)
    \/ Done

\* Fairness only for the output thread (and the main thread inside get_output) and the device:
\* materializing an output never needs the engine loop to take another turn.
Spec == Init /\ [][Next]_vars /\ WF_vars(OutputThread) /\ WF_vars(DeviceRun)

\* The engine loop's own turns: scheduling, building inputs, waiting for and applying an output,
\* and dying (after a failed program, the only turn left).
EngineLoop ==
    \/ NoPendingFuture \/ CompositionBreak \/ ShapeMismatchRebuild \/ ReorderRemap \/ Steady \/ Relay
    \/ SampleInProgram \/ SampleDeferred \/ BuildMask \/ HostDraftBreak \/ SpecSteady \/ SpecExit
    \/ Reinstate \/ WaitOldest \/ AdvanceStep \/ Drain
\* ENABLED EngineLoop, written out (TLC 2.15 fails evaluating ENABLED over Plans): every plan takes
\* one of the path actions, so a step is possible exactly when the scheduler has a choice.
EngineCanTurn ==
    \/ StepReady /\ Schedules # {}
    \/ pc["main"] \in {"exec", "mask"}
    \/ pc["main"] = "top" /\ batchQueue # <<>> /\ (Len(batchQueue) = Depth \/ Schedules = {})
    \/ pc["main"] \in {"wait", "defer"} /\ batchQueue # <<>> /\ Resolved(Head(batchQueue)) /\ steps[Head(batchQueue)].ok
    \/ AllowFailure /\ pc["main"] \in drainable /\ outQueue = <<>> /\ pc["output"] = "get"
\* Weak fairness of the engine loop, as a hypothesis of the property (WF_vars(EngineLoop) by its definition).
EngineLoopFair == <>[]EngineCanTurn => []<><<EngineLoop>>_vars
\* The main thread's get_output() alone: fair, while the async output thread may stop for ever.
MainGetOutput == GetOutput("main") \/ GetOutputCached("main") \/ Materialize("main")
SpecOutputMayStop == Init /\ [][Next]_vars /\ WF_vars(MainGetOutput) /\ WF_vars(DeviceRun)

-----------------------------------------------------------------------------
(* Invariants                                                                *)

\* No output is materialized twice, and the engine core never applies an output that was not.
ExactlyOnceMaterializationInv ==
    \A s \in 1..Len(steps) :
        /\ steps[s].mat <= 1
        /\ Resolved(s) => steps[s].mat = 1

\* Every token a request receives was sampled for it, in order, none lost, duplicated or late.
TokenOwnershipInv ==
    \* a row's input is its own request's previous token (or prompt / not-yet-on-host)
    /\ \A s \in 1..Len(steps) : \A i \in DOMAIN steps[s].rows :
        steps[s].input[i] \in {Prompt, Poison, Tok(steps[s].rows[i], steps[s].outIdx[i] - 1)}
    \* the worker's CPU state holds only the request's own tokens, at their positions
    /\ \A r \in ReqSet : \A k \in DOMAIN host[r] : host[r][k] \in {Tok(r, k), Poison}
    \* the client got r's tokens 1..n in order; nothing after its stop or abort
    /\ \A r \in ReqSet :
        /\ delivered[r] = [k \in 1..Len(delivered[r]) |-> Tok(r, k)]
        /\ Len(delivered[r]) <= stopLen[r]

\* No step computes on CPU-built input ids whose newest token still lived only in a future.
NoStaleInputInv ==
    \A s \in 1..Len(steps) : \A i \in DOMAIN steps[s].rows : steps[s].input[i] # Poison

\* Every forward step is counted once, as async or as sync fallback; only Steady and Relay are async.
CounterInv ==
    LET paths == [s \in 1..Len(steps) |-> steps[s].path] \o (IF cur = NoCur THEN <<>> ELSE <<cur.path>>)
        Count(P) == Cardinality({i \in DOMAIN paths : paths[i] \in P})
    IN /\ numAsync = Count(AsyncStates)
       /\ numSync = Count(PathStates \ AsyncStates)
       /\ numAsync + numSync = Len(paths)

\* At most Depth steps in flight: scheduled and not applied by the engine core, unresolved, or not run.
PipelineDepthInv ==
    /\ Len(batchQueue) + (IF cur # NoCur /\ pc["main"] \in {"get", "transfer", "exec", "defer", "mask"} THEN 1 ELSE 0) <= Depth
    /\ Len(outQueue) <= Depth
    /\ Len(steps) - ran <= Depth

-----------------------------------------------------------------------------
(* Reachability witnesses. Each claims a situation the invariants are about *)
(* is never reached; a witness model must make TLC violate it (manifest).   *)

Paths == [s \in 1..Len(steps) |-> steps[s].path]
Adjacent(a, b) == \E s \in 2..Len(steps) : Paths[s - 1] = a /\ Paths[s] = b
\* r finished before max_tokens: by EOS / a stop token, or aborted (a witness model's MayStop tells which).
StoppedEarly(r) == status[r] = "finished" /\ stopLen[r] < MaxTokens[r] /\ pc["main"] # "dead"
\* ... while a step that samples for it is still in flight: that token must be discarded.
StoppedInFlight(r) == StoppedEarly(r) /\ placeholders[r] > 0

TwoSteadyStepsUnreached == ~Adjacent("Steady", "Steady")
RemapBesideSteadyUnreached == ~(Adjacent("ReorderRemap", "Steady") \/ Adjacent("Steady", "ReorderRemap"))
\* With MayStop excluding MayAbort: an abort, and an EOS, each with the request's next token in flight.
AbortInFlightUnreached == ~\E r \in MayAbort : StoppedInFlight(r)
EosInFlightUnreached == ~\E r \in ReqSet \ MayAbort : StoppedInFlight(r)
\* vLLM's engine core: an abort applied while both steps in flight sample for the request (its token
\* of the oldest already materialized, the other's still on the device; both must be discarded). Our
\* engine core aborts at the top of its loop, where at most one step is in flight: there it holds.
AbortWithTwoInFlightUnreached == ~\E r \in MayAbort : StoppedEarly(r) /\ placeholders[r] = Depth
\* vLLM's engine core with structured output: an abort applied while a deferred step waits for its
\* mask, the aborted request one of its masked rows (its token of the applied step is then discarded,
\* and the mask has no row for it).
AbortBeforeDeferredMaskUnreached == ~\E r \in MayAbort : pc["main"] = "defer" /\ r \in cur.masked /\ StoppedEarly(r)
\* A program failed while two steps were in flight.
FailureWithTwoInFlightUnreached == ~\E s \in 1..Len(steps) : ~steps[s].ok /\ Len(batchQueue) = Depth
\* With a host drafter (n-gram), every step with a pending future is a HostDraftBreak, also with the
\* relay on, also when the set changes: two in a row, and a request that stops early on EOS.
HostDraftStepsUnreached ==
    ~/\ HostDrafter /\ AsyncRelay
     /\ Range(Paths) = {"NoPendingFuture", "HostDraftBreak"}
     /\ Adjacent("HostDraftBreak", "HostDraftBreak")
     /\ \E r \in ReqSet \ MayAbort : StoppedEarly(r)
\* With a device drafter (draft_model): a SpecSteady step, later a SpecExit one (speculation turned
\* off for every row of the same set).
SpecSteadyThenExitUnreached ==
    ~/\ DeviceDrafter
     /\ \E s, t \in DOMAIN Paths : s < t /\ Paths[s] = "SpecSteady" /\ Paths[t] = "SpecExit"
\* With a device drafter and a grammar: a spec step whose masked row's newest token is in the pending
\* step (its own, applied after an empty schedule) defers its sampling; its program waits for the mask.
DeferredSpecStepUnreached == ~(DeviceDrafter /\ mstate = "SampleDeferred")
\* Every path state the relay switch allows (with it on, Relay takes every fallback's place), an
\* abort and an EOS, in one behaviour.
EveryPathStateUnreached ==
    ~/\ Range(Paths) = IF AsyncRelay THEN {"NoPendingFuture", "Relay", "Steady"}
                       ELSE PathStates \ {"Relay", "HostDraftBreak", "SpecSteady", "SpecExit"}
     /\ \E r \in MayAbort : StoppedEarly(r)
     /\ \E r \in ReqSet \ MayAbort : StoppedEarly(r)

\* Liveness: if the engine loop keeps turning, every admitted request eventually finishes (stop,
\* length, abort or error). Under Spec: fairness for the output thread and the device.
RequestsFinishProp == EngineLoopFair => \A r \in ReqSet : status[r] = "running" ~> status[r] = "finished"

\* Liveness: every output of a step the device ran is eventually materialized.
EventuallyMaterializedProp ==
    LET Ran(s) == s <= ran
        Materialized(s) == s <= Len(steps) /\ steps[s].mat >= 1
    IN \A s \in 1..StepBound : Ran(s) ~> Materialized(s)

=============================================================================
