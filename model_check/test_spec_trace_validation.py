"""Traces of real speculative runs (n-gram) are behaviours of SpecDecode.tla; a broken engine's are not.

One small workload, async, on the emulated device process (tiny-llama's random weights: drafts
copied from the prompts are accepted in part, often rejected): greedy and sampled requests, one that
reaches `max_model_len` (its speculation turns off for good). Its `--trace` is replayed by TLC with
`TraceSpecDecode` (model_check/spec_trace_check.py).

A run with a drafter on the device (draft_model) takes the machine's SpecSteady and SpecExit rows:
its trace is replayed against AsyncScheduling.tla (`TraceAsyncScheduling`, model_check/trace_check.py,
one abstract token per row) and against SpecDecode.tla (its runs; a late admission), and must be
accepted by both; with a SpecExit row reading a draft's column, by neither.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from spec_trace_check import check_spec_trace, spec_records
from support.mutants import mutant_env, mutant_package
from support.processes import config_flags, generate_argv
from trace_check import check_trace, read_trace, traced_machine_run

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint, write_noisy_copy
from neuron_async_sm.worker import async_machine as sm

SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3}'
ENGINE = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=64,
    max_num_batched_tokens=64,  # every prompt in the first step, every spec row after it
    prefill_buckets=(16, 32, 64),
    decode_buckets=(1, 2, 4),
    speculative_config=SPECULATIVE,
)
# (prompt, sampling parameters): prompts that repeat, so n-gram drafts from the first decode on
WORKLOAD = [
    ([11, 12, 13, 14, 11, 12, 13, 14, 11, 12], dict(max_tokens=40)),
    ([21, 22, 23, 21, 22, 23, 21], dict(max_tokens=90)),  # capped by max_model_len: speculation turns off
    ([31, 32, 33, 34, 35, 31, 32, 33], dict(max_tokens=25, temperature=1.0, seed=7)),  # sampled: rejections
    ([41, 42, 41, 42, 41], dict(max_tokens=13, temperature=1.5, seed=3)),
]

# The mutant: an output row keeps the drafts after its run's last token instead of -1 (the spec's
# TrimToAccepted dropped, MCRejectedDraftsInOutput), so rejected drafts reach the request's output.
REJECTED_DRAFTS_IN_OUTPUT = (
    "model/spec_decode.py",
    "torch.where(col == accepted, last, -1))",
    "torch.where(col == accepted, last, draft))  # MUTANT: rejected drafts kept",
)


@pytest.fixture(scope="module")
def recorded(tlc_available, tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("spec-trace") / "spec.ndjson"
    with LLM("tiny-llama", async_scheduling=True, trace_path=str(path), **ENGINE) as llm:
        for i, (prompt, params) in enumerate(WORKLOAD):
            llm.add_request(prompt, SamplingParams(ignore_eos=True, **params), f"r{i}")
        while llm.has_unfinished_requests():
            llm.step()
    return read_trace(path)


def test_trace_of_a_speculative_run_is_a_behaviour_of_spec_decode(recorded):
    verdict = check_spec_trace(recorded)
    print(f"speculative run: {verdict.describe()}")
    assert verdict.accepted, verdict.describe()


def test_the_speculative_trace_covers_accepted_and_rejected_drafts_length_and_speculation_off(recorded):
    """The run checked above is not vacuous: every step with a pending future is a HostDraftBreak, rows
    accept drafts and reject some (a rejection before the last draft too, which the mutant below
    needs), requests end by length, and one turns speculation off near max_model_len (plain rows
    after spec rows)."""
    steps = [e["state"] for e in recorded if e["event"] == "step"]
    assert steps[0] == sm.NO_PENDING_FUTURE and set(steps[1:]) == {sm.HOST_DRAFT_BREAK}, Counter(steps)
    records, _ = spec_records(recorded)
    launches = [r for r in records if r["event"] == "Launch"]
    proposed = {e["step"]: e["proposed"] for e in recorded if e["event"] == "reinstate"}
    rows = [(a, len(d)) for r in launches for a, d in zip(r["acc"], proposed[r["step"]], strict=True) if d]
    assert any(a > 0 for a, _ in rows) and any(a < n - 1 for a, n in rows), rows
    reasons = Counter(reason for e in recorded if e["event"] == "AdvanceStep" for _, reason in e["finished"])
    assert reasons == {"length": len(WORKLOAD)}, reasons
    drafts = [dict(zip(r["req_ids"], r["drafts"], strict=True)) for r in launches]
    r1 = [d["r1"] for d in drafts if "r1" in d]
    assert 3 in r1 and r1[-1] == 0 and r1.index(0, r1.index(3)) > 0, r1  # spec rows, then plain for good


def test_the_plain_trace_checker_refuses_a_speculative_trace_by_name(recorded):
    """TraceAsyncScheduling's steps sample one token per row: a speculative trace is pointed elsewhere."""
    with pytest.raises(ValueError, match="speculative run: check it with model_check/spec_trace_check.py"):
        check_trace(recorded)


def test_a_trace_with_a_rejected_draft_in_an_output_fails_accepted_once(recorded):
    """A row's output holding a draft its run rejected, handed to the client, breaks AcceptedOnceInv."""
    proposed = {e["step"]: e["proposed"] for e in recorded if e["event"] == "reinstate"}
    finished = {e["step"]: {r for r, _ in e["finished"]} for e in recorded if e["event"] == "AdvanceStep"}
    wrong = [dict(e) for e in recorded]
    for i, e in enumerate(wrong):  # noqa: B007 (i and k: the row changed below)
        if e["event"] != "Materialize":
            continue
        rows = zip(e["req_ids"], e["runs"], proposed[e["step"]], strict=True)
        for k, (req_id, run, drafts) in enumerate(rows):  # noqa: B007
            a = len(run) - 1
            if a < len(drafts) and req_id not in finished[e["step"]]:
                break
        else:
            continue
        break
    else:
        pytest.fail("no row rejected a draft")
    wrong[i] = {**e, "runs": [list(run) for run in e["runs"]]}
    wrong[i]["runs"][k].append(drafts[a])  # the rejected draft, after the run
    j = next(j for j, x in enumerate(wrong) if x["event"] == "AdvanceStep" and x["step"] == e["step"])
    counts = list(wrong[j]["counts"])
    counts[wrong[j]["delivered"].index(req_id)] += 1  # the client got it
    wrong[j] = {**wrong[j], "counts": counts}
    verdict = check_spec_trace(wrong)
    print(verdict.describe())
    assert verdict.violated_invariant == "AcceptedOnceInv", verdict.describe()
    assert verdict.rejected_event["event"] == "AdvanceStep" and verdict.rejected_event["step"] == e["step"]


def test_trace_of_an_engine_that_keeps_rejected_drafts_in_its_output_is_rejected(tlc_available, tmp_path):
    """The mutant run for real, through the CLI: rejected drafts reach the output (and the history the
    next row starts from). Its trace fails SpecDecode's invariants."""
    root = mutant_package(tmp_path, *REJECTED_DRAFTS_IN_OUTPUT)
    prompts, trace = tmp_path / "in.jsonl", tmp_path / "trace.ndjson"
    lines = [
        {"request_id": f"r{i}", "prompt_token_ids": prompt, "ignore_eos": True, **params}
        for i, (prompt, params) in enumerate(WORKLOAD)
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    flags = ["--trace", trace, "--no-progress", *config_flags(async_scheduling=True, **ENGINE)]
    argv = generate_argv(prompts, tmp_path / "out.jsonl", *flags)
    proc = subprocess.run(argv, cwd=tmp_path, env=mutant_env(root), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = check_spec_trace(read_trace(Path(trace)))
    print(f"mutant: {verdict.describe()}")
    assert verdict.violated_invariant in ("NextInputInv", "AcceptedOnceInv"), verdict.describe()


# -- a drafter on the device: the machine's SpecSteady and SpecExit rows, against AsyncScheduling.tla --

DRAFT_ENGINE = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=40,
    max_num_batched_tokens=32,
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4),
)
SAME = [5, 17, 3, 99, 42, 8, 11, 6]
# Three requests of one prompt advance in lockstep and turn speculation off at the same step (SpecExit
# after it); one stops by max_tokens inside a run (a composition change), and one waits for its slot,
# is admitted late, and stops inside a run with its next row in flight (discarded).
DRAFT_WORKLOAD = [(SAME, 100), (SAME, 100), (SAME, 100), ([7, 300, 1], 6), ([64, 2, 9, 9, 13], 5)]


@pytest.fixture(scope="module")
def drafted(tlc_available, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("draft-model-trace")
    target = write_checkpoint(root / "target", layer_scale=0.02)
    draft = write_noisy_copy(target, root / "draft", 0.15)  # about six drafts in ten accepted
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    path = root / "draft.ndjson"
    with LLM(str(target), async_scheduling=True, speculative_config=spec, trace_path=str(path), **DRAFT_ENGINE) as llm:
        for i, (prompt, max_tokens) in enumerate(DRAFT_WORKLOAD):
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), f"r{i}")
        while llm.has_unfinished_requests():
            llm.step()
    return read_trace(path)


def test_trace_of_a_draft_model_run_is_a_behaviour_of_async_scheduling(drafted):
    """Not vacuous: SpecSteady and SpecExit steps, CPU-built rows after a composition change (their
    ids at the real position of each row's last accepted token), runs that reject drafts, and a
    request whose row in flight is discarded after its stop."""
    steps = Counter(e["state"] for e in drafted if e["event"] == "step")
    assert steps[sm.SPEC_STEADY] and steps[sm.SPEC_EXIT] and steps[sm.COMPOSITION_BREAK], steps
    hosts = [x for e in drafted if e["event"] == "reinstate" for x in e["inputs"] if x[0] == "host"]
    runs = [len(run) for e in drafted if e["event"] == "Materialize" for run in e["runs"]]
    assert hosts and 1 < max(runs) and min(runs) == 1, (hosts, Counter(runs))
    finished = {r: e["step"] for e in drafted if e["event"] == "AdvanceStep" for r, _ in e["finished"]}
    late = [e["step"] for e in drafted if e["event"] == "Materialize" for r in e["req_ids"] if e["step"] > finished[r]]
    assert late, finished
    verdict = check_trace(drafted)
    print(f"draft_model run: {verdict.describe()}")
    assert verdict.accepted, verdict.describe()
    runs = check_spec_trace(drafted)  # and its runs against SpecDecode.tla
    print(f"draft_model run, SpecDecode: {runs.describe()}")
    assert runs.accepted, runs.describe()


def test_a_draft_model_trace_whose_spec_exit_row_reads_a_draft_is_rejected(drafted):
    """A SpecExit row that read next_input's last column, a draft, instead of its first (the production
    runner's garbage token; the spec's MCExitReadsDraft) computes on another token than its own."""
    exits = {e["step"] for e in drafted if e["event"] == "step" and e["state"] == sm.SPEC_EXIT}
    i = next(i for i, e in enumerate(drafted) if e["event"] == "reinstate" and e["step"] in exits)
    wrong = [dict(e) for e in drafted]
    wrong[i]["inputs"] = [list(x) for x in wrong[i]["inputs"]]
    wrong[i]["inputs"][0] = [*wrong[i]["inputs"][0], 3]  # ["future", row, column 3]: the last draft
    verdict = check_trace(wrong)
    print(verdict.describe())
    assert verdict.violated_invariant == "TokenOwnershipInv", verdict.describe()
    assert verdict.rejected_event == wrong[i], verdict.describe()
    runs = check_spec_trace(wrong)  # SpecDecode.tla: the row's first input is not its last accepted token
    print(runs.describe())
    assert runs.violated_invariant == "NextInputInv", runs.describe()


DRAFT_EXAMPLES = 10  # the stateful engine's draft_model machine, its one engine traced
DRAFT_STEPS = 10


def test_traces_of_hypothesis_draft_model_examples_are_behaviours_of_async_scheduling(tlc_available, tmp_path):
    """tests/test_stateful_engine.py's draft_model machine (in process, the target drafting for itself:
    rows keep to the device's SpecSteady and SpecExit while the batch keeps its rows), traced for a
    few examples: admissions, aborts and finishes around drafted futures. Each trace is accepted."""
    import test_stateful_engine as stateful

    traces = traced_machine_run(stateful, stateful.EngineWithDraftModel, DRAFT_EXAMPLES, DRAFT_STEPS, tmp_path)
    assert traces, "no engine wrote a trace"
    events = [read_trace(path) for path in traces]
    steps = Counter(e["state"] for trace in events for e in trace if e["event"] == "step")
    assert steps[sm.SPEC_STEADY], steps
    for path, trace in zip(traces, events, strict=True):
        verdict = check_trace(trace, timeout_s=600)
        print(f"{path.name}: {verdict.describe()} {dict(steps)}")
        assert verdict.accepted, f"{path.name}: {verdict.describe()}"


# -- a drafter on the device and grammars: drafts cut on the host, a masked request one step at a time --


@pytest.fixture(scope="module")
def constrained_drafted(tlc_available, tmp_path_factory) -> list[dict]:
    """Two masked requests and an unmasked one under draft_model: the masked ones sit out every step
    after each of their own, their drafts are cut by their grammars, and the last one left alone
    defers its whole spec program for its mask (SampleDeferred after its own step, applied)."""
    pytest.importorskip("llguidance")
    from support.grammar_model import CONSTRAINTS, write_json_model  # noqa: PLC0415 (the grammar model's deps)

    root = tmp_path_factory.mktemp("constrained-draft-trace")
    target = write_json_model(root / "target")
    draft = write_noisy_copy(target, root / "draft", 0.01)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    path = root / "constrained.ndjson"
    engine = dict(device="cpu-inprocess", max_model_len=160, max_num_seqs=4, decode_buckets=(1, 2, 4))
    loose = {"regex": "[^\\n{}]{8,20}"}  # most of the model's tokens fit: drafts kept, some accepted
    with LLM(str(target), async_scheduling=True, speculative_config=spec, trace_path=str(path), **engine) as llm:
        llm.add_request([1, 5, 6], SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=loose), "m0")
        llm.add_request([1, 7, 8, 9], SamplingParams(max_tokens=12, temperature=0.0), "u0")
        llm.add_request(
            [1, 9], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=CONSTRAINTS[2].params), "m1"
        )
        while llm.has_unfinished_requests():
            llm.step()
    return read_trace(path)


def test_trace_of_a_draft_model_run_with_grammars_is_a_behaviour_of_async_scheduling(constrained_drafted):
    """Not vacuous: a masked request left out of a step while it runs, rows whose drafts a grammar cut
    (fewer than k), spec steps that defer for their mask and ones that build it at launch. A mask one
    run behind (from the grammar before the row's previous run) fails FreshMaskInv."""
    events = constrained_drafted
    steps = [e for e in events if e["event"] == "step"]
    assert any("m0" not in e["req_ids"] and "u0" in e["req_ids"] for e in steps), "m0 never sat out"
    cut = [d for e in steps for r, d in zip(e["req_ids"], e["drafts"], strict=True) if r != "u0" and d < 3]
    launches = Counter(e["state"] for e in events if e["event"] == "launch")
    assert cut and launches[sm.SAMPLE_DEFERRED] and launches[sm.SAMPLE_IN_PROGRAM], (cut, launches)
    verdict = check_trace(events)
    print(f"draft_model run with grammars ({dict(launches)}): {verdict.describe()}")
    assert verdict.accepted, verdict.describe()

    # The last mask built from the grammar one run behind: the grammar before the request's previous run.
    i = max(i for i, e in enumerate(events) if e["event"] == "mask" and e["masks"][0][1] > 1)
    req_id, grammar, index = events[i]["masks"][0]
    runs = [
        len(run)
        for e in events[:i]
        if e["event"] == "Materialize"
        for r, run in zip(e["req_ids"], e["runs"], strict=True)
        if r == req_id
    ]
    wrong = [dict(e) for e in events]
    wrong[i]["masks"] = [[req_id, grammar - runs[-1], index]]
    verdict = check_trace(wrong)
    print(f"stale mask: {verdict.describe()}")
    assert verdict.violated_invariant == "FreshMaskInv", verdict.describe()
    assert verdict.rejected_event == wrong[i], verdict.describe()
