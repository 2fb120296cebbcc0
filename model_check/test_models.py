"""Every TLC model in spec/manifest.json gives its expected result and its distinct-state count.

Passing models must pass; must-fail models (the implementation with one guard removed) must fail on
the invariant that guards it. A parse error, an unexpected pass or an unexpected failure fails here.
"""

from __future__ import annotations

import re

import pytest
from tlc import EXIT_PARSE, SPEC_DIR, manifest_models

MODELS = manifest_models()
REFERENCE_CONFIG = "MCAsyncScheduling.cfg"


def constants(config: str) -> dict[str, str]:
    text = (SPEC_DIR / config).read_text()
    block = text.split("CONSTANTS", 1)[1].split("SPECIFICATION", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*(\w+)\s*(?:=|<-)\s*(.+)$", block, re.M)}


def spec_guards() -> list[str]:
    """The constants AsyncScheduling.tla declares after "The guards." (the implementation has them all)."""
    spec = (SPEC_DIR / "AsyncScheduling.tla").read_text()
    block = spec.split("\\* The guards.", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\s+(\w+),?\s+\\\*", block, re.M)


GUARDS = spec_guards()


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


def test_each_must_fail_model_drops_exactly_one_guard_of_the_reference_model():
    assert len(GUARDS) >= 7, GUARDS
    reference = constants(REFERENCE_CONFIG)
    assert all(reference[g] == "TRUE" for g in GUARDS), "the reference model must have every guard"
    dropped = set()
    for entry in MODELS:
        if entry.get("witness"):
            continue  # test_each_witness_model_keeps_every_guard_and_changes_only_bounds
        if entry.get("fairness"):
            continue  # test_the_fairness_must_fail_model_drops_only_its_fairness
        if entry["expect"] == "pass":
            assert all(constants(entry["config"])[g] == "TRUE" for g in GUARDS), entry["config"]
            continue
        base = constants(entry.get("base", REFERENCE_CONFIG))  # a passing model: every guard in place
        assert entry.get("base", REFERENCE_CONFIG) in {m["config"] for m in MODELS if m["expect"] == "pass"}, entry
        diff = {k for k, v in constants(entry["config"]).items() if base.get(k) != v}
        assert len(diff) == 1 and diff <= set(GUARDS), f"{entry['config']} differs in {diff}"
        assert entry["guard"] in diff, entry
        dropped |= diff
    assert dropped == set(GUARDS), f"no must-fail model drops {set(GUARDS) - dropped}"


def test_every_safety_invariant_is_shown_to_fail_by_some_model():
    spec = (SPEC_DIR / "AsyncScheduling.tla").read_text()
    invariants = set(re.findall(r"^(\w+Inv) ==", spec, re.M))
    expected_failures = {m["expect"] for m in MODELS if not m.get("witness") and not m.get("fairness")}
    assert invariants == expected_failures - {"pass", "deadlock"}, "each invariant needs a model that breaks it"
    assert "deadlock" in expected_failures


# What a witness model may change: how long outputs are, who may be aborted or stop on EOS, whether
# programs fail, the relay switch. Never a guard: a witness shows what the implementation reaches.
WITNESS_BOUNDS = {"MaxTokens", "MayAbort", "MayStop", "AllowFailure", "AsyncRelay"}
SAFETY = [
    "TypeOK",
    "ExactlyOnceMaterializationInv",
    "TokenOwnershipInv",
    "NoStaleInputInv",
    "CounterInv",
    "PipelineDepthInv",
]


def invariants_of(config: str) -> list[str]:
    return (SPEC_DIR / config).read_text().split("INVARIANTS", 1)[1].split()


def test_each_witness_model_keeps_every_guard_and_changes_only_bounds():
    reference = constants(REFERENCE_CONFIG)
    for entry in (m for m in MODELS if m.get("witness")):
        mine = constants(entry["config"])
        assert all(mine[g] == "TRUE" for g in GUARDS), entry["config"]
        diff = {k for k in mine.keys() | reference.keys() if mine.get(k) != reference.get(k)}
        assert diff <= WITNESS_BOUNDS, f"{entry['config']} changes {diff - WITNESS_BOUNDS}"
        # the safety invariants are checked on every state explored before the witness is found
        assert invariants_of(entry["config"]) == [*SAFETY, entry["expect"]], entry["config"]


def test_every_reachability_claim_has_a_witness_that_violates_it():
    spec = (SPEC_DIR / "AsyncScheduling.tla").read_text()
    claims = set(re.findall(r"^(\w+Unreached) ==", spec, re.M))
    witnessed = {m["expect"] for m in MODELS if m.get("witness")}
    assert len(claims) >= 6 and claims == witnessed, (claims, witnessed)


def test_the_fairness_must_fail_model_drops_only_its_fairness():
    """A liveness must-fail keeps its base's constants and drops one fairness condition of its spec."""
    spec = (SPEC_DIR / "AsyncScheduling.tla").read_text()
    entries = [m for m in MODELS if m.get("fairness")]
    assert entries, "no model shows that request liveness needs the output thread's fairness"
    for entry in entries:
        assert entry["expect"] == "liveness", entry
        assert constants(entry["config"]) == constants(entry["base"]), entry["config"]
        spec_of = {
            c: re.search(r"^SPECIFICATION (\w+)", (SPEC_DIR / c).read_text(), re.M).group(1)
            for c in (entry["config"], entry["base"])
        }
        base_spec = re.search(rf"^{spec_of[entry['base']]} ==(.*?)\n\n", spec, re.M | re.S).group(1)
        weak_spec = re.search(rf"^{spec_of[entry['config']]} ==(.*?)\n\n", spec, re.M | re.S).group(1)
        assert entry["fairness"] in base_spec and entry["fairness"] not in weak_spec, (base_spec, weak_spec)
