"""Failures end every in-flight request with an error, never hang, and leave a clear dead engine."""

from __future__ import annotations

import threading

import pytest
from support.faulty_runtime import faulty_runtime

from neuron_async_sm import LLM, EngineDeadError, SamplingParams
from neuron_async_sm.trace import StepObserver

PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("device", ["cpu", "cpu-inprocess"])
def test_program_failure_errors_every_request_and_kills_the_engine(device, async_scheduling):
    llm = LLM("tiny-llama", device=device, async_scheduling=async_scheduling, runtime_factory=faulty_runtime)
    try:
        for i in range(4):
            llm.add_request([5 + i, 6, 7], PARAMS, f"r{i}")
        for _ in range(3):
            llm.step()
        llm.engine.runtime.inject_failure(after=2)
        finishes = {}
        for _ in range(20):
            for delta in llm.step():
                if delta.finish_reason:
                    finishes[delta.request_id] = delta
            if len(finishes) == 4:
                break
        assert {d.finish_reason for d in finishes.values()} == {"error"}
        assert all("injected" in d.error for d in finishes.values()), finishes
        assert not llm.has_unfinished_requests()
        assert llm.engine.scheduler.requests == {}, "a dead engine still tracks finished requests"
        with pytest.raises(EngineDeadError, match="engine is dead"):
            llm.step()
        with pytest.raises(EngineDeadError):
            llm.add_request([1, 2], PARAMS)
        assert not any(t.name == "async-output" and t.is_alive() for t in threading.enumerate())
    finally:
        llm.close()
    # A new engine in the same process works.
    with LLM("tiny-llama", device=device, async_scheduling=async_scheduling) as fresh:
        [out] = fresh.generate([[5, 6, 7]], SamplingParams(max_tokens=5))
        assert out.finish_reason in ("length", "stop") and out.output_token_ids


def test_output_thread_failure_is_surfaced_not_swallowed():
    with LLM("tiny-llama", device="cpu-inprocess", async_scheduling=True) as llm:

        class FailingWriteBack(StepObserver):
            def write_back(self, snapshot, tokens):
                if snapshot.step_id == 3:
                    raise RuntimeError("write-back exploded")

        llm.engine.tracer.observe(FailingWriteBack())
        outputs = llm.generate([[5, 6, 7], [8, 9]], PARAMS)
        assert {o.finish_reason for o in outputs} == {"error"}
        assert all("write-back exploded" in o.error for o in outputs)


def test_slow_device_with_tiny_queue_delivers_everything():
    with LLM("tiny-llama", runtime_queue_depth=1, device_time_ms=5, async_scheduling=True) as llm:
        outputs = llm.generate([[5 + i, 6] for i in range(6)], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outputs] == [12] * 6


def test_host_sampling_gives_the_device_sampler_tokens():
    """on_device_sampling=False (sync only): logits come back and the same pure sampler runs on the host."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=3)
    runs = []
    for on_device in (True, False):
        with LLM(
            "tiny-llama", device="cpu-inprocess", async_scheduling=False, on_device_sampling=on_device, dtype="float64"
        ) as llm:
            runs.append([o.output_token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)])
    assert runs[0] == runs[1]
