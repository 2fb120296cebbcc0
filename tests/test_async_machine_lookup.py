"""The runtime guard (a lookup built from TRANSITIONS) behaves exactly as the `transitions` machine
over the same table: same destination for every state, trigger and observation, same refusals."""

import itertools

import pytest
from transitions import MachineError

from neuron_async_sm.worker import async_machine as sm


def _observations() -> list[sm.StepObservation]:
    """Every combination of the predicates' inputs: set, order, all-decode, shape, dtype, relay,
    (launch) which rows sample under a grammar, a host-side drafter, and (without those three, as the
    engine runs it) a drafted pending future with steps whose rows all verify drafts or not."""
    prev = ("a", "b")
    currents = [("a", "b"), ("b", "a"), ("a",), ("a", "b", "c"), ("b", "c")]
    out = []
    for pending, curr, decode, shape, dtype, relay, masked, host, (drafted, spec) in itertools.product(
        (True, False),
        currents,
        (True, False),
        ((2,), (4,)),
        ("int32", "int64"),
        (False, True),
        ((), ("a",), ("c",)),
        (False, True),
        ((False, False), (True, False), (True, True)),
    ):
        if drafted and (relay or masked or host):
            continue
        before = prev if pending else ()
        out.append(
            sm.StepObservation(
                pending,
                before,
                curr,
                decode,
                shape,
                dtype,
                (2,),
                "int32",
                relay,
                frozenset(masked),
                frozenset(before),
                host_drafter=host,
                pending_drafted=drafted and pending,
                all_spec=spec and not decode,
            )
        )
    return out


OBSERVATIONS = _observations()
TRIGGERS = ("step", "launch", "reinstate", "drain")


REFERENCE = sm.reference_machine()


def _reference(state: str, trigger: str, obs: sm.StepObservation) -> str:
    machine = REFERENCE
    machine.set_state(state)
    try:
        getattr(machine, trigger)(obs=obs)
    except MachineError:
        return "MachineError"
    return machine.state


def _lookup(state: str, trigger: str, obs: sm.StepObservation) -> str:
    machine = sm.AsyncStepMachine()
    machine._state = state  # any state, as the reference machine starts there
    try:
        if trigger == "step":
            machine.step(obs)
        elif trigger == "launch":
            machine.launch(obs)
        else:
            getattr(machine, trigger)()
    except MachineError:
        assert machine.state == state, "a refused trigger changed the state"
        return "MachineError"
    except ValueError:  # the observation contradicts the rest state: refused before the table
        return "contradiction"
    return machine.state


@pytest.mark.parametrize("state", sm.STATES)
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_lookup_equals_the_transitions_machine(state, trigger):
    compared = 0
    for obs in OBSERVATIONS:
        got = _lookup(state, trigger, obs)
        if got == "contradiction":
            continue
        assert got == _reference(state, trigger, obs), (state, trigger, obs)
        compared += 1
    assert compared >= len(OBSERVATIONS) // 2


def test_every_table_row_is_taken_somewhere():
    """The comparison above reaches every edge of the table (it is not vacuous)."""
    taken = set()
    for state, obs in itertools.product(sm.STATES, OBSERVATIONS):
        for trigger in TRIGGERS:
            got = _lookup(state, trigger, obs)
            if got not in ("MachineError", "contradiction"):
                taken.add((trigger, state, got))
    for row in sm.TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for source in sources:
            assert (row["trigger"], source, row["dest"]) in taken
