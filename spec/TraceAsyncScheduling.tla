------------------------ MODULE TraceAsyncScheduling ------------------------
(***************************************************************************)
(* Trace validation: is a trace the implementation logged (--trace) a      *)
(* behaviour of AsyncScheduling? A cursor walks the trace; each logged     *)
(* event must be taken by the spec action of the same name, with the same  *)
(* fields. Actions the implementation does not log (arrivals, aborts, the  *)
(* device, the engine core applying outputs, get_output() returning a      *)
(* result already there) are silent steps that leave the cursor in place.  *)
(*                                                                         *)
(* TraceLog is generated per trace by model_check/trace_check.py. TLC      *)
(* prints the furthest cursor it reaches; the trace is accepted when that  *)
(* is past the last event.                                                 *)
(***************************************************************************)
EXTENDS AsyncScheduling, TraceLog

VARIABLE l  \* the next trace event to match

traceVars == <<vars, l>>

ThreadOf(name) == IF name = "MainThread" THEN "main" ELSE "output"

TraceInit == Init /\ l = 1

\* --- logged events: the cursor advances -----------------------------------

MachineEvent(e) ==  \* step, reinstate, drain: the machine moved from e.source to e.state
    /\ e.source = mstate
    /\ mstate' = e.state

StepEvent(e) ==
    /\ e.event = "step"
    /\ MachineEvent(e)
    /\ e.step = Len(steps)
    /\ \/ NoPendingFuture \/ CompositionBreak \/ ShapeMismatchRebuild \/ ReorderRemap \/ Steady \/ Relay
    /\ cur'.curr = e.req_ids
    /\ cur'.admitted = Range(e.new)

ReinstateEvent(e) ==
    /\ e.event = "reinstate"
    /\ MachineEvent(e)
    /\ e.step = Len(steps)
    /\ Reinstate
    /\ steps'[Len(steps')].rows = e.req_ids
    \* the relay's row map as the engine built it (1-based rows of the previous step, 0: host id)
    /\ e.relay_from = IF cur.path = "Relay" THEN RelayFrom(cur, steps[pending]) ELSE <<>>

DrainEvent(e) ==
    /\ e.event = "drain"
    /\ MachineEvent(e)
    /\ Drain

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

\* Without failures the device only ever enables other actions, so it may as well run at once:
\* every other step waits until it has caught up, which spares TLC the orders that change nothing.
DeviceCaughtUp == ran = Len(steps) \/ AllowFailure

Logged ==
    /\ l <= Len(TraceEvents)
    /\ DeviceCaughtUp
    /\ LET e == TraceEvents[l] IN
       StepEvent(e) \/ ReinstateEvent(e) \/ DrainEvent(e) \/ MaterializeEvent(e)
    /\ l' = l + 1

\* --- silent steps: the cursor stays --------------------------------------

\* Prune stops the rest of the trace contradicts: TraceLastStep[r] is the last event scheduling r.
NoStopOfScheduled ==
    \A r \in ReqSet : status'[r] = "finished" /\ status[r] # "finished" => TraceLastStep[r] < l

\* Overrides (see the .cfg) that prune what the rest of the trace rules out, before TLC enumerates it.
TraceMayStop == {r \in ReqSet : TraceLastStep[r] < l}
TraceScheduleChoices ==
    IF l <= Len(TraceEvents) /\ TraceEvents[l].event = "step"
    THEN {sch \in Schedules : Range(sch.order) = Range(TraceEvents[l].req_ids)}
    ELSE {}

\* A request arrives just before the step that admits it: arriving earlier changes nothing the trace shows.
JustInTime == TraceAdmittedAt[Requests[arrived + 1]] = TraceNextStep[l]

Silent ==
    /\ l <= Len(TraceEvents)
    /\ \/ DeviceRun
       \/ /\ DeviceCaughtUp
          /\ \/ AddRequest /\ JustInTime
             \/ \E r \in ReqSet : Abort(r) /\ NoStopOfScheduled
             \/ \E t \in Threads : GetOutput(t) \/ GetOutputCached(t)
             \/ WaitOldest
             \/ AdvanceStep /\ NoStopOfScheduled
    /\ UNCHANGED l

\* Report the furthest event matched so far (TLC register 1), once per new maximum.
Progress == l' > TLCGet(1) => TLCSet(1, l') /\ PrintT(<<"matched", l' - 1, Len(TraceEvents)>>)

TraceNext == (Logged \/ Silent) /\ Progress

ASSUME TLCSet(1, 1)

TraceSpec == TraceInit /\ [][TraceNext]_traceVars

=============================================================================
