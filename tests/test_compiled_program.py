"""Compiled programs per bucket (`enforce_eager=False`): the same tokens as eager, no compilation while serving.

Small configs (three graphs, then two) so that start-up compiles in well under a minute on an idle
machine; float64, so that a fused kernel's different rounding cannot flip a token.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from support.workloads import drive, random_workload

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.config import ConfigError, EngineConfig
from neuron_async_sm.engine.core import StepProgramFactory
from neuron_async_sm.engine.warmup import warmup_shapes
from neuron_async_sm.runtime import DeviceRuntime, RuntimeFactory, create_runtime

ENGINE = dict(
    dtype="float64",
    max_num_seqs=2,
    max_model_len=96,
    max_num_batched_tokens=16,  # prompts up to 40 tokens: chunked prefills beside decodes
    prefill_buckets=(16,),
    decode_buckets=(2,),
)


def test_compiled_async_gives_eager_sync_tokens_on_churn_and_compiles_nothing_while_serving():
    config = EngineConfig(**ENGINE)
    assert warmup_shapes(config) == [(2,), (1, 16), (2, 16)]
    rng = random.Random(7)
    workloads = [random_workload(rng, f"c{n}", max_prompt=40) for n in range(4)]
    with (
        LLM("tiny-llama", async_scheduling=False, **ENGINE) as eager,
        LLM("tiny-llama", async_scheduling=True, enforce_eager=False, **ENGINE) as compiled,
    ):
        assert compiled.stats()["compilations"] == 0  # start-up compiled every shape already
        for items in workloads:
            reference = drive(eager, items, aborts=False)
            got = drive(compiled, items, aborts=False)
            assert got.tokens == reference.tokens
            assert got.finish == reference.finish
        stats = compiled.stats()
        assert stats["state_counts"]["Relay"] > 0  # churn: the batch changed under async steps
        assert stats["compilations"] == 0, "a shape compiled while serving"
        assert "compilations" not in eager.stats()


ONE_ROW = {**ENGINE, "max_num_seqs": 1, "decode_buckets": (1,)}


def compiling_only(shapes: tuple[tuple[int, ...], ...]) -> RuntimeFactory:
    """A ``RuntimeFactory`` (the engine's runtime seam): the engine's runtime, its programs compiled for ``shapes``."""

    def runtime(config: EngineConfig, programs: StepProgramFactory, warmup=()) -> DeviceRuntime:
        assert set(shapes) < set(programs.spec.compile_shapes), "not a narrower start-up than the engine's"
        narrowed = StepProgramFactory(
            replace(programs.spec, compile_shapes=shapes), programs.relay_width, programs.group
        )
        return create_runtime(config, narrowed, warmup)

    return runtime


def test_compiled_programs_count_a_shape_missed_at_start_up():
    """The count is real: start-up that skips the decode bucket leaves it to compile while serving."""
    skip_decode = compiling_only(((1, 16),))
    with LLM("tiny-llama", device="cpu-inprocess", enforce_eager=False, runtime_factory=skip_decode, **ONE_ROW) as llm:
        assert llm.stats()["compilations"] == 0
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        assert llm.stats()["compilations"] == 1


def test_enforce_eager_must_be_a_bool_and_not_on_xla():
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineConfig(enforce_eager="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineConfig(device="xla", enforce_eager=False)
