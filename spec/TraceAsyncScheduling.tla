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
(* is past the last event and no invariant failed.                         *)
(***************************************************************************)
EXTENDS AsyncScheduling, TraceLog

VARIABLES
    l,             \* the next trace event to match
    engineCounts   \* <<async_steps, sync_fallback_steps>> as the engine reported them (reinstate)

traceVars == <<vars, l, engineCounts>>

\* Thread identity from the trace's header: the engine loop is the thread it names.
ThreadOf(name) == IF name = TraceEngineThread THEN "main" ELSE "output"

TraceInit == Init /\ l = 1 /\ engineCounts = <<0, 0>>

Ev == TraceEvents[l]
NextIs(names) == l <= Len(TraceEvents) /\ Ev.event \in names

\* --- the engine's facts, in place of the spec's choices (see the .cfg) ------

\* Each row's input as the engine built it. A CPU-built id stands for the host's token at the row's
\* previous position only when it is the value materialized for this request at that position;
\* otherwise it is some other token (a wrong owner or position), and TokenOwnershipInv fails.
TraceStepInputs(c, prev) ==
    LET In(i) ==
            LET x == Ev.inputs[i]
                r == c.curr[i]
                k == c.outIdx[i]
            IN CASE x.src = "prompt" -> IF r \in c.decode THEN Tok(r, 0) ELSE Prompt
                 [] x.src = "future" -> FutureRow(prev, x.row)
                 [] OTHER ->  \* "host"
                    IF x.tok = TracePoison THEN Poison
                    ELSE IF /\ x.pos = TracePromptLen[r] + k - 2
                            /\ k - 1 \in DOMAIN TraceOut[r]
                            /\ TraceOut[r][k - 1] = x.tok
                         THEN HostTok(r, k - 1)
                         ELSE Corrupt(r, k - 1)
    IN [i \in DOMAIN c.curr |-> IF i <= Len(Ev.inputs) THEN In(i) ELSE Poison]

\* The engine core hands a token to exactly the requests it logged one for.
TraceDelivers(st, i) == st.rows[i] \in Range(Ev.delivered)

\* EOS or a stop token: the requests the engine logged as finished with reason "stop".
TraceMayStop == IF NextIs({"AdvanceStep"}) THEN Range(Ev.stopped) ELSE {}

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
    /\ cur'.curr = e.req_ids
    /\ cur'.admitted = Range(e.new)
    /\ UNCHANGED engineCounts

ReinstateEvent(e) ==
    /\ e.event = "reinstate"
    /\ MachineEvent(e)
    /\ e.step = Len(steps)
    /\ Reinstate
    /\ steps'[Len(steps')].rows = e.req_ids
    \* the relay's row map as the engine built it (1-based rows of the previous step, 0: host id)
    /\ e.relay_from = IF cur.path = "Relay" THEN RelayFrom(cur, steps[pending]) ELSE <<>>
    /\ engineCounts' = e.counters

DrainEvent(e) ==
    /\ e.event = "drain"
    /\ MachineEvent(e)
    /\ Drain
    /\ UNCHANGED engineCounts

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
    /\ UNCHANGED engineCounts

AdvanceStepEvent(e) ==  \* the engine core applied the oldest output
    /\ e.event = "AdvanceStep"
    /\ batchQueue # <<>> /\ Head(batchQueue) = e.step + 1
    /\ AdvanceStep
    /\ {r \in ReqSet : status'[r] = "finished" /\ status[r] # "finished"} = Range(e.finished)
    /\ \A r \in Range(e.delivered) : delivered'[r] # delivered[r]
    /\ UNCHANGED engineCounts

AbortEvent(e) ==
    /\ e.event = "Abort"
    /\ Abort(e.req)
    /\ UNCHANGED engineCounts

\* Without failures the device only ever enables other actions, so it may as well run at once:
\* every other step waits until it has caught up, which spares TLC the orders that change nothing.
DeviceCaughtUp == ran = Len(steps) \/ AllowFailure

Logged ==
    /\ l <= Len(TraceEvents)
    /\ DeviceCaughtUp
    /\ LET e == Ev IN
       \/ StepEvent(e) \/ ReinstateEvent(e) \/ DrainEvent(e) \/ MaterializeEvent(e)
       \/ AdvanceStepEvent(e) \/ AbortEvent(e)
    /\ l' = l + 1

\* --- silent steps: the cursor stays, each only where the next event needs it --

\* A request arrives just before the step that admits it: arriving earlier changes nothing the trace shows.
JustInTime == TraceAdmittedAt[Requests[arrived + 1]] = TraceNextStep[l]

\* get_output() takes the output's lock just before the materialization the trace shows next.
Enters(t) == NextIs({"Materialize"}) /\ ThreadOf(Ev.thread) = t /\ Ev.step + 1 = Target(t)

Silent ==
    /\ l <= Len(TraceEvents)
    /\ \/ DeviceRun
       \/ /\ DeviceCaughtUp
          /\ \/ AddRequest /\ JustInTime
             \/ \E t \in Threads : GetOutput(t) /\ Enters(t)
             \/ \E t \in Threads : GetOutputCached(t)
             \/ NextIs({"AdvanceStep", "drain"}) /\ WaitOldest  \* the cheap test first: WaitOldest plans
    /\ UNCHANGED <<l, engineCounts>>

\* Report the furthest event matched so far (TLC register 1), once per new maximum.
Progress == l' > TLCGet(1) => TLCSet(1, l') /\ PrintT(<<"matched", l' - 1, Len(TraceEvents)>>)

TraceNext == (Logged \/ Silent) /\ Progress

ASSUME TLCSet(1, 1)

TraceSpec == TraceInit /\ [][TraceNext]_traceVars

\* The engine's own counters (async_steps, sync_fallback_steps) are the spec's after every step:
\* CounterInv on a real run, not only the spec's arithmetic.
EngineCountersInv == cur = NoCur => engineCounts = <<numAsync, numSync>>

=============================================================================
