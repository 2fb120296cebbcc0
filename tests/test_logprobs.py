"""Logprobs (sampled token + top-N, and prompt logprobs) against `transformers`, async against sync.

The reference is a float64 `log_softmax` of transformers' float32 logits for the whole sequence
(prompt and output), the distribution vLLM's default `raw_logprobs` reports: before temperature or
any filter. Ours are computed on the device in float32 (model/logprobs.py); 1e-4 is the issue's bar.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.reference import VOCAB, hf_greedy, hf_logprobs, save_hf_model

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.outputs import TokenLogprobs
from neuron_async_sm.sampling_params import InvalidRequestError

transformers = pytest.importorskip("transformers")

PROMPTS = ([1, 17, 33, 150, 9], [1, 5], [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 7, 9, 11])
NEW_TOKENS = 6
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A small random LlamaForCausalLM saved as safetensors, and the model itself."""
    path = tmp_path_factory.mktemp("hf")
    return path, save_hf_model(path, seed=3, max_position_embeddings=128)


def assert_position(ours: TokenLogprobs, ref: torch.Tensor, token: int, top: int) -> None:
    """One position: the chosen token's logprob and rank, and the top-`top` tokens, as `ref` `[vocab]` has them."""
    assert ours.token_id == token
    assert abs(ours.logprob - ref[token].item()) <= TOL, (ours.logprob, ref[token].item())
    assert ours.rank == int((ref >= ref[token]).sum())
    expected_lp, expected_ids = ref.topk(top)
    assert list(ours.top_ids) == expected_ids.tolist()
    assert max(abs(a - b) for a, b in zip(ours.top_logprobs, expected_lp.tolist(), strict=True)) <= TOL if top else True


def engine(path: Path, async_scheduling: bool, **config: object) -> LLM:
    # A token budget of 8: the 16-token prompt's logprobs come from three chunks, the others' from one.
    config = {"max_num_batched_tokens": 8, "prefill_buckets": (8,), "max_model_len": 64, **config}
    return LLM(str(path), device="cpu-inprocess", async_scheduling=async_scheduling, **config)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_sampled_and_prompt_logprobs_equal_transformers_across_chunked_prefill(checkpoint, async_scheduling: bool):
    path, model = checkpoint
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=3, prompt_logprobs=2)
    with engine(path, async_scheduling) as llm:
        outputs = llm.generate([list(p) for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.finish_reason == "length", out.error
        assert out.output_token_ids == hf_greedy(model, list(prompt), NEW_TOKENS)
        ref = hf_logprobs(model, list(prompt) + out.output_token_ids)
        assert out.logprobs is not None and len(out.logprobs) == NEW_TOKENS
        for i, (token, lp) in enumerate(zip(out.output_token_ids, out.logprobs, strict=True)):
            assert_position(lp, ref[len(prompt) - 1 + i], token, 3)
            assert lp.rank == 1  # greedy
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None  # the first prompt token has nothing before it
        for i in range(1, len(prompt)):
            assert_position(out.prompt_logprobs[i], ref[i - 1], prompt[i], 2)


def test_logprobs_are_the_raw_distribution_not_the_temperature_scaled_one(checkpoint):
    """vLLM's default logprobs_mode (raw_logprobs): a sampled request's logprobs ignore its temperature
    and top-k, and top-0 gives the sampled token's alone."""
    path, model = checkpoint
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.7, top_k=20, seed=11, logprobs=0)
    with engine(path, True) as llm:
        [out] = llm.generate([list(PROMPTS[0])], params)
    ref = hf_logprobs(model, list(PROMPTS[0]) + out.output_token_ids)
    for i, (token, lp) in enumerate(zip(out.output_token_ids, out.logprobs, strict=True)):
        assert_position(lp, ref[len(PROMPTS[0]) - 1 + i], token, 0)
    assert any(lp.rank > 1 for lp in out.logprobs)  # it did sample, not take the argmax every time


def test_async_equals_sync_with_and_without_logprobs(checkpoint):
    """Seeded sampling, requests that ask and requests that do not in one batch: the tokens equal
    exactly; the logprobs too (bit for bit: the same program on the same rows' logits)."""
    path, _ = checkpoint
    requests = [
        (list(p), SamplingParams(max_tokens=10, temperature=0.9, seed=i, logprobs=2 if i % 2 else None))
        for i, p in enumerate(PROMPTS * 2)
    ]
    results = {}
    for async_scheduling in (True, False):
        with engine(path, async_scheduling, max_num_seqs=4) as llm:
            outs = [llm.generate([PromptRequest(*requests[1])])[0]]  # one alone first
            outs += llm.generate(
                [PromptRequest(prompt, params, arrival_step=i) for i, (prompt, params) in enumerate(requests)]
            )
            results[async_scheduling] = outs
    for a, s in zip(results[True], results[False], strict=True):
        assert a.output_token_ids == s.output_token_ids
        assert a.logprobs == s.logprobs
    assert [o.logprobs is None for o in results[True][1:]] == [i % 2 == 0 for i in range(len(requests))]


@pytest.mark.parametrize("async_relay", [True, False], ids=["relay", "no-relay"])
def test_logprobs_take_the_same_async_paths_as_no_logprobs(checkpoint, async_relay: bool):
    """The packed output still feeds the next step as it is (its tokens are column 0): with logprobs
    asked by every request the machine takes exactly the paths it takes without them."""
    path, _ = checkpoint
    counts = []
    for logprobs in (None, 5):
        with engine(path, True, max_num_seqs=4, async_relay=async_relay) as llm:
            llm.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=12, logprobs=logprobs))
            counts.append(llm.stats()["state_counts"])
    assert counts[0] == counts[1]
    assert counts[1]["Steady"] >= 8, counts


def test_logprobs_above_max_logprobs_are_refused_naming_the_field(checkpoint):
    path, _ = checkpoint
    with engine(path, False, max_logprobs=4) as llm:
        too_many = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=5))[0]
        too_many_prompt = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, prompt_logprobs=5))[0]
        whole_vocab = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=-1))[0]
        fine = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=4))[0]
    assert too_many.finish_reason == "error" and too_many.error.startswith("logprobs:"), too_many.error
    assert "max_logprobs=4" in too_many.error
    assert too_many_prompt.error.startswith("prompt_logprobs:"), too_many_prompt.error
    assert whole_vocab.error.startswith("logprobs:") and str(VOCAB) in whole_vocab.error
    assert fine.finish_reason == "length" and len(fine.logprobs[0].top_ids) == 4
    with pytest.raises(InvalidRequestError, match="^logprobs:"):
        SamplingParams(logprobs=-2)
    with pytest.raises(InvalidRequestError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=1.5)


def test_a_one_token_prompt_has_prompt_logprobs_of_none(checkpoint):
    path, _ = checkpoint
    with engine(path, True) as llm:
        [out] = llm.generate([[7]], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert out.prompt_logprobs == [None] and out.logprobs is None


def test_tensor_parallel_logprobs_equal_one_rank():
    """Two ranks (the vocabulary's logits all-gathered, every token's too for the prompt's): the same
    tokens and the same logprobs as one rank (float64 weights, so the sharded sums round alike)."""
    params = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2)
    outs = []
    for tp in (1, 2):
        config = dict(dtype="float64", max_num_batched_tokens=16, prefill_buckets=(16,), max_model_len=64)
        with LLM("tiny-llama", tensor_parallel_size=tp, **config) as llm:
            [out] = llm.generate([list(range(3, 23))], params)  # 20 tokens: two prefill chunks
        outs.append(out)
    one, two = outs
    assert two.output_token_ids == one.output_token_ids
    assert two.logprobs == one.logprobs
    assert two.prompt_logprobs == one.prompt_logprobs and len(one.prompt_logprobs) == 20


def test_logprobs_are_taken_before_the_penalties(checkpoint):
    """vLLM's raw logprobs: penalties change which token is sampled, never the logprobs reported; the
    tokens are those of the same request without logprobs."""
    path, model = checkpoint
    prompt = list(PROMPTS[2])
    params = SamplingParams(max_tokens=NEW_TOKENS, repetition_penalty=3.0, presence_penalty=1.5, logprobs=1)
    with engine(path, True) as llm:
        [out] = llm.generate([prompt], params)
        [plain] = llm.generate([prompt], dataclasses.replace(params, logprobs=None))
    assert out.output_token_ids == plain.output_token_ids and plain.logprobs is None
    ref = hf_logprobs(model, prompt + out.output_token_ids)
    for i, (token, lp) in enumerate(zip(out.output_token_ids, out.logprobs, strict=True)):
        assert_position(lp, ref[len(prompt) - 1 + i], token, 1)
    assert any(lp.rank > 1 for lp in out.logprobs)  # the penalties moved the pick off the raw argmax
