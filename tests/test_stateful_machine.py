"""The step machine alone: the pure `decide()` and the `transitions` machine against the table read by hand.

One rule per row of `async_machine.TRANSITIONS`, named like it (`step_to_<dest>`, `reinstate`, `drain`),
so the rules line up with the TLA+ actions and the trace events. Each step rule builds an observation
of the situation its row names (first step, set changed, shape mismatch or prefill, reorder, steady)
and checks that both `decide()` and the machine take that row; the observations deliberately make
later rows' conditions true as well, so "first matching row wins" is exercised. No torch, no engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transitions import MachineError

from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.input_batch import next_row_order

POOL = tuple("abcdefghij")  # request ids
SAMPLED = "torch.int32"  # dtype of a sampled-token future, and of input_ids
IDS = st.lists(st.sampled_from(POOL), min_size=1, max_size=8, unique=True).map(tuple)
REST_STATES = (sm.IDLE, sm.REINSTATE)
RUNS: Counter[str] = Counter()  # examples and checks over the session, for the report


@dataclass(frozen=True)
class Step:
    """One forward step as the machine's observation sees it."""

    req_ids: tuple[str, ...]
    all_decode: bool
    input_shape: tuple[int, ...]  # decode: [bucket]; prefill: [rows, bucket]
    input_dtype: str = SAMPLED
    all_spec: bool = False  # every row verifies k drafts (speculation with a drafter on the device)
    drafts: bool = False  # its program drafts (draft_model): its output carries next_input

    @property
    def output_shape(self) -> tuple[int, ...]:
        if self.drafts:  # the tokens, then next_input: [rows, 2(1 + k)], k = 3
            return (self.input_shape[0], 8)
        return (self.input_shape[0],)  # one sampled token per padded row (a prefill is not padded in rows)


def spec_step(req_ids: tuple[str, ...], all_spec: bool = True, one_token: bool = False) -> Step:
    """A draft_model spec step: its input is [rows, L] whatever its rows hold."""
    return Step(req_ids, one_token, (len(req_ids), 4 if all_spec else 8), all_spec=all_spec, drafts=True)


def decode(req_ids: tuple[str, ...], pad: int = 0) -> Step:
    return Step(req_ids, True, (len(req_ids) + pad,))


def prefill(req_ids: tuple[str, ...], length: int = 16) -> Step:
    return Step(req_ids, False, (len(req_ids), length))


class AsyncStepMachineVsTable(RuleBasedStateMachine):
    """Model: the state, the pending step and the counters the table says; the SUT: AsyncStepMachine."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: list[tuple[str, str, str]] = []
        self.machine = sm.AsyncStepMachine()
        self.expected: list[tuple[str, str, str]] = []
        self.state = sm.IDLE
        self.pending: Step | None = None  # the step whose sampled-token future the buffer holds
        self.current: Step | None = None  # the step in progress (machine in a path state)
        self.counts: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()  # steps with a masked row, by launch state
        RUNS["examples"] += 1

    def _observe(self, step: Step, relay: bool = False, host_drafter: bool = False) -> sm.StepObservation:
        pending = self.pending
        return sm.StepObservation(
            has_pending=pending is not None,
            prev_req_ids=pending.req_ids if pending else (),
            curr_req_ids=step.req_ids,
            all_decode=step.all_decode,
            pending_shape=pending.output_shape if pending else (),
            pending_dtype=SAMPLED if pending else "",
            input_shape=step.input_shape,
            input_dtype=step.input_dtype,
            relay=relay,
            host_drafter=host_drafter,
            pending_drafted=pending is not None and pending.drafts,
            all_spec=step.all_spec,
        )

    def _step(self, dest: str, step: Step, relay: bool = False, host_drafter: bool = False) -> None:
        obs = self._observe(step, relay, host_drafter)
        note(f"step -> {dest}: {obs}")
        assert sm.decide(obs) == dest
        transition = self.machine.step(obs)
        self.reported.append(transition)
        assert transition.dest == dest
        self.expected.append(("step", self.state, dest))
        self.state, self.current = dest, step
        self.counts[dest] += 1

    # -- one rule per transition ------------------------------------------------------------------

    @precondition(lambda self: self.state == sm.IDLE)
    @rule(
        req_ids=IDS,
        is_decode=st.booleans(),
        pad=st.integers(0, 3),
        relay=st.booleans(),
        host=st.booleans(),
        drafts=st.booleans(),
    )
    def step_to_NoPendingFuture(
        self, req_ids: tuple[str, ...], is_decode: bool, pad: int, relay: bool, host: bool, drafts: bool
    ) -> None:
        """First step, or first after a drain: nothing pending, whatever the step looks like (a host-side
        drafter has the whole history then; a draft_model prefill drafts after its sample)."""
        step = decode(req_ids, pad) if is_decode else prefill(req_ids)
        if drafts and not host:  # a draft_model step (its rows are not padded): a prefill that drafts
            step = spec_step(req_ids, all_spec=False)
        self._step(sm.NO_PENDING_FUTURE, step, relay, host)

    @precondition(lambda self: self.state == sm.REINSTATE)
    @rule(data=st.data(), relay=st.booleans(), cause=st.sampled_from(["same", "set", "prefill", "order"]))
    def step_to_HostDraftBreak(self, data: st.DataObject, relay: bool, cause: str) -> None:
        """Speculation with a host-side drafter (n-gram): every step with a pending future breaks for its
        drafts, whatever else holds, even a step Steady or the relay would take."""
        prev = self.pending.req_ids
        unused = [r for r in POOL if r not in prev]
        if cause == "set":
            curr = tuple(next_row_order(list(prev), frozenset(prev[-1:]), [] if len(prev) > 1 else unused[:1]))
            step = decode(curr)
        elif cause == "prefill":
            step = prefill(prev)
        elif cause == "order":
            step = Step(tuple(data.draw(st.permutations(prev), label="order")), True, self.pending.output_shape)
        else:
            step = Step(prev, True, self.pending.output_shape)
        self._step(sm.HOST_DRAFT_BREAK, step, relay, host_drafter=True)

    @precondition(lambda self: self.state == sm.REINSTATE)
    @rule(data=st.data(), cause=st.sampled_from(["set", "prefill", "bucket", "dtype", "order"]))
    def step_to_Relay(self, data: st.DataObject, cause: str) -> None:
        """The relay on, and the future cannot be the input as it is: whatever the cause, it relays."""
        prev = self.pending.req_ids
        unused = [r for r in POOL if r not in prev]
        curr = tuple(data.draw(st.permutations(prev), label="order"))
        if cause == "set":  # a request leaves (condense() may move a row) or joins
            curr = tuple(next_row_order(list(prev), frozenset(prev[-1:]), [] if len(prev) > 1 else unused[:1]))
            step = decode(curr) if data.draw(st.booleans(), label="decode") else prefill(curr)
        elif cause == "prefill":
            step = prefill(curr)
        elif cause == "bucket":
            step = Step(curr, True, (self.pending.output_shape[0] + 1,))
        elif cause == "dtype":
            step = Step(curr, True, self.pending.output_shape, "torch.int64")
        else:
            step = Step(curr if curr != prev or len(prev) < 2 else prev[1:] + prev[:1], True, self.pending.output_shape)
            if step.req_ids == prev:  # one row: no reorder possible, change the bucket instead
                step = Step(prev, True, (self.pending.output_shape[0] + 1,))
        self._step(sm.RELAY, step, relay=True)

    @precondition(lambda self: self.state == sm.REINSTATE)
    @rule(data=st.data(), is_decode=st.booleans(), pad=st.integers(0, 3))
    def step_to_CompositionBreak(self, data: st.DataObject, is_decode: bool, pad: int) -> None:
        """The set changed (finished, aborted, joined, unscheduled): wins over shape and order."""
        prev = self.pending.req_ids
        removed = data.draw(st.sets(st.sampled_from(prev)), label="removed")
        unused = [r for r in POOL if r not in prev]
        added = data.draw(st.lists(st.sampled_from(unused), unique=True, max_size=3), label="added") if unused else []
        if not removed and not added:  # same set: change it by the smallest step
            removed = {prev[-1]} if len(prev) > 1 else set()
            added = [] if removed else [unused[0]]
        curr = tuple(next_row_order(list(prev), frozenset(removed), added))
        if not curr:  # everyone left: one joins (or, with every id taken, one stays)
            curr = (unused[0],) if unused else prev[:1]
        step = decode(curr, pad) if is_decode else prefill(curr)
        if data.draw(st.booleans(), label="drafts"):  # a draft_model step: its rows draft, whatever they are
            step = spec_step(curr, all_spec=not is_decode, one_token=is_decode)
        self._step(sm.COMPOSITION_BREAK, step)

    @precondition(lambda self: self.state == sm.REINSTATE)
    @rule(data=st.data(), cause=st.sampled_from(["prefill", "bucket", "dtype"]))
    def step_to_ShapeMismatchRebuild(self, data: st.DataObject, cause: str) -> None:
        """Same set (any order: rebuild wins over remap), but the future cannot be this step's input."""
        curr = tuple(data.draw(st.permutations(self.pending.req_ids), label="order"))
        pending_rows = self.pending.output_shape[0]
        if cause == "prefill":  # a chunked prefill continues, or the first decode input is 2-D
            step = prefill(curr)
        elif cause == "bucket":  # first decode after a prefill ([rows] vs a padded bucket), or a bucket change
            bucket = len(curr) + data.draw(st.integers(0, 7), label="padding")
            step = Step(curr, True, (bucket + 1 if bucket == pending_rows else bucket,))
        else:
            step = Step(curr, True, (pending_rows,), "torch.int64")
        self._step(sm.SHAPE_MISMATCH_REBUILD, step)

    @precondition(lambda self: self.state == sm.REINSTATE and len(self.pending.req_ids) >= 2)
    @rule(data=st.data())
    def step_to_ReorderRemap(self, data: st.DataObject) -> None:
        """Same set, same shape, all decode, but condense() moved rows."""
        prev = self.pending.req_ids
        curr = tuple(data.draw(st.permutations(prev), label="order"))
        if curr == prev:
            curr = prev[1:] + prev[:1]
        self._step(sm.REORDER_REMAP, Step(curr, True, self.pending.output_shape))

    @precondition(lambda self: self.state == sm.REINSTATE and self.pending.drafts)
    @rule(relay=st.booleans())
    def step_to_SpecSteady(self, relay: bool) -> None:
        """A drafted future, the same rows in the same order, every row verifying k drafts: next_input is
        the input as it is (relay or not)."""
        self._step(sm.SPEC_STEADY, spec_step(self.pending.req_ids), relay)

    @precondition(lambda self: self.state == sm.REINSTATE and self.pending.drafts)
    @rule(relay=st.booleans())
    def step_to_SpecExit(self, relay: bool) -> None:
        """A drafted future, the same rows in the same order, every row one token (speculation off near
        max_model_len): next_input's first column is the input."""
        self._step(sm.SPEC_EXIT, spec_step(self.pending.req_ids, all_spec=False, one_token=True), relay)

    @precondition(lambda self: self.state == sm.REINSTATE and not self.pending.drafts)
    @rule(relay=st.booleans())
    def step_to_Steady(self, relay: bool) -> None:
        """Same set, same order, all decode, same shape and dtype: the future is the input (relay or not)."""
        self._step(sm.STEADY, Step(self.pending.req_ids, True, self.pending.output_shape), relay)

    @precondition(lambda self: self.state in sm.PATH_STATES)
    @rule(data=st.data())
    def launch(self, data: st.DataObject) -> None:
        """A step with rows under a grammar: it defers its sampling exactly when a masked request's
        newest token is in the pending future (the spec's MaskWaits)."""
        rows = self.current.req_ids
        masked = frozenset(data.draw(st.sets(st.sampled_from(rows), min_size=1)) if rows else ())
        pending = frozenset(self.pending.req_ids) if self.pending is not None else frozenset()
        obs = replace(self._observe(self.current), masked_req_ids=masked, pending_sampled_req_ids=pending)
        dest = sm.SAMPLE_DEFERRED if masked & pending else sm.SAMPLE_IN_PROGRAM
        note(f"launch -> {dest}: masked {sorted(masked)}, pending {sorted(pending)}")
        transition = self.machine.launch(obs)
        self.reported.append(transition)
        assert transition.dest == dest
        self.expected.append(("launch", self.state, dest))
        self.state = dest
        self.launches[dest] += 1

    @precondition(lambda self: self.state in sm.PATH_STATES or self.state in sm.LAUNCH_STATES)
    @rule()
    def reinstate(self) -> None:
        self.reported.append(self.machine.reinstate())
        self.expected.append(("reinstate", self.state, sm.REINSTATE))
        self.state, self.pending, self.current = sm.REINSTATE, self.current, None

    @rule()
    def drain(self) -> None:
        """A failure or shutdown, at any point: the pending future is dropped."""
        self.reported.append(self.machine.drain())
        self.expected.append(("drain", self.state, sm.IDLE))
        self.state, self.pending, self.current = sm.IDLE, None, None

    # -- what the table forbids ---------------------------------------------------------------------

    @rule(req_ids=IDS)
    def refuse_illegal_trigger(self, req_ids: tuple[str, ...]) -> None:
        """`reinstate` outside a step, `step` inside one, or an observation that contradicts the buffer."""
        before = (self.machine.state, self.machine.counters())
        if self.state in REST_STATES:
            with pytest.raises(MachineError):
                self.machine.reinstate()
            lying = sm.StepObservation(
                self.pending is None,
                ("z",) if self.pending is None else (),
                req_ids,
                True,
                (1,),
                SAMPLED,
                (len(req_ids),),
                SAMPLED,
            )
            with pytest.raises(ValueError, match="has_pending"):
                self.machine.step(lying)
        else:
            with pytest.raises(MachineError):
                self.machine.step(self._observe(decode(req_ids)))
        assert (self.machine.state, self.machine.counters()) == before

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def state_is_the_tables(self) -> None:
        RUNS["invariant checks"] += 1  # once at the start and after every rule
        assert self.machine.state == self.state
        assert self.machine.state in sm.STATES
        if self.state in REST_STATES:  # during a step the buffer still holds the previous step's future
            assert (self.state == sm.REINSTATE) == (self.pending is not None)

    @invariant()
    def only_the_async_states_count_as_async(self) -> None:
        assert self.machine.async_steps == sum(self.counts[s] for s in sm.ASYNC_STATES)
        assert self.machine.async_steps + self.machine.sync_fallback_steps == sum(self.counts.values())
        assert self.machine.state_counts == {s: self.counts[s] for s in sm.PATH_STATES}
        assert self.machine.launch_counts == {s: self.launches[s] for s in sm.LAUNCH_STATES}
        assert self.machine.deferred_steps == self.launches[sm.SAMPLE_DEFERRED]

    @invariant()
    def every_transition_reported_once(self) -> None:
        assert self.reported == self.expected


TestAsyncStepMachine = AsyncStepMachineVsTable.TestCase
TestAsyncStepMachine.settings = settings(max_examples=settings.default.max_examples * 2)


def test_one_rule_per_transition_named_like_it():
    """Adding a row to TRANSITIONS without a rule here (or renaming one) fails this test."""
    table = {
        f"{row['trigger']}_to_{row['dest']}" if row["trigger"] == "step" else row["trigger"] for row in sm.TRANSITIONS
    }
    # hypothesis marks @rule methods with this attribute (stateful.RULE_MARKER)
    rules = {name for name, f in vars(AsyncStepMachineVsTable).items() if hasattr(f, "hypothesis_stateful_rule")}
    assert rules - table == {"refuse_illegal_trigger"}
    assert table <= rules
