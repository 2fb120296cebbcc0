"""Every TLC model in spec/manifest.json gives its expected result and its distinct-state count.

Passing models must pass; must-fail models (the implementation with one guard removed) must fail on
the invariant that guards it. Each spec (AsyncScheduling.tla, StructuredOutput.tla, SpecDecode.tla) is
checked on its own: its models share the module MC<Spec>, whose reference model MC<Spec>.cfg has every guard.
A parse error, an unexpected pass or an unexpected failure fails here.
"""

from __future__ import annotations

import re

import pytest
from tlc import EXIT_PARSE, SPEC_DIR, manifest_models

MODELS = manifest_models()
# Each spec's models share a module MC<Spec>, whose reference model MC<Spec>.cfg has every guard.
MODULES = sorted({m["module"] for m in MODELS})


def reference_config(module: str) -> str:
    return f"{module}.cfg"


def spec_file(module: str) -> str:
    return module.removeprefix("MC") + ".tla"


def models_of(module: str) -> list[dict]:
    return [m for m in MODELS if m["module"] == module]


def constants(config: str) -> dict[str, str]:
    text = (SPEC_DIR / config).read_text()
    block = text.split("CONSTANTS", 1)[1].split("SPECIFICATION", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*(\w+)\s*(?:=|<-)\s*(.+)$", block, re.M)}


def spec_guards(module: str = "MCAsyncScheduling") -> list[str]:
    """The constants a spec declares after "The guards." (the implementation has them all)."""
    spec = (SPEC_DIR / spec_file(module)).read_text()
    block = spec.split("\\* The guards.", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\s+(\w+),?\s+\\\*", block, re.M)


@pytest.mark.parametrize("entry", MODELS, ids=[m["config"] for m in MODELS])
def test_model_gives_its_expected_result_and_state_count(entry, model_results):
    result = model_results[entry["config"]]
    assert result.exit_code not in EXIT_PARSE, f"TLC could not parse the model:\n{result.errors()}"
    assert result.outcome == entry["expect"], (
        f"{entry['config']}: expected {entry['expect']}, TLC reported {result.outcome}\n{result.errors()}"
    )
    # A liveness violation may be found by a periodic check before the graph is complete: at most.
    found = result.distinct_states or 0
    assert found == entry["distinct_states"] or (entry["expect"] == "liveness" and found <= entry["distinct_states"]), (
        f"{entry['config']}: {result.distinct_states} distinct states, manifest says {entry['distinct_states']}"
    )


def test_manifest_lists_every_model_config():
    configs = {p.name for p in SPEC_DIR.glob("MC*.cfg")}
    assert configs == {m["config"] for m in MODELS}


@pytest.mark.parametrize("module", MODULES)
def test_each_must_fail_model_drops_exactly_one_guard_of_the_reference_model(module):
    guards = spec_guards(module)
    assert len(guards) >= (7 if module == "MCAsyncScheduling" else 3), guards
    reference_cfg = reference_config(module)
    reference = constants(reference_cfg)
    assert all(reference[g] == "TRUE" for g in guards), "the reference model must have every guard"
    passing = {m["config"] for m in models_of(module) if m["expect"] == "pass"}
    dropped = set()
    for entry in models_of(module):
        if entry.get("witness"):
            continue  # test_each_witness_model_keeps_every_guard_and_changes_only_bounds
        if entry.get("fairness"):
            continue  # test_the_fairness_must_fail_model_drops_only_its_fairness
        if entry["expect"] == "pass":
            assert all(constants(entry["config"])[g] == "TRUE" for g in guards), entry["config"]
            continue
        base = constants(entry.get("base", reference_cfg))  # a passing model: every guard in place
        assert entry.get("base", reference_cfg) in passing, entry
        diff = {k for k, v in constants(entry["config"]).items() if base.get(k) != v}
        assert len(diff) == 1 and diff <= set(guards), f"{entry['config']} differs in {diff}"
        assert entry["guard"] in diff, entry
        dropped |= diff
    assert dropped == set(guards), f"no must-fail model drops {set(guards) - dropped}"


@pytest.mark.parametrize("module", MODULES)
def test_every_safety_invariant_is_shown_to_fail_by_some_model(module):
    spec = (SPEC_DIR / spec_file(module)).read_text()
    invariants = set(re.findall(r"^(\w+Inv) ==", spec, re.M))
    expected_failures = {m["expect"] for m in models_of(module) if not m.get("witness") and not m.get("fairness")}
    assert invariants == expected_failures - {"pass", "deadlock"}, "each invariant needs a model that breaks it"
    if module == "MCAsyncScheduling":
        assert "deadlock" in expected_failures


# What a witness model may change: how long outputs are, who may be aborted or stop on EOS, whether
# programs fail, the relay switch, which engine core drives the worker, a drafter on the host or on
# the device, who samples under a grammar. Never a guard: a witness shows what the implementation reaches.
WITNESS_BOUNDS = {
    "MCAsyncScheduling": {
        "MaxTokens",
        "MayAbort",
        "MayStop",
        "AllowFailure",
        "AsyncRelay",
        "EngineCore",
        "HostDrafter",
        "DeviceDrafter",
        "Constrained",
    },
    "MCStructuredOutput": {"MaxTokens", "MayStop"},
    "MCSpecDecode": {"MaxTokens", "Room", "MayStop", "MayAbort", "Late"},
}


def invariants_of(config: str) -> list[str]:
    return (SPEC_DIR / config).read_text().split("INVARIANTS", 1)[1].split()


def test_every_spec_has_witness_bounds():
    assert set(MODULES) == set(WITNESS_BOUNDS)


@pytest.mark.parametrize("module", MODULES)
def test_each_witness_model_keeps_every_guard_and_changes_only_bounds(module):
    guards = spec_guards(module)
    reference = constants(reference_config(module))
    safety = invariants_of(reference_config(module))  # the reference model checks every safety invariant
    for entry in (m for m in models_of(module) if m.get("witness")):
        mine = constants(entry["config"])
        assert all(mine[g] == "TRUE" for g in guards), entry["config"]
        diff = {k for k in mine.keys() | reference.keys() if mine.get(k) != reference.get(k)}
        assert diff <= WITNESS_BOUNDS[module], f"{entry['config']} changes {diff - WITNESS_BOUNDS[module]}"
        # the safety invariants are checked on every state explored before the witness is found
        assert invariants_of(entry["config"]) == [*safety, entry["expect"]], entry["config"]


@pytest.mark.parametrize("module", MODULES)
def test_every_reachability_claim_has_a_witness_that_violates_it(module):
    spec = (SPEC_DIR / spec_file(module)).read_text()
    claims = set(re.findall(r"^(\w+Unreached) ==", spec, re.M))
    witnessed = {m["expect"] for m in models_of(module) if m.get("witness")}
    assert len(claims) >= (6 if module == "MCAsyncScheduling" else 3) and claims == witnessed, (claims, witnessed)


def test_the_fairness_must_fail_model_drops_only_its_fairness():
    """A liveness must-fail keeps its base's constants and drops one fairness condition of its spec."""
    entries = [m for m in MODELS if m.get("fairness")]
    assert entries, "no model shows that request liveness needs the output thread's fairness"
    for entry in entries:
        spec = (SPEC_DIR / spec_file(entry["module"])).read_text()
        assert entry["expect"] == "liveness", entry
        assert constants(entry["config"]) == constants(entry["base"]), entry["config"]
        spec_of = {
            c: re.search(r"^SPECIFICATION (\w+)", (SPEC_DIR / c).read_text(), re.M).group(1)
            for c in (entry["config"], entry["base"])
        }
        base_spec = re.search(rf"^{spec_of[entry['base']]} ==(.*?)\n\n", spec, re.M | re.S).group(1)
        weak_spec = re.search(rf"^{spec_of[entry['config']]} ==(.*?)\n\n", spec, re.M | re.S).group(1)
        assert entry["fairness"] in base_spec and entry["fairness"] not in weak_spec, (base_spec, weak_spec)
