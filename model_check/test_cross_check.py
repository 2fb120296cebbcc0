"""The spec and the code cannot drift apart: both sides are derived from what they really do.

- The machine's transitions: TLC's state graphs of MCMachine, MCMachineRelay (the relay off and on),
  MCMachineHostDraft (a host-side drafter) and MCMachineDeviceDraft (a drafter on the device),
  projected onto the machine state, have together exactly the edges of `async_machine.TRANSITIONS`.
- The decision and the row order: the spec's `Decide` and `NextRowOrder` give what the Python
  `decide()` and `next_row_order()` give, on cases TLC checks as ASSUMEs of a generated module.
- Each path state's plan: TLC evaluates the spec's `Materializes` and `InputSource` for every path
  state, and the result must be `async_machine.PLANS`.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import shutil
from itertools import permutations
from pathlib import Path

from tlc import SPEC_DIR, TlcResult, manifest_models, run_tlc, tla

from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.input_batch import next_row_order

# The models whose state graphs make the spec side: the relay off (every design path), on (Relay), a
# host-side drafter (HostDraftBreak) and one on the device (SpecSteady, SpecExit).
MACHINE_MODELS = [m for m in manifest_models() if m.get("dump") == "dot"]
_NODE = re.compile(r'^(-?\d+) \[label="[^\n]*?mstate = \\"(\w+)\\"', re.M)
_EDGE = re.compile(r'^(-?\d+) -> (-?\d+) \[label="(\w+)"', re.M)


def table_edges() -> set[tuple[str, str, str]]:
    """(trigger, source, dest) for every row of the Python transition table that the machine models'
    state graphs reach: they have no grammar, so the launch states (structured output; see the test
    below) are left out, and a path state's own `reinstate` edge stands for the reinstate after a launch."""
    edges = set()
    for row in sm.TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        edges |= {
            (row["trigger"], source, row["dest"])
            for source in sources
            if source not in sm.LAUNCH_STATES and row["dest"] not in sm.LAUNCH_STATES
        }
    return edges


def test_launch_rows_are_the_structured_output_specs_launch_actions():
    """The `launch` rows lead from every path state to the two launch actions of StructuredOutput.tla
    (and of AsyncScheduling.tla, whose trace validation replays them), the deferral under the
    condition the spec's SampleDeferred requires (MaskWaits) and the in-program sampling otherwise,
    as its SampleInProgram's guard says."""
    engine = (SPEC_DIR / "AsyncScheduling.tla").read_text()
    assert re.search(
        r"^SampleInProgram ==\n\s+/\\ Launch\(\"SampleInProgram\"\)\n\s+/\\ ~MaskWaits\(cur\)", engine, re.M
    )
    assert re.search(r"^SampleDeferred ==\n\s+/\\ Launch\(\"SampleDeferred\"\)\n\s+/\\ MaskWaits\(cur\)", engine, re.M)
    assert re.search(r"^LaunchStates == \{\"SampleInProgram\", \"SampleDeferred\"\}", engine, re.M)
    spec = (SPEC_DIR / "StructuredOutput.tla").read_text()
    launch = [row for row in sm.TRANSITIONS if row["trigger"] == "launch"]
    assert [(row["dest"], row.get("conditions")) for row in launch] == [
        (sm.SAMPLE_DEFERRED, "mask_waits"),
        (sm.SAMPLE_IN_PROGRAM, None),
    ]
    assert all(row["source"] == list(sm.PATH_STATES) for row in launch)
    for state in sm.LAUNCH_STATES:
        assert re.search(rf"^{state} ==$", spec, re.M), f"StructuredOutput.tla has no action {state}"
    assert re.search(r"^SampleDeferred ==\n(?:.*\n)*?\s+/\\ MaskWaits\(order\)", spec, re.M)
    assert "~(DeferWhenMaskWaits /\\ MaskWaits(order))" in spec
    reinstate = {s for row in sm.TRANSITIONS if row["trigger"] == "reinstate" for s in row["source"]}
    assert set(sm.LAUNCH_STATES) <= reinstate


def trigger_of(action: str) -> str | None:
    """The machine trigger a spec action fires: a path state's action is `step`; Reinstate and Drain
    are `reinstate` and `drain`. Any other action must leave the machine state alone."""
    if action in sm.PATH_STATES:
        return "step"
    triggers = {row["trigger"] for row in sm.TRANSITIONS}
    return action.lower() if action.lower() in triggers else None


def spec_edges(dot: str) -> set[tuple[str, str, str]]:
    """(trigger, source, dest) for every edge of a TLC state graph that fires or changes the machine."""
    state = dict(_NODE.findall(dot))
    edges = set()
    for src, dst, action in _EDGE.findall(dot):
        trigger = trigger_of(action)
        if trigger is not None or state[src] != state[dst]:
            edges.add((trigger or f"<{action}>", state[src], state[dst]))
    return edges


def test_spec_state_graph_has_exactly_the_transition_tables_edges(model_results):
    assert len(MACHINE_MODELS) == 4, "the relay off and on, a host-side drafter, a drafter on the device"
    spec = set()
    for model in MACHINE_MODELS:
        result = model_results[model["config"]]
        assert result.outcome == "pass", result.errors()
        dot = result.dot_path.read_text()
        assert len(_NODE.findall(dot)) == result.distinct_states
        spec |= spec_edges(dot)
    table = table_edges()
    assert not spec - table, f"the spec takes transitions the table lacks: {sorted(spec - table)}"
    assert not table - spec, f"the table has transitions the spec never takes: {sorted(table - spec)}"


# -- Decide and NextRowOrder against the Python functions -------------------------------------------


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


# StepObservation's fields only `launch` reads (StructuredOutput.tla's MaskWaits), not AsyncScheduling's Decide.
LAUNCH_FIELDS = ("masked_req_ids", "pending_sampled_req_ids")


def decide_cases(rng: random.Random) -> list[dict]:
    """Observations covering every combination of the table's conditions, plus random ones."""
    base = ("a", "b", "c")
    currs = {"same": base, "reordered": ("c", "a", "b"), "fewer": ("a", "b"), "other": ("a", "b", "d")}
    observations = [
        sm.StepObservation(False, (), base, True, (), "", (4,), "torch.int32", relay, host_drafter=host)
        for relay in (False, True)
        for host in (False, True)
    ]
    dtypes = ("torch.int32", "torch.int64")

    def pending(curr, all_decode, input_shape, input_dtype, relay, **more) -> sm.StepObservation:
        """A step after the pending one of rows `base`, a future of shape (4,)."""
        return sm.StepObservation(
            True, base, curr, all_decode, (4,), "torch.int32", input_shape, input_dtype, relay, **more
        )

    for curr, all_decode, input_shape, input_dtype, relay, host in itertools.product(
        currs.values(), (True, False), ((4,), (8,), (3, 16)), dtypes, (False, True), (False, True)
    ):
        observations.append(pending(curr, all_decode, input_shape, input_dtype, relay, host_drafter=host))
    # A drafted future (the drafter on the device; host_drafter is tried first, above): (all_decode,
    # all_spec) one-token rows, rows that verify drafts, a mixture; it fits by its row count, so
    # (4, 16), four rows verifying drafts, fits, and (3, 16) does not.
    kinds = ((True, False), (False, True), (False, False))
    for curr, (all_decode, all_spec), input_shape, input_dtype, relay in itertools.product(
        currs.values(), kinds, ((4,), (8,), (3, 16), (4, 16)), dtypes, (False, True)
    ):
        observations.append(
            pending(curr, all_decode, input_shape, input_dtype, relay, pending_drafted=True, all_spec=all_spec)
        )
    ids = "abcd"
    for _ in range(300):
        prev = tuple(rng.sample(ids, rng.randint(0, 4)))
        curr = tuple(rng.sample(ids, rng.randint(0, 4)))
        has_pending = rng.random() < 0.9
        observations.append(
            sm.StepObservation(
                has_pending,
                prev if has_pending else (),
                curr,
                rng.random() < 0.7,
                rng.choice([(1,), (2,), (4,)]) if has_pending else (),
                "torch.int32" if has_pending else "",
                rng.choice([(1,), (2,), (4,), (2, 8), (4, 8)]),
                rng.choice(["torch.int32", "torch.int32", "torch.int64"]),
                rng.random() < 0.5,
                host_drafter=rng.random() < 0.2,
                pending_drafted=has_pending and rng.random() < 0.4,
                all_spec=rng.random() < 0.3,
            )
        )
    return [
        {
            "obs": {camel(k): v for k, v in dataclasses.asdict(o).items() if k not in LAUNCH_FIELDS},
            "expect": sm.decide(o),
        }
        for o in observations
    ]


def row_order_cases(rng: random.Random) -> list[dict]:
    cases = []
    for rows in permutations("abcd", 4):  # every removal from a full batch of four
        for mask in range(16):
            removed = {r for i, r in enumerate(rows) if mask >> i & 1}
            cases.append((list(rows), removed, []))
    for _ in range(300):
        rows = rng.sample("abcdefgh", rng.randint(0, 8))
        removed = set(rng.sample(rows, rng.randint(0, len(rows))))
        cases.append((rows, removed, rng.sample("uvwxyz", rng.randint(0, 4))))
    return [
        {"rows": rows, "removed": removed, "added": added, "expect": next_row_order(rows, frozenset(removed), added)}
        for rows, removed, added in cases
    ]


CASES_MODULE = """---- MODULE CrossCheckCases ----
\\* Generated by model_check/test_cross_check.py: Python's answers, checked against the spec.
EXTENDS MCAsyncScheduling
ASSUME MachineStates = {states} /\\ PathStates = {paths} /\\ AsyncStates = {async_states}
DecideCases == {decide}
RowOrderCases == {rows}
DecideMismatches == {{c \\in Range(DecideCases) : Decide(c.obs) # c.expect}}
RowOrderMismatches == {{c \\in Range(RowOrderCases) : NextRowOrder(c.rows, c.removed, c.added) # c.expect}}
Report(name, S) == PrintT(<<"mismatch", name, Cardinality(S), "cases, e.g.", CHOOSE c \\in S : TRUE>>)
ASSUME DecideMismatches = {{}} \\/ (Report("Decide", DecideMismatches) /\\ FALSE)
ASSUME RowOrderMismatches = {{}} \\/ (Report("NextRowOrder", RowOrderMismatches) /\\ FALSE)
====
"""


def run_assumes(module: str, text: str, spec_dir: Path) -> TlcResult:
    """Run a generated module of ASSUMEs over MCAsyncScheduling, with the implementation's guards
    (MCMachine's constants); TLC evaluates the ASSUMEs and model checks nothing."""
    shutil.copy(SPEC_DIR / "AsyncScheduling.tla", spec_dir)
    shutil.copy(SPEC_DIR / "MCAsyncScheduling.tla", spec_dir)
    (spec_dir / f"{module}.tla").write_text(text)
    constants = (SPEC_DIR / MACHINE_MODELS[0]["config"]).read_text().split("SPECIFICATION")[0]
    (spec_dir / f"{module}.cfg").write_text(constants + "INIT NoInit\nNEXT Next\n")
    result = run_tlc(module, f"{module}.cfg", spec_dir=spec_dir)
    assert result.exit_code == 0, "\n".join([*result.printed, result.errors()])
    assert result.distinct_states == 0  # nothing was model checked: the ASSUMEs are the test
    return result


def test_spec_decide_and_row_order_give_what_the_python_functions_give(tlc_available, tmp_path):
    rng = random.Random(4)
    decide, rows = decide_cases(rng), row_order_cases(rng)
    assert {c["expect"] for c in decide} == set(sm.PATH_STATES)  # every outcome is exercised
    result = run_assumes(
        "CrossCheckCases",
        CASES_MODULE.format(
            states=tla(set(sm.STATES)),
            paths=tla(set(sm.PATH_STATES)),
            async_states=tla(set(sm.ASYNC_STATES)),
            decide=tla(decide),
            rows=tla(rows),
        ),
        tmp_path,
    )
    assert not any("mismatch" in line for line in result.printed), "\n".join(result.printed)


# -- Each path state's plan against the spec's -------------------------------------------------------

PLANS_MODULE = """---- MODULE CrossCheckPlans ----
\\* Generated by model_check/test_cross_check.py: the spec's plan of every path state, printed.
EXTENDS MCAsyncScheduling
ASSUME \\A p \\in PathStates : PrintT(<<"plan", p, Materializes(p, TRUE), Materializes(p, FALSE), InputSource(p)>>)
====
"""
_PLAN = re.compile(r'^<<"plan", "(\w+)", (TRUE|FALSE), (TRUE|FALSE), "(\w+)">>$')


def spec_plans(printed: list[str]) -> dict[str, tuple[bool, str]]:
    """(materialize first, input source) per path state, from the spec's `Materializes` (for an
    all-decode step and for one that is not: the table's plan cannot depend on it) and `InputSource`."""
    plans = {}
    for line in printed:
        if m := _PLAN.match(line.strip()):
            state, all_decode, not_all_decode, source = m.groups()
            assert all_decode == not_all_decode, f"the spec's Materializes({state}, _) depends on allDecode"
            plans[state] = (all_decode == "TRUE", source)
    return plans


def test_spec_plan_of_every_path_state_is_the_tables(tlc_available, tmp_path):
    result = run_assumes("CrossCheckPlans", PLANS_MODULE, tmp_path)
    spec = spec_plans(result.printed)
    assert set(spec) == set(sm.PATH_STATES), "\n".join(result.printed)
    table = {state: (plan.materialize_first, plan.input_source.value) for state, plan in sm.PLANS.items()}
    differ = {s: {"spec": spec[s], "table": table.get(s)} for s in spec if spec[s] != table.get(s)}
    assert not differ, f"(materialize first, input source) differ between spec and PLANS: {differ}"
