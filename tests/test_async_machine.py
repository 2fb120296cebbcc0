"""The step machine alone: the pure decision, the table, illegal triggers, counters. No torch."""

import pytest
from transitions import MachineError

from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.input_batch import next_row_order


def obs(
    prev=("a", "b"),
    curr=("a", "b"),
    decode=True,
    pshape=(4,),
    ishape=(4,),
    pdtype="int32",
    pending=True,
    relay=False,
    host=False,
    drafted=False,
    spec=False,
):
    return sm.StepObservation(
        pending,
        prev if pending else (),
        curr,
        decode,
        pshape,
        pdtype,
        ishape,
        "int32",
        relay,
        host_drafter=host,
        pending_drafted=drafted,
        all_spec=spec,
    )


def drafted(**kw):
    """After a draft_model spec step: the future is [rows, 2(1 + k)], this step's input [rows, L]."""
    return obs(**{"drafted": True, "decode": False, "spec": True, "pshape": (2, 8), "ishape": (2, 4), **kw})


@pytest.mark.parametrize(
    "observation,expected",
    [
        (obs(pending=False), sm.NO_PENDING_FUTURE),
        (obs(curr=("a",)), sm.COMPOSITION_BREAK),  # finished / unscheduled
        (obs(curr=("a", "b", "c")), sm.COMPOSITION_BREAK),  # joined
        (obs(curr=("b", "c")), sm.COMPOSITION_BREAK),  # same size, different set
        (obs(pshape=(2,)), sm.SHAPE_MISMATCH_REBUILD),  # first decode after a prefill
        (obs(pdtype="int64"), sm.SHAPE_MISMATCH_REBUILD),
        (obs(decode=False, ishape=(2, 16)), sm.SHAPE_MISMATCH_REBUILD),  # chunked prefill continues
        (obs(curr=("b", "a")), sm.REORDER_REMAP),
        (obs(curr=("b", "a"), pshape=(2,)), sm.SHAPE_MISMATCH_REBUILD),  # rebuild beats remap
        (obs(), sm.STEADY),
    ],
)
def test_decide_follows_the_design(observation, expected):
    assert sm.decide(observation) == expected


@pytest.mark.parametrize(
    "observation,expected",
    [
        (obs(pending=False, relay=True), sm.NO_PENDING_FUTURE),
        (obs(curr=("a",), relay=True), sm.RELAY),  # finished / unscheduled
        (obs(curr=("a", "b", "c"), decode=False, ishape=(3, 16), relay=True), sm.RELAY),  # a prefill joins
        (obs(pshape=(2,), relay=True), sm.RELAY),  # first decode after a prefill
        (obs(pdtype="int64", relay=True), sm.RELAY),
        (obs(decode=False, ishape=(2, 16), relay=True), sm.RELAY),  # chunked prefill beside a decode
        (obs(curr=("b", "a"), relay=True), sm.RELAY),  # condense() reordered
        (obs(relay=True), sm.STEADY),  # the future as it is: nothing to relay
    ],
)
def test_with_the_relay_every_step_steady_cannot_take_relays(observation, expected):
    assert sm.decide(observation) == expected


@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
@pytest.mark.parametrize(
    "observation",
    [
        obs(),  # what would be Steady
        obs(curr=("a",)),  # a request left
        obs(curr=("a", "b", "c"), decode=False, ishape=(3, 16)),  # a prefill joins
        obs(curr=("b", "a")),  # condense() reordered
        obs(pshape=(2,)),  # first decode after a prefill
    ],
)
def test_with_a_host_drafter_every_step_with_a_pending_future_breaks_for_its_drafts(observation, relay):
    host = sm.StepObservation(**{**observation.__dict__, "relay": relay, "host_drafter": True})
    assert sm.decide(host) == sm.HOST_DRAFT_BREAK
    assert sm.decide(obs(pending=False, host=True, relay=relay)) == sm.NO_PENDING_FUTURE
    assert sm.PLANS[sm.HOST_DRAFT_BREAK] == sm.StepPlan(materialize_first=True, input_source=sm.InputSource.CPU)


@pytest.mark.parametrize(
    "observation,expected",
    [
        (drafted(), sm.SPEC_STEADY),  # every row verifies k drafts: next_input as it is
        (drafted(ishape=(2, 8)), sm.SPEC_STEADY),  # the input's width is not the future's
        (drafted(spec=False, decode=True), sm.SPEC_EXIT),  # every row one token: next_input[:, 0]
        (drafted(spec=False), sm.SHAPE_MISMATCH_REBUILD),  # spec and plain rows mixed, or a prompt chunk
        (drafted(spec=False, relay=True), sm.RELAY),
        (drafted(curr=("a",)), sm.COMPOSITION_BREAK),
        (drafted(ishape=(3, 4), curr=("a", "b", "c")), sm.COMPOSITION_BREAK),
        (drafted(curr=("b", "a")), sm.REORDER_REMAP),  # the future's rows permuted, then as SpecSteady
        (drafted(pdtype="int64"), sm.SHAPE_MISMATCH_REBUILD),
        (drafted(host=True), sm.HOST_DRAFT_BREAK),
        (obs(decode=False, spec=True, pshape=(2, 4), ishape=(2, 4)), sm.SHAPE_MISMATCH_REBUILD),  # not drafted
    ],
)
def test_a_drafted_future_fits_an_all_spec_or_all_one_token_step_of_its_rows(observation, expected):
    assert sm.decide(observation) == expected


def test_the_spec_rows_are_async_and_read_the_drafted_future():
    assert sm.PLANS[sm.SPEC_STEADY] == sm.StepPlan(False, sm.InputSource.DRAFTED_FUTURE)
    assert sm.PLANS[sm.SPEC_EXIT] == sm.StepPlan(False, sm.InputSource.FUTURE_LAST_ACCEPTED)
    machine = sm.AsyncStepMachine()
    for o, state in [(obs(pending=False), sm.NO_PENDING_FUTURE), (drafted(), sm.SPEC_STEADY)]:
        assert machine.step(o).dest == state
        machine.reinstate()
    assert machine.step(drafted(spec=False, decode=True)).dest == sm.SPEC_EXIT
    assert (machine.async_steps, machine.sync_fallback_steps) == (2, 1)
    assert machine.state_counts[sm.SPEC_STEADY] == machine.state_counts[sm.SPEC_EXIT] == 1


def test_machine_and_pure_decision_agree_and_count():
    machine = sm.AsyncStepMachine()
    seq = [obs(pending=False), obs(pshape=(2,)), obs(), obs(), obs(curr=("b", "a")), obs(curr=("a",))]
    for o in seq:
        assert machine.step(o).dest == sm.decide(o)
        machine.reinstate()
    assert machine.async_steps == 2
    assert machine.sync_fallback_steps == 4
    assert machine.state_counts == {
        sm.NO_PENDING_FUTURE: 1,
        sm.COMPOSITION_BREAK: 1,
        sm.SHAPE_MISMATCH_REBUILD: 1,
        sm.REORDER_REMAP: 1,
        sm.STEADY: 2,
        sm.RELAY: 0,
        sm.HOST_DRAFT_BREAK: 0,
        sm.SPEC_STEADY: 0,
        sm.SPEC_EXIT: 0,
    }
    machine.step(obs(host=True))  # counted as a sync fallback, in its own state count
    assert (machine.async_steps, machine.sync_fallback_steps) == (2, 5)
    assert machine.state_counts[sm.HOST_DRAFT_BREAK] == 1


def test_illegal_triggers_raise_and_leave_the_state_unchanged():
    machine = sm.AsyncStepMachine()
    with pytest.raises(MachineError):
        machine.reinstate()  # reinstate from Idle
    assert machine.state == sm.IDLE
    machine.step(obs(pending=False))
    with pytest.raises(MachineError):
        machine.step(obs())  # step twice without reinstate
    assert machine.state == sm.NO_PENDING_FUTURE
    assert machine.sync_fallback_steps == 1


def test_observation_must_match_the_buffer_state():
    machine = sm.AsyncStepMachine()
    with pytest.raises(ValueError, match="has_pending"):
        machine.step(obs())


def test_steady_relay_and_the_spec_rows_are_the_async_steps():
    assert sm.ASYNC_STATES == {sm.STEADY, sm.RELAY, sm.SPEC_STEADY, sm.SPEC_EXIT}
    assert set(sm.PATH_STATES) | set(sm.LAUNCH_STATES) | {sm.IDLE, sm.REINSTATE} == set(sm.STATES)


def test_every_path_state_has_one_plan_and_only_path_states_have_one():
    assert set(sm.PLANS) == set(sm.PATH_STATES)
    assert all(isinstance(plan.input_source, sm.InputSource) for plan in sm.PLANS.values())


def test_every_trigger_returns_the_transition_it_took():
    machine = sm.AsyncStepMachine()
    seen = [machine.step(obs(pending=False)), machine.reinstate(), machine.drain()]
    assert seen == [
        ("step", sm.IDLE, sm.NO_PENDING_FUTURE),
        ("reinstate", sm.NO_PENDING_FUTURE, sm.REINSTATE),
        ("drain", sm.REINSTATE, sm.IDLE),
    ]


@pytest.mark.parametrize(
    "rows,removed,added,expected",
    [
        ("abcd", "b", "", "adc"),  # condense moves the last row into the hole: a reorder
        ("abcd", "b", "e", "aecd"),  # a new request fills the hole: no reorder
        ("abcd", "bc", "", "ad"),
        ("abcd", "ad", "", "cb"),
        ("abcd", "", "e", "abcde"),
        ("", "", "ab", "ab"),
    ],
)
def test_row_order_after_update(rows, removed, added, expected):
    assert next_row_order(list(rows), frozenset(removed), list(added)) == list(expected)
