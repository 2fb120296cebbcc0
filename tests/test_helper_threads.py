"""The engine's helper threads (the runtime's receiver, the async output thread) run under SCHED_BATCH:
woken by the device they wait for the CPU instead of preempting the engine's main thread, which holds
the GIL they need (issue 15, `runtime.defer_to_running_threads`). The caller's thread is left alone."""

from __future__ import annotations

import os
import threading

import pytest

from neuron_async_sm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux scheduling policies")

HELPERS = ("neuron-device-rx", "async-output")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_helper_threads_do_not_preempt_the_engine_thread(async_scheduling: bool) -> None:
    with LLM("tiny-llama", async_scheduling=async_scheduling) as llm:
        outputs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(outputs[0].output_token_ids) == 4
        helpers = [t for t in threading.enumerate() if t.name in HELPERS]
        assert sorted(t.name for t in helpers) == sorted(HELPERS[: 2 if async_scheduling else 1])
        for thread in helpers:
            assert thread.native_id is not None
            assert os.sched_getscheduler(thread.native_id) == os.SCHED_BATCH, thread.name
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread is left alone
