"""Speculative decoding on XLA (docs/backends.md, "Speculative decoding on a compiling device"): greedy
tokens with speculation equal the CPU device's without it (n-gram and draft_model), seeded async equals
sync, sampling extras under speculation give the CPU device's tokens and logprobs, constrained
requests under n-gram (a grammar's mask per verified position) give the CPU device's tokens without
speculation, and nothing compiles after warm-up (the spec step is one graph per input shape and
variant, fed or not, masked or not).

XLA only: the other backends run the same program eagerly in tests/test_spec_*.py. Few shapes (one
prefill bucket, two rows at most), so warm-up compiles 2 graphs for n-gram and 4 for draft_model; the
engines of a method share them (one process compiles each graph once).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random

import pytest
from device_work import one_graph_per_program
from support.grammar_model import CONSTRAINTS, write_json_model
from support.workloads import assert_matches, drive, greedy, random_workload
from tokenizers import Tokenizer

from neuron_async_sm import LLM, PromptRequest, SamplingParams
from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint, write_noisy_copy

SHAPES = dict(
    dtype="float64",
    max_num_seqs=2,
    max_model_len=64,
    max_num_batched_tokens=16,  # longer prompts are chunked
    prefill_buckets=(16,),
    decode_buckets=(1, 2),
    sampling_extras=False,  # their variants would double the graphs; one test takes them
)
K = 2
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
REQUIRE_XLA = os.environ.get("NEURON_ASYNC_SM_REQUIRE_XLA", "") == "1"  # the XLA lane: a missing torch_xla fails


@pytest.fixture(scope="module")
def xla() -> str:
    if not HAS_XLA:
        if REQUIRE_XLA:
            pytest.fail("NEURON_ASYNC_SM_REQUIRE_XLA=1 but torch_xla is not importable (run .ci/xla-lane)")
        pytest.skip("torch_xla is not installed")
    return "xla"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    # One layer (each layer is compile time on XLA); repetitive output (the layer scaled down): n-gram
    # and the draft find drafts the target accepts.
    return str(write_checkpoint(tmp_path_factory.mktemp("target"), MICRO_LLAMA_CONFIG, layer_scale=0.02))


@pytest.fixture(scope="module")
def close_draft(target, tmp_path_factory) -> str:
    return str(write_noisy_copy(target, tmp_path_factory.mktemp("close"), 0.01))


def churn(seed: int) -> list:
    """A small churny workload: requests arriving and finishing at different steps, some chunked."""
    rng = random.Random(seed)
    items = random_workload(rng, f"s{seed}", vocab=MICRO_LLAMA_CONFIG.vocab_size, max_prompt=24)[:5]
    # Long enough for the target's output to repeat itself (n-gram's drafts), within max_model_len.
    lengths = [dataclasses.replace(w.params, max_tokens=rng.randint(20, 36)) for w in items]
    return [dataclasses.replace(w, params=p, abort_turn=None) for w, p in zip(items, lengths, strict=True)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_on_xla_gives_the_cpu_tokens_without_it(xla, target, close_draft, method):
    items = greedy(churn(11))
    with LLM(target, device="cpu-inprocess", async_scheduling=False, **SHAPES) as cpu:
        reference = drive(cpu, items, aborts=False)
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = close_draft
    with LLM(target, device=xla, speculative_config=spec, **SHAPES) as llm:
        got = drive(llm, items, aborts=False)
        stats = llm.stats()
    assert_matches(got, reference, items)
    assert stats["spec_decode"]["num_accepted_tokens"] > 0, stats
    if method == "draft_model":  # the device's rows: next_input fed on the device, at slot_len
        assert stats["state_counts"]["SpecSteady"] > 0, stats
    assert stats["compilations"] == 0, "a program was compiled while serving: warm-up missed a graph"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_speculation_on_xla_gives_async_the_tokens_sync_gives(xla, target, close_draft, method):
    items = churn(12)
    assert any(w.params.temperature > 0 and w.params.seed is not None for w in items)
    items = [w for w in items if w.params.temperature == 0 or w.params.seed is not None]  # reproducible only
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = close_draft
    results, counts = [], []
    for async_scheduling in (False, True):
        with LLM(target, device=xla, speculative_config=spec, async_scheduling=async_scheduling, **SHAPES) as llm:
            results.append(drive(llm, items, aborts=False))
            counts.append(llm.stats())
    assert_matches(results[1], results[0], items)
    steady = "SpecSteady" if method == "draft_model" else "HostDraftBreak"  # n-gram drafts from the host
    assert counts[1]["state_counts"][steady] > 0, counts[1]
    assert [c["compilations"] for c in counts] == [0, 0], "compiled while serving: warm-up missed a graph"


def test_speculation_with_penalties_and_logprobs_on_xla_gives_the_cpu_tokens_and_logprobs(xla, target, close_draft):
    """Sampling extras under speculation: warm-up compiles their variant of every spec call (fed ones
    too), so serving compiles nothing; tokens and logprobs are the CPU device's without speculation."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5, repetition_penalty=1.3, logprobs=3)
    requests = [PromptRequest([5 + i, 6, 7, 8, 9, 5, 6, 7], params, f"penalized{i}") for i in range(2)]
    shapes = {**SHAPES, "sampling_extras": True}
    with LLM(target, device="cpu-inprocess", async_scheduling=False, **shapes) as cpu:
        references = cpu.generate(requests)
    spec = {"method": "draft_model", "model": close_draft, "num_speculative_tokens": K}
    with LLM(target, device=xla, speculative_config=spec, **shapes) as llm:
        warmed = llm.engine.runtime.warmup_report
        with one_graph_per_program(xla, llm.engine.runtime):  # a spec step, its logprobs packed in
            outputs = llm.generate(requests)
        stats = llm.stats()
    assert sum(r.compilations for r in warmed if "sampling extras" in r.label) > 0, warmed
    assert stats["compilations"] == 0, "a program was compiled while serving: warm-up missed a graph"
    assert stats["state_counts"]["SpecSteady"] > 0, stats
    for got, reference in zip(outputs, references, strict=True):
        assert got.output_token_ids == reference.output_token_ids
        assert got.logprobs is not None and reference.logprobs is not None
        for ours, theirs in zip(got.logprobs, reference.logprobs, strict=True):
            assert (ours.token_id, ours.rank, ours.top_ids) == (theirs.token_id, theirs.rank, theirs.top_ids)
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-6)  # float64 logits
            assert ours.top_logprobs == pytest.approx(theirs.top_logprobs, abs=1e-6)


# In each constraint's language (the grammar test model's corpus): n-gram finds drafts in the prompt.
CONSTRAINED_PROMPTS = (
    '{"name": "abc", "age": 12}',
    "ab-12 bc-345",
    "yes no maybe",
    '{"ok": true, "tag": "red"}',
    "(1+2)",
)


def test_constrained_requests_under_ngram_on_xla_compile_nothing_and_give_the_cpu_tokens(xla, tmp_path_factory):
    """Structured output under n-gram: a constrained row's spec step carries its mask, one row per
    verified position (`[rows, 1 + k, words]`), and the sampling extras (the default config). Warm-up
    compiles that variant of every spec shape, so serving (async: a pending step is materialized
    first, HostDraftBreak; a masked step is never deferred) compiles nothing and runs each step as
    one graph; greedy tokens are the CPU device's without speculation."""
    model = str(write_json_model(tmp_path_factory.mktemp("json-model"), num_hidden_layers=1))
    tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
    requests = [
        PromptRequest(
            [1, *tokenizer.encode(text).ids], SamplingParams(max_tokens=40, structured_outputs=c.params), f"c{i}"
        )
        for i, (text, c) in enumerate(zip(CONSTRAINED_PROMPTS, CONSTRAINTS, strict=True))
    ]
    shapes = {**SHAPES, "sampling_extras": True}
    with LLM(model, device="cpu-inprocess", async_scheduling=False, **shapes) as cpu:
        references = cpu.generate(requests)
    spec = {"method": "ngram", "num_speculative_tokens": K}
    with LLM(model, device=xla, speculative_config=spec, **shapes) as llm:
        warmed = llm.engine.runtime.warmup_report
        with one_graph_per_program(xla, llm.engine.runtime):
            outputs = llm.generate(requests)
        stats = llm.stats()
    assert stats["compilations"] == 0, "a program was compiled while serving: warm-up missed a graph"
    assert sum(r.compilations for r in warmed if r.label.endswith("a mask")) > 0, warmed
    assert stats["spec_decode"]["num_accepted_tokens"] > 0, stats["spec_decode"]
    # a deferred spec step (its request alone, after an empty schedule) runs the same masked program
    assert stats["state_counts"]["HostDraftBreak"] > 0, stats
    for got, reference, constraint in zip(outputs, references, CONSTRAINTS, strict=True):
        assert (got.output_token_ids, got.finish_reason) == (reference.output_token_ids, "stop"), got.request_id
        constraint.check(tokenizer.decode(got.output_token_ids))
