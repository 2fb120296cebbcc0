"""Async mode emits exactly the tokens sync mode emits, for every request, under random workloads.

Async runs twice: with the relay (the default) and without it (the design's paths)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from support.workloads import drive, random_workload

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.worker import async_machine as sm

ENGINE = dict(
    dtype="float64",  # float32 matmuls may round differently per batch size; float64 makes ties negligible
    max_num_seqs=8,
    max_model_len=128,
    max_num_batched_tokens=32,  # small budget: long prompts are chunked
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4, 8),
)


@pytest.fixture(scope="module", params=[True, False], ids=["relay", "no-relay"])
def engines(request, tmp_path_factory):
    """A fresh sync engine beside each async one: an engine draws a missing seed from how many
    requests it has accepted, so the pair must have seen the same requests."""
    trace = tmp_path_factory.mktemp("trace") / "equivalence.ndjson"
    with (
        LLM("tiny-llama", async_scheduling=False, **ENGINE) as sync_llm,
        LLM("tiny-llama", async_scheduling=True, async_relay=request.param, trace_path=str(trace), **ENGINE) as llm,
    ):
        llm.trace_file = trace
        yield sync_llm, llm


@pytest.fixture
def async_llm(engines):
    return engines[1]


def _drive_pairs(engines, rng: random.Random, runs: int, tag: str, processing: bool = False) -> Counter:
    """`runs` random workloads through sync and async; async's tokens must be sync's (aborted: a prefix)."""
    sync_llm, async_llm = engines
    finishes = Counter()
    for n in range(runs):
        items = random_workload(rng, f"{tag}{n}", processing=processing)
        reference = drive(sync_llm, items, aborts=False)
        got = drive(async_llm, items, aborts=True)
        for item in items:
            rid = item.request_id
            if got.finish[rid] == "abort":
                # Aborted mid-flight: what it got is a prefix of the reference, nothing after.
                assert got.tokens[rid] == reference.tokens[rid][: len(got.tokens[rid])], rid
            else:
                assert got.tokens[rid] == reference.tokens[rid], rid
                assert got.finish[rid] == reference.finish[rid], rid
            finishes[got.finish[rid]] += 1
    return finishes


def test_random_workloads_give_identical_tokens(engines):
    async_llm = engines[1]
    finishes = _drive_pairs(engines, random.Random(1234), 40, "w")
    assert finishes["stop"] and finishes["length"] and finishes["abort"]  # the workloads cover them all
    counters = async_llm.stats()
    assert counters["async_steps"] + counters["sync_fallback_steps"] == counters["steps"]
    # With the relay every step Steady cannot take relays; without it, the design's three fallbacks.
    fallbacks = {sm.COMPOSITION_BREAK, sm.SHAPE_MISMATCH_REBUILD, sm.REORDER_REMAP}
    reached = {s for s, n in counters["state_counts"].items() if n > 0}
    relay = async_llm.config.async_relay
    no_spec = set(sm.PATH_STATES) - {sm.HOST_DRAFT_BREAK, sm.SPEC_STEADY, sm.SPEC_EXIT}  # speculation's rows
    assert reached == no_spec - (fallbacks if relay else {sm.RELAY}), counters["state_counts"]


def test_random_workloads_with_penalties_and_logit_bias_give_identical_tokens(engines):
    """Seeded sampling with penalties, logit_bias, min_tokens and min_p: the penalties count the token
    still in flight (the device's token history), so async equals sync; aborts included."""
    finishes = _drive_pairs(engines, random.Random(4321), 25, "p", processing=True)
    assert finishes["stop"] and finishes["length"] and finishes["abort"]


def test_every_output_is_materialized_exactly_once(async_llm):
    rng = random.Random(99)
    for n in range(10):
        drive(async_llm, random_workload(rng, f"x{n}"))
    events = [json.loads(line) for line in async_llm.trace_file.read_text().splitlines()]
    materialized = Counter(e["step"] for e in events if e["event"] == "Materialize")
    stepped = {e["step"] for e in events if e["event"] == "step"}
    assert set(materialized) == stepped
    assert set(materialized.values()) == {1}
    threads = Counter(e["thread"] for e in events if e["event"] == "Materialize")
    assert threads["async-output"] > 0
    if async_llm.config.async_relay:
        assert threads["MainThread"] == 0, threads  # the relay never waits for an output on the main thread
    else:
        assert threads["MainThread"] > 0  # the breaks and rebuilds: both threads really contend


def test_long_steady_decode_is_mostly_async():
    with LLM("tiny-llama", async_scheduling=True, max_num_seqs=8) as llm:
        prompts = [[5 + i, 6, 7, 8] for i in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True))
        stats = llm.stats()
    decode_steps = stats["steps"] - 1  # one prefill step
    assert stats["state_counts"]["Steady"] >= 0.95 * decode_steps, stats


def test_tokens_stream_step_by_step():
    with LLM("tiny-llama", async_scheduling=True) as llm:
        deltas = list(llm.stream([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True)))
    assert len(deltas) == 20
    assert all(len(d.output_token_ids) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * 19 + [True]
