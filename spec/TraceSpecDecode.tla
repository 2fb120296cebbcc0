-------------------------- MODULE TraceSpecDecode --------------------------
(***************************************************************************)
(* Trace validation of a speculative run (--trace with                     *)
(* --speculative-config): is what the engine logged a behaviour of         *)
(* SpecDecode, and do its invariants hold on it?                           *)
(*                                                                         *)
(* A cursor walks the trace; each logged event is taken by the SpecDecode  *)
(* action of its name. The engine logs the facts the invariants judge, and *)
(* they replace the spec's own choices:                                    *)
(* - Launch (the step's `reinstate` event): the rows, the drafts the       *)
(*   scheduler reserved per row (K for a spec row, 0 otherwise: it must be *)
(*   the row kind SpecDecode's scheduler chooses), each row's first input  *)
(*   (its prompt, or the host-built last accepted token with its value and *)
(*   position), and, from the step's output, each row's accepted count     *)
(*   (the run's longest prefix equal to the row's drafts) and the tokens   *)
(*   the output has past its 1 + a (none, unless a rejected draft got in). *)
(* - Materialize: the output thread's (or the main thread's) to_host.      *)
(* - AdvanceStep: who finished, and how many tokens each request got.      *)
(* The silent steps: the engine core starting to wait for its oldest       *)
(* step, just before the trace shows it applied, and a request admitted    *)
(* after the first step (Late) just before the Launch of its prefill.      *)
(* The trace then fixes every choice, and TLC follows one behaviour.       *)
(*                                                                         *)
(* What SpecDecode leaves out the trace must not have (the checker says    *)
(* so): aborts, failures.                                                  *)
(* SpecTraceLog is generated per trace by model_check/spec_trace_check.py. *)
(***************************************************************************)
EXTENDS SpecDecode, SpecTraceLog

VARIABLE l  \* the next trace event to match

traceVars == <<vars, l>>

\* Zero-arity names for the .cfg to substitute: TLC evaluates them once.
OnceRequests == TraceRequests
OnceReqSet == TraceReqSet
OnceK == TraceK
OnceMaxTokens == TraceMaxTokens
OnceRoom == TraceRoom
OnceLate == TraceLate

Ev == TraceEvents[l]
NextIs(names) == l <= Len(TraceEvents) /\ Ev.event \in names
Row(e, r) == CHOOSE i \in DOMAIN e.req_ids : e.req_ids[i] = r

\* An input the spec does not recognize as r's last accepted token (n of them accepted).
Wrong(r, n) == <<r, -1 - n>>

\* Row r's first input as the engine built it: its prompt (a prefill), or a host-built id that is r's
\* last accepted token only when it sits at that token's position and has the value materialized
\* for r there (TraceOut); anything else is another token, and NextInputInv fails.
TraceInputOf(r, kind) ==
    LET x == Ev.inputs[Row(Ev, r)]
        n == devN[r]
    IN IF x.src = "prompt" THEN IF n = 0 THEN Tok(r, 0) ELSE Wrong(r, n)
       \* a drafted future's row (draft_model): the pending step's row of r, at column 0, holds the
       \* device's last accepted token of r; another row, or a draft's column, is another token
       ELSE IF x.src = "future"
            THEN IF /\ n > 0 /\ x.col = 0
                    /\ x.row \in DOMAIN steps[Len(steps)].rows /\ steps[Len(steps)].rows[x.row] = r
                 THEN Tok(r, n)
                 ELSE Wrong(r, n)
       ELSE IF /\ n > 0
               /\ x.pos = TracePromptLen[r] + n - 1
               /\ n \in DOMAIN TraceOut[r]
               /\ TraceOut[r][n] = x.tok
            THEN Tok(r, n)
            ELSE Wrong(r, n)

\* Row r's output: its 1 + a accepted tokens, then what the engine's output row holds past them
\* (rejected drafts, in a broken engine).
TraceOutOf(r, kind, a) ==
    LET n == devN[r]
        good == TraceInputOf(r, kind) = Tok(r, n)
        run == [j \in 1..a + 1 |-> IF good THEN Tok(r, n + j) ELSE Bad(r, n + j)]
    IN run \o [j \in 1..Ev.extra[Row(Ev, r)] |-> Draft(r, n + a + 1 + j)]

\* Only the scheduler choice with the request set of the next Launch (pruning only).
TraceSchedules ==
    LET all == {SubSeq(Runnable, 1, j) : j \in 1..Len(Runnable)}
    IN IF NextIs({"Launch"}) THEN {o \in all : Range(o) = Range(Ev.req_ids)} ELSE all

LaunchEvent(e) ==
    /\ e.event = "Launch"
    /\ e.step = Len(steps)
    /\ Launch
    /\ LET st == steps'[Len(steps')] IN
       \A i \in DOMAIN st.rows :
           /\ st.acc[i] = e.acc[Row(e, st.rows[i])]
           /\ Drafts(st.kind[i]) = e.drafts[Row(e, st.rows[i])]  \* the scheduler's row kind is the spec's

MaterializeEvent(e) ==
    /\ e.event = "Materialize"
    /\ outQueue # <<>> /\ Head(outQueue) = e.step + 1
    /\ Materialize

Got(e, r) == IF r \in Range(e.delivered) THEN e.counts[Row([req_ids |-> e.delivered], r)] ELSE 0

AdvanceStepEvent(e) ==
    /\ e.event = "AdvanceStep"
    /\ batchQueue # <<>> /\ Head(batchQueue) = e.step + 1
    /\ AdvanceStep
    /\ {r \in ReqSet : status'[r] = "finished" /\ status[r] # "finished"} = Range(e.finished)
    /\ \A r \in ReqSet : Len(delivered'[r]) - Len(delivered[r]) = Got(e, r)

Logged ==
    /\ l <= Len(TraceEvents)
    /\ LaunchEvent(Ev) \/ MaterializeEvent(Ev) \/ AdvanceStepEvent(Ev)
    /\ l' = l + 1

\* The engine core starts to wait on its oldest step just before the trace shows it applied.
\* A late request is admitted just before the Launch that schedules its prefill.
Silent ==
    /\ \/ NextIs({"AdvanceStep"}) /\ WaitOldest
       \/ NextIs({"Launch"}) /\ \E r \in Range(Ev.new) : Admit(r)
    /\ UNCHANGED l

\* Report the furthest event matched so far (TLC register 1), once per new maximum.
Progress == l' > TLCGet(1) => TLCSet(1, l') /\ PrintT(<<"matched", l' - 1, Len(TraceEvents)>>)

TraceInit == Init /\ l = 1
TraceNext == (Logged \/ Silent) /\ Progress

ASSUME TLCSet(1, 1)

TraceSpec == TraceInit /\ [][TraceNext]_traceVars

=============================================================================
