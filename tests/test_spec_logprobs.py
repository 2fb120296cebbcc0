"""Logprobs under speculative decoding (docs/spec-decode.md §12): every emitted token, an accepted draft,
the recovered token or the bonus, gets the logprobs an ordinary step gives it (the target's raw
logprobs at its position), and prompt logprobs are those without speculation.

One mixed workload (greedy and seeded sampled requests, some asking for logprobs, prompt logprobs,
penalties, staggered arrivals, chunked prompts) runs once per engine: without speculation (the
reference), and with n-gram and draft-model speculation at k = 1 and 3, sync and async. Greedy
requests must give the reference's tokens and logprobs; seeded ones the same tokens and logprobs in
async and sync; and every sampled token's logprobs are the target's at its position, as a run
without speculation scores the same sequence as a prompt (teacher forcing).
"""

from __future__ import annotations

import random

import pytest
from support.workloads import SPEC_ENGINE

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint, write_noisy_copy
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.outputs import RequestOutput, TokenLogprobs

ENGINE = {**SPEC_ENGINE, "device": "cpu-inprocess"}
# Logprobs are float32 of float64 logits: a verified position's forward and a one-token step's round
# alike up to the float64 noise.
TOL = 1e-5
METHODS = ("ngram", "draft_model")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """The repetitive checkpoint of test_spec_decode.py: n-gram drafts are accepted in runs."""
    return str(write_checkpoint(tmp_path_factory.mktemp("repetitive"), layer_scale=0.02))


@pytest.fixture(scope="module")
def close_draft(target, tmp_path_factory) -> str:
    """A draft that agrees with the target on most tokens (test_spec_draft_model.py's)."""
    return str(write_noisy_copy(target, tmp_path_factory.mktemp("close"), 0.01))


def workload() -> list[PromptRequest]:
    rng = random.Random(29)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 1024) for _ in range(n)]

    greedy = [
        SamplingParams(max_tokens=80, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=77, logprobs=0),  # the chosen token's alone
        SamplingParams(max_tokens=70),  # asks for none, in the same steps as those that do
        SamplingParams(max_tokens=75, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4),  # raw: before them
        SamplingParams(max_tokens=79, logprobs=5, prompt_logprobs=0),
    ]
    sampled = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, logprobs=3),
        SamplingParams(max_tokens=33, temperature=1.0, seed=4, logprobs=1, prompt_logprobs=1),
        SamplingParams(max_tokens=60, temperature=0.3, top_k=50, seed=5, logprobs=2),  # cycles: n-gram drafts accepted
    ]
    lengths = [23, 7, 40, 12, 3, 17, 30, 9]  # every prompt + max_tokens < max_model_len
    return [
        PromptRequest(prompt(n), params, f"{'g' if params.temperature == 0 else 's'}{i}", arrival_step=i % 5)
        for i, (n, params) in enumerate(zip(lengths, greedy + sampled, strict=True))
    ]


def spec_config(method: str, k: int, draft: str) -> dict:
    config = {"method": method, "num_speculative_tokens": k}
    return config | ({"model": draft} if method == "draft_model" else {})


@pytest.fixture(scope="module")
def runs(target, close_draft):
    """run(method, k, async) -> {request id: output} (method None: no speculation), each run once."""
    done: dict[tuple, tuple[dict[str, RequestOutput], dict]] = {}

    def run(method: str | None, k: int = 0, async_scheduling: bool = True) -> tuple[dict[str, RequestOutput], dict]:
        key = (method, k, async_scheduling)
        if key not in done:
            spec = None if method is None else spec_config(method, k, close_draft)
            with LLM(target, async_scheduling=async_scheduling, speculative_config=spec, **ENGINE) as llm:
                outputs = llm.generate(workload())
                done[key] = ({o.request_id: o for o in outputs}, llm.stats())
        return done[key]

    return run


def assert_same_position(got: TokenLogprobs, want: TokenLogprobs, where: str) -> None:
    assert got.token_id == want.token_id, where
    assert abs(got.logprob - want.logprob) <= TOL, (where, got.logprob, want.logprob)
    assert got.rank == want.rank, (where, got.rank, want.rank)
    assert got.top_ids == want.top_ids, (where, got.top_ids, want.top_ids)
    assert all(abs(a - b) <= TOL for a, b in zip(got.top_logprobs, want.top_logprobs, strict=True)), where


def assert_same_logprobs(got: RequestOutput, want: RequestOutput) -> None:
    rid = got.request_id
    assert (got.logprobs is None) == (want.logprobs is None), rid
    if got.logprobs is not None:
        # One per emitted token: a stop inside an accepted run drops the logprobs after it too.
        assert len(got.logprobs) == len(got.output_token_ids) == len(want.logprobs), rid
        for i, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
            assert_same_position(a, b, f"{rid} output {i}")
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None), rid
    if got.prompt_logprobs is not None:
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids), rid
        assert got.prompt_logprobs[0] is None
        for i, (a, b) in enumerate(zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True)):
            assert_same_position(a, b, f"{rid} prompt {i + 1}")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_and_logprobs_with_speculation_equal_those_without(runs, method, k, async_scheduling):
    reference, _ = runs(None)
    got, stats = runs(method, k, async_scheduling)
    greedy = [rid for rid in reference if rid.startswith("g")]
    for rid in greedy:
        assert got[rid].error is None, got[rid].error
        assert (got[rid].output_token_ids, got[rid].finish_reason) == (
            reference[rid].output_token_ids,
            reference[rid].finish_reason,
        ), rid
        assert_same_logprobs(got[rid], reference[rid])
    spec = stats["spec_decode"]
    # Runs of drafts were accepted (n-gram, k = 1: about a sixth of the tokens; draft_model: most), so
    # many logprobs compared come from verified draft positions, not from a row's first.
    assert spec["num_accepted_tokens"] > sum(len(got[r].output_token_ids) for r in greedy) // 8, spec
    if async_scheduling and method == "draft_model":  # the logprobs' columns ride on the steady path too
        assert stats["state_counts"]["SpecSteady"] > stats["steps"] // 2, stats["state_counts"]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_with_logprobs_gives_the_same_tokens_and_logprobs_async_and_sync(runs, method):
    sync, _ = runs(method, 3, False)
    got, stats = runs(method, 3, True)
    for rid in (r for r in sync if r.startswith("s")):
        assert got[rid].error is None, got[rid].error
        assert got[rid].output_token_ids == sync[rid].output_token_ids, rid
        assert_same_logprobs(got[rid], sync[rid])
    assert stats["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_each_sampled_token_gets_the_targets_logprobs_at_its_position(target, runs, method):
    """Sampled with speculation, tokens differ from a run without it; their logprobs must still be the
    target's at each position: scored again as one prompt by an engine without speculation (its
    prompt logprobs), the accepted drafts', recovered tokens' and bonus tokens' alike."""
    got, _ = runs(method, 3, True)
    sampled = [got[rid] for rid in got if rid.startswith("s")]
    tops = {out.request_id: len(out.logprobs[0].top_ids) for out in sampled}
    scored = [
        PromptRequest(out.prompt_token_ids + out.output_token_ids, SamplingParams(max_tokens=1, prompt_logprobs=top))
        for out, top in zip(sampled, tops.values(), strict=True)
    ]
    with LLM(target, async_scheduling=False, **ENGINE) as llm:
        teacher = llm.generate(scored)
    for out, ref in zip(sampled, teacher, strict=True):
        expected = ref.prompt_logprobs[len(out.prompt_token_ids) :]  # the logprobs of each output token
        assert len(expected) == len(out.logprobs)
        for i, (a, b) in enumerate(zip(out.logprobs, expected, strict=True)):
            assert_same_position(a, b, f"{out.request_id} output {i}")
    assert any(lp.rank > 1 for out in sampled for lp in out.logprobs)  # sampled, not only argmax tokens


def test_a_bad_logprobs_count_is_refused_by_name_under_speculation_and_hurts_no_other_request():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with LLM("tiny-llama", device="cpu-inprocess", speculative_config=spec, max_model_len=64, max_logprobs=4) as llm:
        asks, too_many = SamplingParams(max_tokens=3, logprobs=4), SamplingParams(max_tokens=3, prompt_logprobs=5)
        outs = llm.generate([PromptRequest([5, 6, 7], asks), PromptRequest([5, 6, 7], too_many)])
    assert outs[0].finish_reason == "length" and len(outs[0].logprobs) == 3, outs[0].error
    assert outs[1].finish_reason == "error" and outs[1].error.startswith("prompt_logprobs:"), outs[1].error
