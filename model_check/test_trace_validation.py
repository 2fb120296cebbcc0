"""Traces of the real engine are behaviours of the spec; a broken engine's trace is not.

The engine runs in async mode on the emulated device process, with seeded random workloads (arrivals,
stops, max_tokens, aborts, reorders). Its `--trace` output becomes a TLA+ module and TLC replays it
with `TraceAsyncScheduling`, reporting how many events it matched.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tlc import PARALLEL_RUNS
from trace_check import TraceVerdict, check_trace, read_trace
from workloads import drive, random_workload

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.async_output import AsyncModelRunnerOutput

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
    return {(seed, relay): record(folder / f"{name}.ndjson", seed, async_relay=relay)
            for (seed, relay), name in zip(RECORDINGS, RECORDING_IDS, strict=True)}  # fmt: skip


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
    assert set(paths) == set(sm.PATH_STATES), paths
    assert threads["MainThread"] and threads["async-output"], threads
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


def test_trace_of_an_engine_killed_by_a_failing_program_is_a_behaviour_of_the_spec(tlc_available, tmp_path):
    path = tmp_path / "failure.ndjson"
    with LLM("tiny-llama", async_scheduling=True, trace_path=str(path), **ENGINE) as llm:
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


def test_trace_of_an_engine_without_the_get_output_lock_is_rejected(tlc_available, tmp_path, monkeypatch):
    # Test-only hook: get_output() without its lock. Both threads then materialize one output.
    monkeypatch.setattr(AsyncModelRunnerOutput, "lock_factory", contextlib.nullcontext)
    for seed in SEEDS:  # relay off: only a break or a rebuild materializes on the main thread
        events, _ = record(tmp_path / f"broken{seed}.ndjson", seed, device_time_ms=5, async_relay=False)
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
