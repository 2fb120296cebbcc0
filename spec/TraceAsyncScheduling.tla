------------------------ MODULE TraceAsyncScheduling ------------------------
(***************************************************************************)
(* Trace validation: is a trace the implementation logged (--trace) a      *)
(* behaviour of AsyncScheduling, and do the spec's invariants hold on it?  *)
(* A cursor walks the trace; each logged event must be taken by the spec   *)
(* action of the same name, with the same fields. The engine logs the      *)
(* facts the invariants judge, and they replace the spec's own choices:    *)
(* each row's input (prompt, a row of the pending future, or the CPU-built *)
(* token with its value and position), who got a token when an output was *)
(* applied, who finished and why, aborts, the engine's step counters.      *)
(* What the engine does not log (arrivals, the device, get_output() taking *)
(* its lock or returning a result already there, the engine core starting  *)
(* to wait) are silent steps, each allowed only where the next event needs *)
(* it: the trace then fixes every choice, and TLC follows one behaviour.   *)
(*                                                                         *)
(* TraceLog is generated per trace by model_check/trace_check.py. TLC      *)
(* prints the furthest cursor it reaches; the trace is accepted when that  *)
(* is past the last event and no invariant failed. A long trace is checked *)
(* in parts, each one TLC run from the states the previous part ended in:  *)
(* each run's state is then as large as its part, and the time is linear   *)
(* in the trace's length.                                                  *)
(***************************************************************************)
EXTENDS AsyncScheduling, TraceLog

VARIABLES
    l,             \* the next trace event to match
    engineCounts,  \* <<async_steps, sync_fallback_steps>> as the engine reported them (reinstate)
    pathCounts     \* <<async, sync fallback>>: the paths of the step events matched so far

\* The trace's constants for the .cfg to substitute (<-). TLC evaluates a definition put for a constant
\* again on every use of the constant (MaxTokens, a function of every request, is read for each request
\* of each plan), but a zero-arity definition once, when it starts: so the .cfg names these, each only
\* the name of the TraceLog value (a quarter of a part's CPU time was rebuilding TraceMaxTokens).
OnceRequests == TraceRequests
OnceReqSet == TraceReqSet
OnceMaxTokens == TraceMaxTokens
OnceBuckets == TraceBuckets
OnceMaxSeqs == TraceMaxSeqs
OnceMaxChunks == TraceMaxChunks
OnceAllowFailure == TraceAllowFailure
OnceAsyncRelay == TraceAsyncRelay
OnceEngineCore == TraceEngineCore
OnceOutputOnEngineThread == TraceOutputOnEngineThread
OnceConstrained == TraceConstrained
OnceDeviceDrafter == TraceDeviceDrafter

traceVars == <<vars, l, engineCounts, pathCounts>>

\* Thread identity from the trace's header: the engine loop is the thread it names. Under vLLM's
\* uni-process executor that thread also plays the output thread's part (OutputOnEngineThread): its
\* event is the output role's while it waits on its oldest step (or dies), the main thread's else.
ThreadOf(name) ==
    IF name # TraceEngineThread THEN "output"
    ELSE IF OutputOnEngineThread /\ OutputRoleFree THEN "output"
    ELSE "main"

\* A long trace is checked in parts (model_check/trace_check.py): a part after the first starts from
\* the states its predecessor ended in (TraceStart), with the history no action reads again taken out.
TraceInit ==
    \/ /\ TraceStart = {}
       /\ Init /\ l = 1 /\ engineCounts = <<0, 0>> /\ pathCounts = <<0, 0>>
    \/ \E st \in TraceStart :
        /\ arrived = st.arrived /\ status = st.status /\ phase = st.phase /\ chunks = st.chunks
        /\ placeholders = st.placeholders /\ delivered = st.delivered /\ stopLen = st.stopLen
        /\ finishedIds = st.finishedIds /\ batchQueue = st.batchQueue /\ mstate = st.mstate /\ rows = st.rows
        /\ host = st.host /\ pending = st.pending /\ cur = st.cur /\ stateLock = st.stateLock
        /\ numAsync = st.numAsync /\ numSync = st.numSync /\ steps = st.steps /\ ran = st.ran
        /\ outQueue = st.outQueue /\ pc = st.pc
        /\ l = 1 /\ engineCounts = st.engineCounts /\ pathCounts = st.pathCounts

Ev == TraceEvents[l]
NextIs(names) == l <= Len(TraceEvents) /\ Ev.event \in names

\* --- the engine's facts, in place of the spec's choices (see the .cfg) ------

\* Each row's input as the engine built it. A CPU-built id stands for the host's token at the row's
\* previous position only when it is the value materialized for this request at that position;
\* otherwise it is some other token (a wrong owner or position), and TokenOwnershipInv fails.
\* With a drafter on the device a row's abstract token k stands for its run: the token it computes
\* on is the real output TraceRunStart[r][k] (its request's last accepted one), and a drafted
\* future's row is read at a column (0: that token; more: a draft).
TraceStepInputs(c, prev) ==
    LET In(i) ==
            LET x == Ev.inputs[i]
                r == c.curr[i]
                k == c.outIdx[i]
                m == IF TraceDeviceDrafter THEN TraceRunStart[r][k] ELSE k - 1  \* the real output index
            IN CASE x.src = "prompt" -> IF r \in c.decode THEN Tok(r, 0) ELSE Prompt
                 [] x.src = "future" -> IF x.col = 0 THEN FutureRow(prev, x.row) ELSE FutureDraft(prev, x.row)
                 [] OTHER ->  \* "host"
                    IF x.tok = TracePoison THEN Poison
                    ELSE IF /\ x.pos = TracePromptLen[r] + m - 1
                            /\ m \in DOMAIN TraceOut[r]
                            /\ TraceOut[r][m] = x.tok
                         THEN HostTok(r, k - 1)
                         ELSE Corrupt(r, k - 1)
    IN [i \in DOMAIN c.curr |-> IF i <= Len(Ev.inputs) THEN In(i) ELSE Poison]

\* The id the engine's machine compares for a request: a reused id's later requests ("id#2") too.
TraceIdOf(r) == TraceIds[r]

\* The engine core hands a token to exactly the requests it logged one for.
TraceDelivers(st, i) == st.rows[i] \in Range(Ev.delivered)

\* EOS or a stop token: the requests the engine logged as finished with reason "stop". With a drafter
\* on the device, any finish (a stop or max_tokens inside a run, whose row is not its request's last
\* when a row in flight is discarded): MaxTokens counts the request's rows.
TraceMayStop ==
    IF ~NextIs({"AdvanceStep"}) THEN {}
    ELSE IF TraceDeviceDrafter THEN Range(Ev.finished) ELSE Range(Ev.stopped)

\* With a drafter on the device, the decode rows whose speculation turns off at the next step: those
\* the scheduler reserved no drafts for (pruning and the trace's fact: one choice).
TraceSpecOffChoices(scheduled) ==
    IF ~TraceDeviceDrafter \/ ~NextIs({"step"}) THEN {{}}
    ELSE {{r \in scheduled \ TraceConstrained : phase[r] = "decode" /\ Ev.drafts[IndexOf(Ev.req_ids, r)] = 0}}

\* With a drafter on the device, a row under a grammar with fewer drafts than k had them cut this step
\* (speculation turned off for good is, for such a row, a cut to none at every later step: the same
\* one-token rows).
TraceCutChoices(scheduled) ==
    LET C == {r \in scheduled \cap TraceConstrained : phase[r] = "decode"}
        D(r) == Ev.drafts[IndexOf(Ev.req_ids, r)]
    IN IF ~TraceDeviceDrafter \/ ~NextIs({"step"}) THEN {[zero |-> {}, some |-> {}]}
       ELSE {[zero |-> {r \in C : D(r) = 0}, some |-> {r \in C : 0 < D(r) /\ D(r) < TraceNumSpecTokens}]}

\* The real output index of the token abstract token k of r is sampled first: k - 1, or with a drafter
\* on the device the start of row k's run (its request's real tokens before it).
TraceRealIndex(r, k) == IF TraceDeviceDrafter THEN TraceRunStart[r][k] ELSE k - 1

\* The grammar state each masked row's mask came from, as the engine logged it (its `mask` event);
\* a masked request the event leaves out had finished: no grammar row. With a drafter on the device
\* the engine logs real token counts: a mask from the grammar after the row's real tokens before it
\* stands for the abstract k - 1, any other for k (stale: MaskFresh fails).
TraceStepMask(c) ==
    LET Logged(r) == {m \in Range(Ev.masks) : m.req = r}
        Abstract(r, g) ==
            LET k == c.outIdx[IndexOf(c.curr, r)]
            IN IF ~TraceDeviceDrafter THEN g ELSE IF g = TraceRealIndex(r, k) THEN k - 1 ELSE k
    IN [r \in c.masked |-> IF Logged(r) = {} THEN NoGrammar
                           ELSE Abstract(r, (CHOOSE m \in Logged(r) : TRUE).grammar)]

\* Only scheduler choices with the request set of the next step event are planned (pruning only).
TraceScheduleChoices ==
    IF NextIs({"step"}) THEN {sch \in Schedules : Range(sch.order) = Range(Ev.req_ids)} ELSE {}

\* --- logged events: the cursor advances -----------------------------------

MachineEvent(e) ==  \* step, reinstate, drain: the machine moved from e.source to e.state
    /\ e.source = mstate
    /\ mstate' = e.state

StepEvent(e) ==
    /\ e.event = "step"
    /\ MachineEvent(e)
    /\ e.step = Len(steps)
    \* only the action the event names: each would plan every schedule choice again
    /\ CASE e.state = "NoPendingFuture" -> NoPendingFuture
         [] e.state = "CompositionBreak" -> CompositionBreak
         [] e.state = "ShapeMismatchRebuild" -> ShapeMismatchRebuild
         [] e.state = "ReorderRemap" -> ReorderRemap
         [] e.state = "Steady" -> Steady
         [] e.state = "Relay" -> Relay
         [] e.state = "SpecSteady" -> SpecSteady
         [] e.state = "SpecExit" -> SpecExit
    /\ cur'.curr = e.req_ids
    /\ cur'.admitted = Range(e.new)
    /\ pathCounts' = IF e.state \in AsyncStates THEN <<pathCounts[1] + 1, pathCounts[2]>>
                      ELSE <<pathCounts[1], pathCounts[2] + 1>>
    /\ UNCHANGED engineCounts

\* Structured output: the machine's launch, for a step with a row that samples under a grammar.
LaunchEvent(e) ==
    /\ e.event = "launch"
    /\ MachineEvent(e)
    /\ e.step = Len(steps)
    /\ CASE e.state = "SampleInProgram" -> SampleInProgram
         [] e.state = "SampleDeferred" -> SampleDeferred
    /\ Range(e.masked) = cur.masked
    /\ UNCHANGED <<engineCounts, pathCounts>>

\* The step's bitmask built: at launch (SampleInProgram), or once the pending step was applied.
MaskEvent(e) ==
    /\ e.event = "mask"
    /\ e.step = Len(steps)
    /\ BuildMask
    \* each logged row is a masked row of the step, at the output index this spec has it sample
    /\ \A m \in Range(e.masks) : m.req \in cur.masked /\ m.index = TraceRealIndex(m.req, cur.outIdx[IndexOf(cur.curr, m.req)])
    /\ UNCHANGED <<engineCounts, pathCounts>>

ReinstateEvent(e) ==
    /\ e.event = "reinstate"
    /\ MachineEvent(e)
    /\ e.step = Len(steps)
    /\ Reinstate
    /\ steps'[Len(steps')].rows = e.req_ids
    \* the relay's row map as the engine built it (1-based rows of the previous step, 0: host id)
    /\ e.relay_from = IF cur.path = "Relay" THEN RelayFrom(cur, steps[pending]) ELSE <<>>
    /\ engineCounts' = e.counters
    /\ UNCHANGED pathCounts

DrainEvent(e) ==
    /\ e.event = "drain"
    /\ MachineEvent(e)
    /\ Drain
    /\ UNCHANGED <<engineCounts, pathCounts>>

MaterializeEvent(e) ==
    /\ e.event = "Materialize"
    /\ LET t == ThreadOf(e.thread) IN
       /\ pc[t] = "transfer"
       /\ Target(t) = e.step + 1
       /\ Materialize(t)
    /\ LET st == steps[e.step + 1] IN
       /\ st.rows = e.req_ids
       /\ st.ok = e.ok  \* ok = FALSE: the program failed, get_output() raised
       /\ e.count = st.mat + 1
       /\ \A i \in DOMAIN st.rows : e.sampled[i] = (st.outIdx[i] > 0)
    /\ UNCHANGED <<engineCounts, pathCounts>>

AdvanceStepEvent(e) ==  \* the engine core applied the oldest output
    /\ e.event = "AdvanceStep"
    /\ batchQueue # <<>> /\ Head(batchQueue) = e.step + 1
    /\ steps[e.step + 1].rows = e.req_ids
    /\ AdvanceStep
    /\ {r \in ReqSet : status'[r] = "finished" /\ status[r] # "finished"} = Range(e.finished)
    /\ \A r \in Range(e.delivered) : delivered'[r] # delivered[r]
    /\ UNCHANGED <<engineCounts, pathCounts>>

AbortEvent(e) ==
    /\ e.event = "Abort"
    /\ Abort(e.req)
    /\ UNCHANGED <<engineCounts, pathCounts>>

\* Without failures the device only ever enables other actions, so it may as well run at once:
\* every other step waits until it has caught up, which spares TLC the orders that change nothing.
DeviceCaughtUp == ran = Len(steps) \/ AllowFailure

Logged ==
    /\ l <= Len(TraceEvents)
    /\ DeviceCaughtUp
    /\ LET e == Ev IN
       \/ StepEvent(e) \/ LaunchEvent(e) \/ MaskEvent(e) \/ ReinstateEvent(e) \/ DrainEvent(e) \/ MaterializeEvent(e)
       \/ AdvanceStepEvent(e) \/ AbortEvent(e)
    /\ l' = l + 1

\* --- silent steps: the cursor stays, each only where the next event needs it --

\* A request arrives just before the step that admits it: arriving earlier changes nothing the trace shows.
JustInTime == arrived < Len(Requests) /\ TraceAdmittedAt[Requests[arrived + 1]] = TraceNextStep[l]

\* get_output() takes the output's lock just before the materialization the trace shows next.
\* (Calling first: the output thread's Target is the head of a queue that may be empty.)
Enters(t) == NextIs({"Materialize"}) /\ ThreadOf(Ev.thread) = t /\ Calling(t) /\ Ev.step + 1 = Target(t)

\* The engine core starts to wait on its oldest step just before the trace shows it applying that step,
\* draining, or (vLLM's) applying an abort or, on the uni-process executor, materializing the step.
WaitsNext ==
    \/ NextIs({"AdvanceStep", "drain"})
    \/ EngineCore = "vllm" /\ NextIs({"Abort"})
    \/ OutputOnEngineThread /\ NextIs({"Materialize"}) /\ Ev.thread = TraceEngineThread

Silent ==
    /\ l <= Len(TraceEvents)
    /\ \/ DeviceRun
       \/ /\ DeviceCaughtUp
          /\ \/ JustInTime /\ AddRequest  \* the cheap tests first: the actions rebuild functions
             \/ \E t \in Threads : Enters(t) /\ GetOutput(t)
             \/ \E t \in Threads : GetOutputCached(t)
             \/ WaitsNext /\ WaitOldest  \* the cheap test first: WaitOldest plans
    /\ UNCHANGED <<l, engineCounts, pathCounts>>

\* The state as one record, printed for the next part of a long trace to start from.
EndState ==
    [arrived |-> arrived, status |-> status, phase |-> phase, chunks |-> chunks, placeholders |-> placeholders,
     delivered |-> delivered, stopLen |-> stopLen, finishedIds |-> finishedIds, batchQueue |-> batchQueue,
     mstate |-> mstate, rows |-> rows, host |-> host, pending |-> pending, cur |-> cur, stateLock |-> stateLock,
     numAsync |-> numAsync, numSync |-> numSync, steps |-> steps, ran |-> ran, outQueue |-> outQueue, pc |-> pc,
     engineCounts |-> engineCounts, pathCounts |-> pathCounts]

\* Report the furthest event matched so far (TLC register 1), once per new maximum.
Progress ==
    /\ l' > TLCGet(1) => TLCSet(1, l') /\ PrintT(<<"matched", l' - 1, Len(TraceEvents)>>)
    \* every state the last event leads to, for the next part to start from
    /\ TracePrintEnd /\ l' > Len(TraceEvents) => PrintT(<<"end", EndState'>>)

TraceNext == (Logged \/ Silent) /\ Progress

ASSUME TLCSet(1, 1)

TraceSpec == TraceInit /\ [][TraceNext]_traceVars

\* The engine's own counters (async_steps, sync_fallback_steps) are the spec's after every step:
\* CounterInv on a real run, not only the spec's arithmetic.
EngineCountersInv == cur = NoCur => engineCounts = <<numAsync, numSync>>

-----------------------------------------------------------------------------
(* The invariants, where the last event can have changed something. Every   *)
(* invariant over the whole history on every state costs time in proportion *)
(* to the trace so far. But an action only touches the newest steps and the  *)
(* requests its event names, and what it leaves alone was checked before: so *)
(* each state checks the recent steps and the requests the last event named, *)
(* with the spec's invariants' own predicates, and the spec's invariants,    *)
(* whole, hold on every state past the last event.                          *)

\* Steps an action can touch. The batch queue and the output queue hold at most Depth steps each,
\* appended in step order and taken from the head, and the device is at most Depth programs behind
\* (PipelineDepthInv, on every state): pending, both queues and the next program are all among the
\* last Depth + 1 steps. An older step never changes again.
Recent == (IF Len(steps) > Depth + 2 THEN Len(steps) - (Depth + 1) ELSE 1)..Len(steps)  \* the last Depth + 2

Prev == TraceEvents[l - 1]
\* Requests an action can have changed: those the last logged event names (a step's rows, the
\* snapshot rows of a materialization or of an applied output, an abort's request), the latest
\* arrival, and every request after a drain. Silent steps change no request but by its arrival.
Hot ==
    (IF l = 1 THEN {} ELSE Range(Prev.req_ids) \cup Range(Prev.new) \cup (IF Prev.req = "" THEN {} ELSE {Prev.req}))
    \cup (IF arrived > 0 THEN {Requests[arrived]} ELSE {})
    \cup (IF l > 1 /\ Prev.event = "drain" THEN ReqSet ELSE {})

\* TypeOK on what can have changed (the functions' domains are ReqSet by construction).
RecentTypeOK ==
    /\ arrived \in 0..Len(Requests)
    /\ \A r \in Hot :
        /\ status[r] \in {"absent", "waiting", "running", "finished"}
        /\ phase[r] \in {"prefill", "decode", "plain"}
        /\ chunks[r] \in 0..MaxChunks
        /\ placeholders[r] \in Nat
        /\ delivered[r] \in Seq(Token) /\ stopLen[r] \in Nat
        /\ host[r] \in Seq(Token)
    /\ finishedIds \subseteq ReqSet
    /\ Range(batchQueue) \subseteq 1..Len(steps)
    /\ mstate \in MachineStates
    /\ Range(rows) \subseteq ReqSet
    /\ pending \in 0..Len(steps)
    /\ stateLock \in {"none", "main"}
    /\ numAsync \in Nat /\ numSync \in Nat
    /\ \A s \in Recent :
        /\ DOMAIN steps[s] = {"rows", "outIdx", "input", "result", "path", "shape", "ok", "mat", "lock"}
        /\ steps[s].path \in PathStates
        /\ steps[s].mat \in Nat /\ steps[s].lock \in Threads \cup {"none"}
        /\ steps[s].ok \in BOOLEAN
    /\ ran \in 0..Len(steps)
    /\ Range(outQueue) \subseteq 1..Len(steps)
    /\ pc \in [Threads -> MainPcs]

RecentExactlyOnceMaterializationInv ==
    \A s \in Recent :
        /\ steps[s].mat <= 1
        /\ Resolved(s) => steps[s].mat = 1

RecentTokenOwnershipInv ==
    /\ \A s \in Recent : \A i \in DOMAIN steps[s].rows :
        steps[s].input[i] \in {Prompt, Poison, Tok(steps[s].rows[i], steps[s].outIdx[i] - 1)}
    /\ \A r \in Hot : \A k \in DOMAIN host[r] : host[r][k] \in {Tok(r, k), Poison}
    /\ \A r \in Hot :
        /\ delivered[r] = [k \in 1..Len(delivered[r]) |-> Tok(r, k)]
        /\ Len(delivered[r]) <= stopLen[r]

\* StructuredOutput.tla's FreshMaskInv on the real run: the mask the engine built for each masked row
\* came from its request's grammar after exactly the request's tokens before the one the row samples
\* (never an older state), or the request had finished. Checked on the step being built, from its
\* mask event to its reinstate; once reinstated, a stale mask shows in its tokens (MaskFresh).
FreshMaskInv == cur # NoCur => \A i \in DOMAIN cur.curr : MaskFresh(cur, cur.curr[i], cur.outIdx[i])

RecentNoStaleInputInv == \A s \in Recent : \A i \in DOMAIN steps[s].rows : steps[s].input[i] # Poison

\* CounterInv with the paths counted as the step events come (a step's path never changes).
RecentCounterInv ==
    /\ numAsync = pathCounts[1] /\ numSync = pathCounts[2]
    /\ numAsync + numSync = Len(steps) + (IF cur = NoCur THEN 0 ELSE 1)

\* The spec's invariants, whole, on every state past the last event.
Past == l > Len(TraceEvents)
PastTypeOK == Past => TypeOK
PastExactlyOnceMaterializationInv == Past => ExactlyOnceMaterializationInv
PastTokenOwnershipInv == Past => TokenOwnershipInv
PastNoStaleInputInv == Past => NoStaleInputInv
PastCounterInv == Past => CounterInv

=============================================================================
