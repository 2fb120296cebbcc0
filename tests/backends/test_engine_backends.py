"""The unchanged engine on each backend: async == sync token for token, the scenarios' paths, no compiles after warm-up
(sampling extras included).

Every engine here has the same shape-determining config (`SHAPES`), so a compiling backend compiles
each program once per test process and later engines find it cached.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch
from device_work import one_graph_per_program
from support.workloads import drive, random_workload
from test_async_scenarios import PATHS, SCENARIOS, relayed, run

from neuron_async_sm import LLM, EngineConfig, PromptRequest, SamplingParams
from neuron_async_sm.runtime import DeviceRuntime, Program, ProgramFactory, create_runtime
from neuron_async_sm.worker.model_runner import STEP_PROGRAM

SHAPES = dict(
    dtype="float64",  # float32 matmuls may round differently per batch size; float64 makes ties negligible
    max_num_seqs=4,
    max_model_len=128,
    max_num_batched_tokens=16,  # long prompts are chunked
    prefill_buckets=(8, 16),
    # No penalties or logprobs here: on XLA their variant of every program would double the warm-up
    # (test_a_penalized_request_with_logprobs_compiles_nothing_after_warm_up covers it on few shapes).
    sampling_extras=False,
)
DECODE_BUCKETS = (1, 2, 4, 8)  # the scenarios' buckets are subsets, so their programs are among these
WORKLOADS = 6


def engine(backend, **config) -> LLM:
    return LLM("tiny-llama", device=backend.name, **{**SHAPES, "decode_buckets": DECODE_BUCKETS, **config})


def test_async_gives_the_tokens_sync_gives_on_churny_workloads(backend):
    rng = random.Random(4321)
    workloads = [random_workload(rng, f"w{n}", max_prompt=40) for n in range(WORKLOADS)]
    with engine(backend, async_scheduling=False) as sync_llm:
        references = [drive(sync_llm, items, aborts=False) for items in workloads]
        sync_stats = sync_llm.stats()
    # Each engine on its own: in the XLA lane this sync engine is the process's first with these shapes,
    # so no earlier engine's graph can stand in for one its warm-up missed (seen: the first program's
    # graph carried the KV cache's creation and serving compiled decode bucket 1 again).
    assert sync_stats.get("compilations", 0) == 0, "the sync engine compiled while serving: warm-up missed a graph"
    with engine(backend, async_scheduling=True) as async_llm:
        for items, reference in zip(workloads, references, strict=True):
            got = drive(async_llm, items, aborts=True)
            for item in items:
                rid = item.request_id
                if got.finish[rid] == "abort":  # aborted mid-flight: a prefix of the reference
                    assert got.tokens[rid] == reference.tokens[rid][: len(got.tokens[rid])], rid
                else:
                    assert (got.tokens[rid], got.finish[rid]) == (reference.tokens[rid], reference.finish[rid]), rid
        stats = async_llm.stats()
    assert stats["state_counts"]["Relay"] > 0, stats  # the relay is on (the default) and churn relays
    assert stats["async_steps"] > 0 and stats["sync_fallback_steps"] > 0, stats  # churn: both kinds of step
    if backend.compiles:
        assert stats["compilations"] == 0, "a program was compiled while serving: warm-up missed a shape"
    else:
        assert "compilations" not in stats, stats


@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_paths_and_counters(backend, tmp_path, name, relay):
    requests, config, design = SCENARIOS[name]
    expected = relayed(name, design) if relay else design
    config = {**SHAPES, **config}
    del config["dtype"]  # run() sets float64 itself
    if "max_num_batched_tokens" in config:  # the chunked-prefill scenario: keep its budget, share our buckets
        config["prefill_buckets"] = SHAPES["prefill_buckets"]
    paths, outputs, stats = run(tmp_path, requests, device=backend.name, async_relay=relay, **config)
    assert paths == expected
    async_steps = expected.count("Steady") + expected.count("Relay")
    assert stats["async_steps"] == async_steps
    assert stats["sync_fallback_steps"] == len(expected) - async_steps
    assert stats["state_counts"] == {s: expected.count(s) for s in PATHS}
    assert [len(o.output_token_ids) for o in outputs] == [r.sampling_params.max_tokens for r in requests]
    assert stats.get("compilations", 0) == 0, "a program was compiled while serving: warm-up missed a shape"


@dataclass(frozen=True)
class Int64TokensPrograms:
    """Picklable program factory: ``inner``'s programs, but the sampled tokens come back int64 (a device's
    own integer width)."""

    inner: ProgramFactory

    def __call__(self, device: torch.device) -> Mapping[str, Program]:
        programs = dict(self.inner(device))
        step = programs[STEP_PROGRAM]
        programs[STEP_PROGRAM] = lambda **inputs: step(**inputs).long()
        return programs


def int64_tokens_runtime(config: EngineConfig, programs: ProgramFactory, warmup=()) -> DeviceRuntime:
    """A ``RuntimeFactory`` (the engine's runtime seam): the backend ``config.device`` over ``Int64TokensPrograms``."""
    return create_runtime(config, Int64TokensPrograms(programs), warmup)


def test_a_future_of_another_dtype_never_stands_in_for_input_ids(backend):
    if backend.name in ("cpu", "cpu-inprocess"):
        pytest.skip("the emulated device insists on the requested dtype (its futures never differ)")
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=7)
    with engine(backend, async_scheduling=False) as sync_llm:
        reference = [o.output_token_ids for o in sync_llm.generate(prompts, params)]
    # Only the buckets this workload needs (three 4-token prompts in one step, then three-row decodes):
    # a compiling backend warms up five int64 programs, not every one of SHAPES.
    buckets = dict(prefill_buckets=(16,), decode_buckets=(4,))
    widened = dict(async_scheduling=True, async_relay=False, runtime_factory=int64_tokens_runtime, **buckets)
    with engine(backend, **widened) as async_llm:  # async_relay off: the machine's own fallbacks
        got = [o.output_token_ids for o in async_llm.generate(prompts, params)]
        stats = async_llm.stats()
    assert got == reference
    # The machine's dtype rule: an int64 future never stands in for int32 input ids.
    assert stats["state_counts"]["Steady"] == 0 and stats["state_counts"]["ShapeMismatchRebuild"] > 1, stats


# The sampling extras' test keeps its own shapes few: on XLA each is two programs (plain, extras) to compile.
EXTRAS_SHAPES = dict(
    dtype="float64",
    max_num_seqs=1,
    max_model_len=32,
    max_num_batched_tokens=8,
    prefill_buckets=(8,),
    decode_buckets=(1,),
    async_relay=False,
)


def test_a_penalized_request_with_logprobs_compiles_nothing_after_warm_up(backend):
    """On a compiling backend warm-up compiles the sampling extras' variant of every program, so serving
    penalties and logprobs (of any top-N up to max_logprobs) compiles nothing; its tokens and logprobs
    are the CPU device's."""
    if not backend.compiles:
        pytest.skip("nothing compiles on this backend")
    params = SamplingParams(
        max_tokens=8, ignore_eos=True, temperature=0.9, seed=5, presence_penalty=1.5, repetition_penalty=1.3, logprobs=3
    )
    requests = [PromptRequest([5, 6, 7, 8, 9, 5, 6, 7, 8, 9], params, "penalized")]
    with LLM("tiny-llama", device="cpu-inprocess", async_scheduling=False, **EXTRAS_SHAPES) as cpu_llm:
        (reference,) = cpu_llm.generate(requests)
    with LLM("tiny-llama", device=backend.name, **EXTRAS_SHAPES) as llm:
        warmed = llm.engine.runtime.warmup_report
        with one_graph_per_program(backend.name, llm.engine.runtime):  # the step, its logprobs packed in
            (got,) = llm.generate(requests)
        stats = llm.stats()
    assert sum(r.compilations for r in warmed if "sampling extras" in r.label) > 0, warmed
    assert stats["compilations"] == 0, "a program was compiled while serving: warm-up missed a shape"
    assert stats["async_steps"] > 0, stats  # the steady steps: their input ids are the packed output's tokens
    assert got.output_token_ids == reference.output_token_ids
    assert got.logprobs is not None and reference.logprobs is not None
    for ours, theirs in zip(got.logprobs, reference.logprobs, strict=True):
        assert (ours.token_id, ours.rank, ours.top_ids) == (theirs.token_id, theirs.rank, theirs.top_ids)
        # float32 logits of a compiled graph and of eager torch differ in their last bits
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert ours.top_logprobs == pytest.approx(theirs.top_logprobs, abs=1e-4)
