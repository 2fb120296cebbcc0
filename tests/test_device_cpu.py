"""`device_cpu`: the emulated device process owns one CPU and the engine's own threads keep off it."""

from __future__ import annotations

import os
import threading

import pytest

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.config import ConfigError, EngineConfig

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs CPU affinity and 2 CPUs"
)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(device_cpu=-1), "device_cpu: must be a CPU number"),
        (dict(device_cpu=10_000), "device_cpu: must be a CPU number"),
        (dict(device_cpu=True), "device_cpu: must be a CPU number"),
        (dict(device_cpu=0, device="cpu-inprocess"), "device_cpu: pinning needs the device process"),
    ],
)
def test_bad_device_cpu_is_rejected_naming_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**overrides)


def test_device_process_is_pinned_and_engine_threads_keep_off_its_cpu() -> None:
    cpu = (os.cpu_count() or 2) - 1
    with LLM("tiny-llama", device_cpu=cpu, async_scheduling=True) as llm:
        outputs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(outputs[0].output_token_ids) == 4
        assert os.sched_getaffinity(llm.engine.runtime.device_pid) == {cpu}
        engine_threads = [t for t in threading.enumerate() if t.name in ("neuron-device-rx", "async-output")]
        assert len(engine_threads) == 2
        for thread in engine_threads:
            assert thread.native_id is not None
            assert cpu not in os.sched_getaffinity(thread.native_id), thread.name
        assert cpu in os.sched_getaffinity(0)  # the caller's own thread is left alone
