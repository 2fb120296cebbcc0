"""The worker's per-step async decision as an explicit state machine.

The transition table below is declared once, as data, and beside it each path state's plan (what the
runner does on that path). Everything else is derived from them: the runtime guard (a lookup built from
the table, `ROWS`, which tests check equal to the `transitions` machine over it), the pure `decide()`
used by tests, the runner's step, the state diagram
(`neuron-async-sm diagram`) and the cross-check against the TLA+ spec.

Between steps the machine rests in one of two states:
- Idle: no pending sampled-token future (before the first step, or after a failure drained it);
- Reinstate: the previous step is pending: its output, whose sampled-token future may feed the next
  step and whose snapshot says which request owns each of its rows.
`step` picks the path of the next step from the step's observations; `reinstate` ends every step.
A step that samples under a grammar (structured output) fires `launch` between the two, which says
when it samples (docs/structured-output.md; spec/StructuredOutput.tla):
- SampleInProgram: every masked row's grammar holds its request's newest token: the mask is built
  now and the one program samples under it.
- SampleDeferred: a masked row's newest token is in the pending future: the forward is launched now
  and sampling waits until the engine core has applied the pending step to the grammars.
A step without a masked row never fires `launch`: it pays nothing for structured output.
Each trigger returns the `Transition` it took: the machine never calls its caller back.

Path states (each forward step takes exactly one; Steady and Relay count as async steps):
- NoPendingFuture: nothing pending, CPU-built inputs are correct as they are.
- HostDraftBreak (speculation with a host-side drafter, n-gram; docs/spec-decode.md §6): the drafts
  come from the request's whole token history, whose newest token is in the pending future:
  materialize, then build inputs (last accepted token and drafts) on the CPU. First among the rows:
  the method alone decides it, whatever else changed.
- Relay (the relay on): the future cannot be the input as it is (the set, the order or the shape
  changed), so the program builds its input ids on the device: each row takes the future's row that
  sampled its newest token, by request id, or its CPU-built id (a prompt chunk, a token the host
  has). Nothing is materialized, nothing crosses to the host. With the relay off, the three
  fallbacks below take these steps.
- CompositionBreak: the scheduled request set differs from the set that produced the future:
  materialize the pending output *before* the batch state changes, then build inputs on the CPU.
- ShapeMismatchRebuild: same set, but the future cannot be the input (shape or dtype differs from the
  padded input, or the step is not all-decode so its input is 2-D): materialize, then build inputs
  from the refreshed CPU state — never the stale ones.
- ReorderRemap: same set, same shape, but `condense()` changed the row order: permute the future's
  real rows into the current order (padding rows untouched). The gather forces the future on the
  worker main thread, so it is a sync fallback.
- SpecSteady (speculation with a drafter on the device, draft_model; docs/spec-decode.md §7): the
  pending future drafted (its `next_input`: each row's last accepted token and the k drafts after
  it), and every row of this step, the same set in the same order, verifies k drafts: `next_input`
  is the input as it is. Positions and output indices come from the device's own count of each
  slot's accepted tokens (`slot_len`): the host's counts are optimistic until the output arrives.
- SpecExit: the pending future drafted, and every row of this step, the same set in the same order,
  computes one token (speculation turned off near max_model_len): each row's input is the last
  accepted token, `next_input`'s first column, never a draft's.
- Steady: same set, same order, all decode, shape and dtype match: the future is the next input_ids,
  no host round trip.

This module has no torch: observations are plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple

from transitions import Machine, MachineError

IDLE = "Idle"
REINSTATE = "Reinstate"
NO_PENDING_FUTURE = "NoPendingFuture"
COMPOSITION_BREAK = "CompositionBreak"
SHAPE_MISMATCH_REBUILD = "ShapeMismatchRebuild"
REORDER_REMAP = "ReorderRemap"
STEADY = "Steady"
RELAY = "Relay"
HOST_DRAFT_BREAK = "HostDraftBreak"
SPEC_STEADY = "SpecSteady"
SPEC_EXIT = "SpecExit"
SAMPLE_IN_PROGRAM = "SampleInProgram"
SAMPLE_DEFERRED = "SampleDeferred"

PATH_STATES = (
    NO_PENDING_FUTURE,
    HOST_DRAFT_BREAK,
    RELAY,
    COMPOSITION_BREAK,
    SHAPE_MISMATCH_REBUILD,
    REORDER_REMAP,
    SPEC_STEADY,
    SPEC_EXIT,
    STEADY,
)
LAUNCH_STATES = (SAMPLE_IN_PROGRAM, SAMPLE_DEFERRED)
STATES = (IDLE, *PATH_STATES, *LAUNCH_STATES, REINSTATE)
# No host round trip: the main thread never waits on the future.
ASYNC_STATES = frozenset({STEADY, RELAY, SPEC_STEADY, SPEC_EXIT})


@dataclass(frozen=True)
class StepObservation:
    """What the worker sees at the start of a step, before it mutates any batch state."""

    has_pending: bool  # a previous step is pending: its sampled-token future is on the device
    prev_req_ids: tuple[str, ...]  # ordered ids that produced the pending future (empty if none)
    curr_req_ids: tuple[str, ...]  # ordered ids of this step, after removals, additions, condense()
    all_decode: bool  # every scheduled request computes exactly one decode token
    pending_shape: tuple[int, ...]  # shape of the pending future
    pending_dtype: str
    input_shape: tuple[int, ...]  # shape of this step's padded input_ids
    input_dtype: str
    relay: bool = False  # the engine relays (EngineConfig.async_relay): Relay replaces the fallbacks
    # Structured output (the `launch` trigger's): requests of this step that sample under a grammar,
    # and the requests whose newest token the pending future holds (its rows that sampled).
    masked_req_ids: frozenset[str] = frozenset()
    pending_sampled_req_ids: frozenset[str] = frozenset()
    host_drafter: bool = False  # speculation drafts from the host's token history (method "ngram")
    # Speculation with a drafter on the device (draft_model): the pending program drafted (its output
    # carries `next_input`, [rows, 1 + k] after the tokens), and every row of this step verifies k
    # drafts (1 + k tokens). A drafted future's rows are its input's rows: pending_shape[0].
    pending_drafted: bool = False
    all_spec: bool = False


# Predicates over one observation. Each is named for the situation it detects.
def composition_changed(obs: StepObservation) -> bool:
    # One set comparison catches every cause: finished, new, aborted, unscheduled requests. The same
    # rows in the same order (the steady step) need no sets (at batch 256: 0.3 against 6 µs, hot).
    return obs.prev_req_ids != obs.curr_req_ids and frozenset(obs.prev_req_ids) != frozenset(obs.curr_req_ids)


def future_does_not_fit(obs: StepObservation) -> bool:
    # Not only a bucket change: any step that is not all-decode (its input is [rows, L]), and a dtype
    # the device produced other than the input's. A drafted future fits a step of its row count whose
    # rows all verify k drafts (SpecSteady) or all compute one token (SpecExit); a mixture does not.
    if obs.pending_drafted:
        return (
            not (obs.all_spec or obs.all_decode)
            or obs.pending_shape[:1] != obs.input_shape[:1]
            or obs.pending_dtype != obs.input_dtype
        )
    return not obs.all_decode or obs.pending_shape != obs.input_shape or obs.pending_dtype != obs.input_dtype


def order_changed(obs: StepObservation) -> bool:
    return obs.prev_req_ids != obs.curr_req_ids


def spec_steady(obs: StepObservation) -> bool:
    # Same set, order and rows (the rows before caught any change): every row verifies the drafts
    # the pending program proposed.
    return obs.pending_drafted and obs.all_spec


def spec_exit(obs: StepObservation) -> bool:
    # Same set, order and rows, every row one token: the pending future's first column is the input.
    return obs.pending_drafted and obs.all_decode


def host_drafts(obs: StepObservation) -> bool:
    # The drafter reads the request's history up to its newest token, which the pending future holds.
    return obs.host_drafter


def relay_covers(obs: StepObservation) -> bool:
    # The future cannot be the input as it is, and the engine relays. The spec (RelayFrom) shows
    # every row is then covered: a row's newest token is in this future or already on the host.
    return obs.relay and (composition_changed(obs) or future_does_not_fit(obs) or order_changed(obs))


def mask_waits(obs: StepObservation) -> bool:
    # A masked row's newest token is still a future: its grammar cannot have taken it yet.
    return not obs.masked_req_ids.isdisjoint(obs.pending_sampled_req_ids)


Predicate = Callable[[StepObservation], bool]

CONDITIONS: dict[str, Predicate] = {
    "host_drafts": host_drafts,
    "relay_covers": relay_covers,
    "composition_changed": composition_changed,
    "future_does_not_fit": future_does_not_fit,
    "order_changed": order_changed,
    "spec_steady": spec_steady,
    "spec_exit": spec_exit,
    "mask_waits": mask_waits,
}

# The transition table. For one trigger and source, the first row whose condition holds wins.
TRANSITIONS: tuple[dict, ...] = (
    {"trigger": "step", "source": IDLE, "dest": NO_PENDING_FUTURE},
    # Hazard: stale drafts. Drafting from a history without its newest token gives other drafts than
    # sync mode, and seeded acceptance depends on the draft (docs/spec-decode.md §6).
    {"trigger": "step", "source": REINSTATE, "dest": HOST_DRAFT_BREAK, "conditions": "host_drafts"},
    {"trigger": "step", "source": REINSTATE, "dest": RELAY, "conditions": "relay_covers"},
    {"trigger": "step", "source": REINSTATE, "dest": COMPOSITION_BREAK, "conditions": "composition_changed"},
    {"trigger": "step", "source": REINSTATE, "dest": SHAPE_MISMATCH_REBUILD, "conditions": "future_does_not_fit"},
    {"trigger": "step", "source": REINSTATE, "dest": REORDER_REMAP, "conditions": "order_changed"},
    {"trigger": "step", "source": REINSTATE, "dest": SPEC_STEADY, "conditions": "spec_steady"},
    # Hazard: a draft as input. After a drafting step a one-token row reads the last accepted token
    # (next_input's first column), never a draft's column (NextInputInv, MCExitTakesLastDraft).
    {"trigger": "step", "source": REINSTATE, "dest": SPEC_EXIT, "conditions": "spec_exit"},
    {"trigger": "step", "source": REINSTATE, "dest": STEADY},
    # Hazard: stale mask. A mask built before the in-flight token reaches its grammar would let the
    # row sample a token the grammar forbids (FreshMaskInv, MCMaskBeforeInFlightToken).
    {"trigger": "launch", "source": list(PATH_STATES), "dest": SAMPLE_DEFERRED, "conditions": "mask_waits"},
    {"trigger": "launch", "source": list(PATH_STATES), "dest": SAMPLE_IN_PROGRAM},
    {"trigger": "reinstate", "source": [*PATH_STATES, *LAUNCH_STATES], "dest": REINSTATE},
    # A failure drops the pending future (shutdown does not: a shut-down engine is never stepped again).
    {"trigger": "drain", "source": list(STATES), "dest": IDLE},
)


class InputSource(Enum):
    """Where a step's input_ids come from. The values are the spec's (`InputSource` in the spec)."""

    CPU = "cpu"  # built on the host from the CPU token state (prefill rows: always their prompt)
    FUTURE = "future"  # the pending sampled-token future as it is: device to device, no host round trip
    REMAPPED_FUTURE = "remapped_future"  # the future's real rows gathered into this step's row order
    # built on the device: where(map >= 0, future[map], CPU-built ids), map by request id
    RELAYED_FUTURE = "relayed_future"
    # a drafted future's next_input [rows, 1 + k] as it is: each row's last accepted token and drafts
    DRAFTED_FUTURE = "drafted_future"
    # a drafted future's next_input[:, 0]: each row's last accepted token (never a draft's column)
    FUTURE_LAST_ACCEPTED = "future_last_accepted"


@dataclass(frozen=True)
class StepPlan:
    """What the runner does on one path state; the runner reads it and never the state's name."""

    materialize_first: bool  # bring the pending output to the host before the batch is updated
    input_source: InputSource


@dataclass(frozen=True)
class SamplePlan:
    """When a step with a masked row samples; the runner reads it and never the state's name."""

    split: bool  # the forward now, the sampling later under a mask the engine core builds then


SAMPLE_PLANS: Mapping[str, SamplePlan] = MappingProxyType({
    SAMPLE_IN_PROGRAM: SamplePlan(split=False),  # the mask the scheduler built is a program input
    SAMPLE_DEFERRED:   SamplePlan(split=True),
})  # fmt: skip


# Each path state's plan: the spec's `Materializes` and `InputSource` (model_check checks they agree).
PLANS: Mapping[str, StepPlan] = MappingProxyType({
    NO_PENDING_FUTURE:      StepPlan(materialize_first=False, input_source=InputSource.CPU),
    # Hazard: stale input ids and drafts. Materialize, then draft and build inputs on the CPU.
    HOST_DRAFT_BREAK:       StepPlan(materialize_first=True,  input_source=InputSource.CPU),
    # Hazard: stale input ids. Materialize before inputs are built, then build them on the CPU.
    COMPOSITION_BREAK:      StepPlan(materialize_first=True,  input_source=InputSource.CPU),
    SHAPE_MISMATCH_REBUILD: StepPlan(materialize_first=True,  input_source=InputSource.CPU),
    # Hazard: token ownership after condense(). The future's rows must follow their requests.
    REORDER_REMAP:          StepPlan(materialize_first=False, input_source=InputSource.REMAPPED_FUTURE),
    STEADY:                 StepPlan(materialize_first=False, input_source=InputSource.FUTURE),
    # Hazard: optimistic positions. The host's counts assume every draft accepted: the program places
    # each row at its slot's device count of accepted tokens (slot_len), never the host's position.
    SPEC_STEADY:            StepPlan(materialize_first=False, input_source=InputSource.DRAFTED_FUTURE),
    SPEC_EXIT:              StepPlan(materialize_first=False, input_source=InputSource.FUTURE_LAST_ACCEPTED),
    # Hazard: stale input ids and token ownership. Only rows whose newest token this future holds
    # are mapped, by request id; every other row's CPU-built id is already correct.
    RELAY:                  StepPlan(materialize_first=False, input_source=InputSource.RELAYED_FUTURE),
})  # fmt: skip


def _compile(transitions: tuple[dict, ...]) -> Mapping[tuple[str, str], tuple[tuple[Predicate | None, str], ...]]:
    """TRANSITIONS as a lookup: (trigger, source) -> that trigger's rows from that source, in table
    order, each (its condition's predicate or None, dest). The first row whose predicate holds wins."""
    table: dict[tuple[str, str], list[tuple[Predicate | None, str]]] = {}
    for row in transitions:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        predicate = CONDITIONS[row["conditions"]] if "conditions" in row else None
        for source in sources:
            table.setdefault((row["trigger"], source), []).append((predicate, row["dest"]))
    return MappingProxyType({key: tuple(rows) for key, rows in table.items()})


# Derived from TRANSITIONS alone, once: the runtime guard's and decide()'s table (the hot path of
# every step: one dict lookup and the predicates, instead of a `transitions` event dispatch).
ROWS = _compile(TRANSITIONS)


def _dest(trigger: str, source: str, obs: StepObservation | None) -> str:
    """The state `trigger` leads to from `source`; MachineError where the table has no such edge."""
    rows = ROWS.get((trigger, source))
    if rows is None:
        raise MachineError(f"Can't trigger event {trigger} from state {source}!")
    for predicate, dest in rows:
        if predicate is None or predicate(obs):  # type: ignore[arg-type]  # conditions are step's only
            return dest
    raise AssertionError(f"transition table has no unconditional {trigger} from {source}")


def decide(obs: StepObservation) -> str:
    """The path state a step takes, derived from TRANSITIONS alone (pure; no machine, no torch)."""
    return _dest("step", REINSTATE if obs.has_pending else IDLE, obs)


class Transition(NamedTuple):
    """One trigger fired: what the machine did, returned to the caller (the runner traces it)."""

    trigger: str
    source: str
    dest: str  # after `step`: the step's path state, the runner's plan is PLANS[dest]


class AsyncStepMachine:
    """The runtime guard over TRANSITIONS (its lookup, `ROWS`), with step counters.

    Its calls are the table's triggers: `step(obs)`, `launch(obs)`, `reinstate()`, `drain()`; each returns
    the Transition it took. Illegal triggers raise `transitions.MachineError` and leave the state
    unchanged. It behaves as the `transitions` machine over the same table (`reference_machine()`;
    checked equal in tests/test_async_machine_lookup.py), at a tenth of its cost per step.
    """

    def __init__(self) -> None:
        self.async_steps = 0
        self.sync_fallback_steps = 0
        self.deferred_steps = 0  # steps whose sampling waited for the pending step (SampleDeferred)
        self.state_counts: dict[str, int] = {s: 0 for s in PATH_STATES}
        self.launch_counts: dict[str, int] = {s: 0 for s in LAUNCH_STATES}  # steps with a masked row
        self._state = IDLE

    @property
    def state(self) -> str:
        return self._state

    def step(self, obs: StepObservation) -> Transition:
        """Fire `step` with the observation: the step's path state is the transition's `dest`; count it."""
        source = self._state
        if source in (IDLE, REINSTATE) and (source == REINSTATE) != obs.has_pending:
            raise ValueError(f"observation has_pending={obs.has_pending} contradicts machine state {source}")
        transition = self._fire("step", obs)
        self.state_counts[transition.dest] += 1
        if transition.dest in ASYNC_STATES:
            self.async_steps += 1
        else:
            self.sync_fallback_steps += 1
        return transition

    def launch(self, obs: StepObservation) -> Transition:
        """Fire `launch` (a step with a masked row): when it samples is the transition's `dest`."""
        transition = self._fire("launch", obs)
        self.launch_counts[transition.dest] += 1
        if transition.dest == SAMPLE_DEFERRED:
            self.deferred_steps += 1
        return transition

    def reinstate(self) -> Transition:
        return self._fire("reinstate")

    def drain(self) -> Transition:
        return self._fire("drain")

    def counters(self) -> dict:
        return {
            "async_steps": self.async_steps,
            "sync_fallback_steps": self.sync_fallback_steps,
            "deferred_steps": self.deferred_steps,
            "state_counts": dict(self.state_counts),
            "launch_counts": dict(self.launch_counts),
        }

    def _fire(self, trigger: str, obs: StepObservation | None = None) -> Transition:
        source = self._state
        self._state = dest = _dest(trigger, source, obs)  # raises before the state changes
        return Transition(trigger, source, dest)


def reference_machine(initial: str = IDLE) -> Machine:
    """The `transitions` machine over TRANSITIONS (its own model; triggers take `obs=`): the library's
    reading of the table, which the runtime guard must match (tests) and the diagram draws."""
    return Machine(
        states=list(STATES),
        transitions=[_machine_row(row) for row in TRANSITIONS],
        initial=initial,
        auto_transitions=False,
        send_event=True,
    )


def _machine_row(row: dict) -> dict:
    """A TRANSITIONS row for `transitions`: the condition's name becomes its predicate (same as decide())."""
    row = dict(row)
    if "conditions" in row:
        predicate = CONDITIONS[row["conditions"]]
        row["conditions"] = lambda event, predicate=predicate: predicate(event.kwargs["obs"])
    return row
