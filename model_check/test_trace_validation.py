"""Traces of the real engine are behaviours of the spec; a broken engine's trace is not.

The engine runs in async mode on the emulated device process, with seeded random workloads (arrivals,
stops, max_tokens, aborts, reorders). Its `--trace` output becomes a TLA+ module and TLC replays it
with `TraceAsyncScheduling`, reporting how many events it matched.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.faulty_runtime import faulty_runtime
from support.grammar_model import CONSTRAINTS, MAX_TOKENS, write_json_model
from support.mutants import (
    MASK_BEFORE_IN_FLIGHT_TOKEN,
    NO_GET_OUTPUT_LOCK,
    WRITE_BACK_BY_CURRENT_ROW,
    mutant_env,
    mutant_package,
)
from support.processes import config_flags, generate_argv
from support.workloads import drive, prompt_lines, random_workload
from tlc import PARALLEL_RUNS
from trace_check import (
    POISON_TOKEN,
    TraceVerdict,
    check_trace,
    engine_threads,
    logged_events,
    read_trace,
    traced_machine_run,
)

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.worker import async_machine as sm

ENGINE = dict(
    dtype="float64",
    max_num_seqs=8,
    max_model_len=128,
    max_num_batched_tokens=32,  # long prompts are chunked
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4, 8),
    device_time_ms=2,  # programs take a moment: both threads really wait on the same output
)
SEEDS = (5, 6, 9, 12, 13)  # relay off: together they reach every design path, stops, max_tokens and aborts
RELAY_SEEDS = (5, 9, 13)  # relay on (the default): Relay beside Steady
RECORDINGS = [(seed, False) for seed in SEEDS] + [(seed, True) for seed in RELAY_SEEDS]
RECORDING_IDS = [f"seed{seed}-{'relay' if relay else 'no-relay'}" for seed, relay in RECORDINGS]


def record(path: Path, seed: int, **overrides: object) -> tuple[list[dict], dict[str, str | None]]:
    """Run one seeded workload on a fresh engine; return its trace and the requests' finish reasons."""
    items = random_workload(random.Random(seed), f"s{seed}")
    with LLM("tiny-llama", async_scheduling=True, trace_path=str(path), **{**ENGINE, **overrides}) as llm:
        result = drive(llm, items)
    return read_trace(path), result.finish


Recorded = dict[tuple[int, bool], tuple[list[dict], dict[str, str | None]]]


@pytest.fixture(scope="module")
def recorded(tlc_available, tmp_path_factory) -> Recorded:
    folder = tmp_path_factory.mktemp("traces")
    return {
        (seed, relay): record(folder / f"{name}.ndjson", seed, async_relay=relay)
        for (seed, relay), name in zip(RECORDINGS, RECORDING_IDS, strict=True)
    }


@pytest.fixture(scope="module")
def verdicts(recorded) -> dict[tuple[int, bool], TraceVerdict]:
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        futures = {key: pool.submit(check_trace, events) for key, (events, _) in recorded.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("recording", RECORDINGS, ids=RECORDING_IDS)
def test_real_engine_trace_is_a_behaviour_of_the_spec(verdicts, recording):
    verdict = verdicts[recording]
    print(f"{recording}: {verdict.describe()} ({verdict.tlc.distinct_states} distinct states)")
    assert verdict.accepted, verdict.describe()


def test_recorded_traces_cover_every_path_both_threads_and_every_finish(recorded):
    paths, threads, finishes = Counter(), Counter(), Counter()
    for events, finish in recorded.values():
        paths.update(e["state"] for e in events if e["event"] == "step")
        threads.update(e["thread"] for e in events if e["event"] == "Materialize")
        finishes.update(finish.values())
    # HostDraftBreak, SpecSteady and SpecExit are speculation's rows: its traces are
    # test_spec_trace_validation's.
    assert set(paths) == set(sm.PATH_STATES) - {sm.HOST_DRAFT_BREAK, sm.SPEC_STEADY, sm.SPEC_EXIT}, paths
    engine, output = engine_threads(events)
    assert threads[engine] and threads[output], threads
    assert finishes["stop"] and finishes["length"] and finishes["abort"], finishes


def test_a_trace_with_a_wrong_decision_is_rejected_at_that_event(recorded):
    events, _ = recorded[SEEDS[0], False]
    i = next(i for i, e in enumerate(events) if e["event"] == "step" and e["state"] == sm.STEADY)
    wrong = [dict(e) for e in events]
    wrong[i]["state"] = sm.REORDER_REMAP
    if wrong[i + 1]["event"] == "reinstate":
        wrong[i + 1]["source"] = sm.REORDER_REMAP
    verdict = check_trace(wrong)
    assert not verdict.accepted
    assert verdict.rejected_event == wrong[i], verdict.describe()


def test_a_relay_whose_row_map_is_corrupted_is_rejected_at_that_step(recorded):
    """The engine logs the relay's row map with the step's reinstate. One row pointed at another row
    of the previous step (as a map by position would after condense()) is not a behaviour of the spec."""
    events, _ = recorded[RELAY_SEEDS[0], True]
    reinstates = [i for i, e in enumerate(events) if e["event"] == "reinstate"]
    for prev, i in zip(reinstates, reinstates[1:], strict=False):
        rows = events[prev]["req_ids"]
        if events[i]["source"] == sm.RELAY and len(rows) > 1 and max(events[i]["relay_from"]) >= 0:
            break
    else:
        pytest.fail("no Relay step read a previous step of two rows or more")
    wrong = [dict(e) for e in events]
    row_map = list(wrong[i]["relay_from"])
    k = next(k for k, j in enumerate(row_map) if j >= 0)
    row_map[k] = (row_map[k] + 1) % len(rows)  # another request's row of the previous step
    wrong[i]["relay_from"] = row_map
    verdict = check_trace(wrong)
    assert not verdict.accepted
    assert verdict.rejected_event == wrong[i], verdict.describe()


def _host_input(events: list[dict], *, start: int = 0) -> tuple[int, int]:
    """(event index, row) of the first CPU-built decode input of a reinstate (from index `start`) after
    its request's token was materialized: the row the corrupted traces below change."""
    for i, e in enumerate(events):
        if i >= start and e["event"] == "reinstate":
            for k, row in enumerate(e["inputs"]):
                if row[0] == "host" and row[1] != POISON_TOKEN:
                    return i, k
    raise AssertionError("no CPU-built decode input in the trace")


def test_a_trace_whose_input_is_another_requests_token_fails_token_ownership(recorded):
    """The engine logs each row's input id. A CPU-built id that is not the token materialized for
    this request at that position (a write-back to the wrong request shows up so) breaks ownership."""
    events, _ = recorded[SEEDS[0], False]
    i, k = _host_input(events)
    wrong = [dict(e) for e in events]
    others = [t for e in events if e["event"] == "Materialize" for t in e.get("tokens", [])]
    wrong[i]["inputs"] = [list(row) for row in events[i]["inputs"]]
    wrong[i]["inputs"][k][1] = next(t for t in others if t != events[i]["inputs"][k][1])
    verdict = check_trace(wrong)
    print(verdict.describe())
    assert verdict.violated_invariant == "TokenOwnershipInv", verdict.describe()
    assert verdict.rejected_event == wrong[i], verdict.describe()


def test_a_trace_checked_in_parts_gets_the_same_verdicts(recorded):
    """A long trace is checked in parts, each TLC run starting from the states the previous one ended
    in, with the history no action reads again left out. The parts accept the whole trace, and a
    corrupted input in the last part fails its invariant at that event, numbered in the whole trace."""
    events, _ = recorded[SEEDS[0], False]
    part = len(logged_events(events)) // 3 + 1
    verdict = check_trace(events, part_events=part)
    print(f"in parts of {part} events: {verdict.describe()}")
    assert verdict.accepted and verdict.parts == 3, verdict.describe()
    i, k = _host_input(events, start=2 * len(events) // 3 + 1)
    wrong = [dict(e) for e in events]
    wrong[i]["inputs"] = [list(row) for row in events[i]["inputs"]]
    wrong[i]["inputs"][k][1] = POISON_TOKEN
    verdict = check_trace(wrong, part_events=part)
    assert verdict.violated_invariant == "NoStaleInputInv", verdict.describe()
    assert verdict.rejected_event == wrong[i] and verdict.parts == 3, verdict.describe()


def test_a_trace_with_a_stale_input_fails_no_stale_input(recorded):
    """A CPU-built id that is POISON_TOKEN (its token still only in a future) is a stale input."""
    events, _ = recorded[SEEDS[0], False]
    i, k = _host_input(events)
    wrong = [dict(e) for e in events]
    wrong[i]["inputs"] = [list(row) for row in events[i]["inputs"]]
    wrong[i]["inputs"][k][1] = POISON_TOKEN
    verdict = check_trace(wrong)
    print(verdict.describe())
    assert verdict.violated_invariant == "NoStaleInputInv", verdict.describe()
    assert verdict.rejected_event == wrong[i], verdict.describe()


def test_a_trace_whose_counters_differ_from_the_spec_fails_engine_counters(recorded):
    """CounterInv on a real run: the machine's counters as the engine logged them are the spec's."""
    events, _ = recorded[SEEDS[0], False]
    i = next(i for i, e in enumerate(events) if e["event"] == "reinstate" and e["source"] == sm.COMPOSITION_BREAK)
    wrong = [dict(e) for e in events]
    wrong[i]["counters"] = [events[i]["counters"][0] + 1, events[i]["counters"][1] - 1]  # a break counted async
    verdict = check_trace(wrong)
    assert verdict.violated_invariant == "EngineCountersInv", verdict.describe()
    assert verdict.rejected_event == wrong[i], verdict.describe()


def record_mutant(root: Path, seed: int, **overrides: object) -> list[dict]:
    """Run seed's workload (without its aborts: the CLI has none) through the real CLI on the mutant
    package at `root`, in its own process; return the `--trace` it wrote."""
    folder = root / f"seed{seed}"
    folder.mkdir()
    prompts, trace = folder / "in.jsonl", folder / "trace.ndjson"
    items = random_workload(random.Random(seed), f"s{seed}")
    prompts.write_text("".join(json.dumps(line) + "\n" for line in prompt_lines(items)), encoding="utf-8")
    flags = ["--trace", trace, "--no-progress", *config_flags(async_scheduling=True, **{**ENGINE, **overrides})]
    argv = generate_argv(prompts, folder / "out.jsonl", *flags)
    proc = subprocess.run(argv, cwd=folder, env=mutant_env(root), capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a request failed; the trace is still whole
    return read_trace(trace)


def test_trace_of_an_engine_writing_back_by_current_row_fails_an_invariant(tlc_available, tmp_path):
    """A held-out mutant, run for real: the write-back addresses rows by their current order, not by
    the snapshot. Its trace is rejected by an invariant on the first input that reads a misplaced token."""
    root = mutant_package(tmp_path, *WRITE_BACK_BY_CURRENT_ROW)
    for seed in (6, 5, 9, 12, 13):  # SEEDS, 6 first: without its aborts, seed 5's run reads no misplaced token
        verdict = check_trace(record_mutant(root, seed, async_relay=False))
        if not verdict.accepted:
            break
    else:
        pytest.fail("no run of the mutant was rejected")
    print(f"mutant, seed {seed}: {verdict.describe()}")
    assert verdict.violated_invariant in ("TokenOwnershipInv", "NoStaleInputInv"), verdict.describe()
    assert verdict.rejected_event["event"] == "reinstate", verdict.describe()


def test_trace_of_an_engine_driven_from_another_thread_names_it_and_is_accepted(tlc_available, tmp_path):
    """A server drives the engine from its own thread: the trace's header names that thread as the
    engine loop, and the checker takes thread identity from the header, not from fixed names."""
    path = tmp_path / "engine-thread.ndjson"
    items = random_workload(random.Random(SEEDS[0]), "t")
    with LLM("tiny-llama", async_scheduling=True, trace_path=str(path), **ENGINE) as llm:
        loop = threading.Thread(target=drive, args=(llm, items), name="engine-loop")
        loop.start()
        loop.join()
    events = read_trace(path)
    assert engine_threads(events)[0] == "engine-loop"
    assert {e["thread"] for e in events if e["event"] == "step"} == {"engine-loop"}
    verdict = check_trace(events)
    assert verdict.accepted, verdict.describe()


def test_trace_of_an_engine_killed_by_a_failing_program_is_a_behaviour_of_the_spec(tlc_available, tmp_path):
    path = tmp_path / "failure.ndjson"
    with LLM(
        "tiny-llama", async_scheduling=True, trace_path=str(path), runtime_factory=faulty_runtime, **ENGINE
    ) as llm:
        for i in range(4):
            llm.add_request([5 + i] * (3 + 11 * i), SamplingParams(max_tokens=12, ignore_eos=True), f"r{i}")
        for _ in range(3):
            llm.step()
        llm.engine.runtime.inject_failure(after=1)
        for _ in range(100):
            if not llm.has_unfinished_requests():
                break
            llm.step()
    events = read_trace(path)
    assert any(e["event"] == "Materialize" and not e["ok"] for e in events)
    assert events[-1]["event"] == "drain"
    verdict = check_trace(events)
    print(f"failing program: {verdict.describe()}")
    assert verdict.accepted, verdict.describe()


def test_trace_of_an_engine_without_the_get_output_lock_is_rejected(tlc_available, tmp_path):
    # The mutant: get_output() without its lock. Both threads then materialize one output.
    root = mutant_package(tmp_path, *NO_GET_OUTPUT_LOCK)
    for seed in SEEDS:  # relay off: only a break or a rebuild materializes on the main thread
        events = record_mutant(root, seed, device_time_ms=5, async_relay=False)
        per_step = Counter(e["step"] for e in events if e["event"] == "Materialize")
        if max(per_step.values(), default=0) > 1:
            break
    else:
        pytest.fail("no run without the lock materialized an output twice")
    verdict = check_trace(events)
    print(f"broken run, seed {seed}: {verdict.describe()}")
    assert not verdict.accepted
    rejected = verdict.rejected_event
    assert rejected is not None, verdict.describe()
    assert rejected["event"] == "Materialize", json.dumps(rejected)
    matched = verdict.events[: verdict.matched]
    earlier = [e for e in matched if e["event"] == "Materialize" and e["step"] == rejected["step"]]
    assert earlier, f"event {verdict.matched} is not a second materialization: {json.dumps(rejected)}"


# Structured output: a few constrained requests among free ones on the test's JSON-capable model, small
# enough for a short trace (four rows at a time), long enough for masks in the program and deferred.
GRAMMAR_ENGINE = dict(device="cpu-inprocess", max_model_len=160, max_num_seqs=4, decode_buckets=(1, 2, 4))


def constrained_lines(seed: int, count: int) -> list[dict]:
    """`generate` JSONL lines: every constraint round robin, each third request free (no grammar), and
    a dead end (a one-token choice under ignore_eos: its grammar can then only end, which EOS does not)."""
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        line = {"request_id": f"g{i}", "prompt_token_ids": [1, *rng.choices(range(3, 300), k=rng.randint(1, 12))]}
        line |= {"temperature": 1.0, "seed": seed * 100 + i}
        if i % 3 == 2:
            line["max_tokens"] = rng.randint(1, 30)
        else:
            so = CONSTRAINTS[i % len(CONSTRAINTS)].params
            line["max_tokens"] = MAX_TOKENS
            line["structured_outputs"] = {so.kind: list(so.choice) if so.choice else getattr(so, so.kind)}
        lines.append(line)
    dead_end = {"request_id": "dead-end", "prompt_token_ids": [1, 9], "max_tokens": 20, "ignore_eos": True}
    lines.insert(count // 2, dead_end | {"structured_outputs": {"choice": ["yes"]}})
    return lines


def record_constrained(folder: Path, model: Path, env: dict[str, str] | None = None) -> list[dict]:
    """The constrained workload through the real CLI, async and traced (on `env`'s package); its trace."""
    folder.mkdir()
    prompts, trace = folder / "in.jsonl", folder / "trace.ndjson"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in constrained_lines(3, 8)), encoding="utf-8")
    flags = ["--model", model, "--trace", trace, "--no-progress"]
    flags += config_flags(async_scheduling=True, **GRAMMAR_ENGINE)
    argv = generate_argv(prompts, folder / "out.jsonl", *flags)
    proc = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a request failed (the mutant's grammars reject)
    return read_trace(trace)


def test_trace_of_a_constrained_run_is_a_behaviour_of_the_spec_and_a_stale_mask_fails_it(tlc_available, tmp_path):
    """Structured output on a real run: a deferred step's events (launch, the pending step applied,
    the mask built from the grammars that took it, reinstate) and a request ended by its grammar's
    dead end are a behaviour of the spec, and every mask came from its request's grammar after its
    previous token (FreshMaskInv, by TLC). The spec's
    MCMaskBeforeInFlightToken run for real (a source mutant builds a deferred step's mask before the
    step in flight is applied) fails FreshMaskInv at its first stale mask, and its grammars reject a
    token it sampled. (tests/test_structured_output.py checks a larger real run's masks without TLC.)"""
    model = write_json_model(tmp_path / "model")
    events = record_constrained(tmp_path / "engine", model)
    launches = Counter(e["state"] for e in events if e["event"] == "launch")
    assert launches[sm.SAMPLE_IN_PROGRAM] and launches[sm.SAMPLE_DEFERRED], launches
    assert ["dead-end", "error"] in [f for e in events if e["event"] == "AdvanceStep" for f in e["finished"]]
    verdict = check_trace(events)
    print(f"constrained run ({dict(launches)}): {verdict.describe()}")
    assert verdict.accepted, verdict.describe()

    mutant = record_constrained(
        tmp_path / "mutant-run", model, mutant_env(mutant_package(tmp_path / "mutant", *MASK_BEFORE_IN_FLIGHT_TOKEN))
    )
    verdict = check_trace(mutant)
    print(f"stale-mask mutant: {verdict.describe()}")
    assert verdict.violated_invariant == "FreshMaskInv", verdict.describe()
    rejected = verdict.rejected_event
    assert rejected["event"] == "mask" and any(g != k for _, g, k in rejected["masks"]), verdict.describe()
    # What a client of the mutant sees: a constrained request ends with the grammar's refusal of a token.
    outputs = [json.loads(line) for line in (tmp_path / "mutant-run" / "out.jsonl").read_text().splitlines()]
    assert any("the grammar rejected token" in (o["error"] or "") for o in outputs), outputs


HYPOTHESIS_EXAMPLES = 50  # per CI run: the stateful engine test's own machine, every engine traced
HYPOTHESIS_STEPS = 10  # rules per example (~55 trace events each): 50 x 40 steps made an 11,000-event trace


def test_traces_of_hypothesis_stateful_examples_are_behaviours_of_the_spec(tlc_available, tmp_path):
    """tests/test_stateful_engine.py's state machine (the real engine on the device process, relay on)
    run here for 50 examples, every engine writing its trace: each trace is validated. Its examples
    share one engine while it lives, so a trace holds many examples (thousands of events, checked in
    parts). The fault rules are off here: a death only starts a new engine and trace, which the
    failing-program test above covers, and an exploding write-back is not something the spec models."""
    import test_stateful_engine as stateful

    class TracedEngine(stateful.EngineOnDeviceProcess):
        FAULT_PERCENT = 0

    examples = stateful.COVERAGE["examples"]
    traces = traced_machine_run(stateful, TracedEngine, HYPOTHESIS_EXAMPLES, HYPOTHESIS_STEPS, tmp_path)
    assert stateful.COVERAGE["examples"] - examples >= HYPOTHESIS_EXAMPLES
    assert traces, "no engine wrote a trace"
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        verdicts = list(pool.map(lambda path: check_trace(read_trace(path), timeout_s=600), traces))
    for path, verdict in zip(traces, verdicts, strict=True):
        print(f"{path.name}: {verdict.describe()}")
        assert verdict.accepted, f"{path.name}: {verdict.describe()}"


def test_trace_of_a_churn_benchmark_run_is_a_behaviour_of_the_spec(tlc_available, tmp_path):
    """One run of the benchmark's churn workload (64 requests, joins and finishes almost every step), on
    the benchmark's own runner and engine settings (`bench --workload churn`), traced and validated."""
    from neuron_async_sm.bench.runner import ProbedLLM, batch_config
    from neuron_async_sm.bench.workloads import build_workload

    path = tmp_path / "churn.ndjson"
    bench = ProbedLLM("tiny-llama", async_scheduling=True, trace_path=str(path), **batch_config(8))
    try:
        bench.run(build_workload("churn"))
    finally:
        bench.close()
    verdict = check_trace(read_trace(path))
    print(f"churn: {verdict.describe()}")
    assert verdict.accepted, verdict.describe()
