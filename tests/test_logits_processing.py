"""Penalties, logit_bias, min_tokens and min_p: tokens equal a float64 `transformers` reference with the
same logits processors, in sync and async mode, and the token still in flight is counted.

The reference runs transformers' own processors (MinNewTokensLengthLogitsProcessor,
SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor, MinPLogitsWarper) in vLLM's order;
presence and frequency, which transformers lacks, are vLLM's formula written out here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.reference import VOCAB, hf_greedy, save_hf_model

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.model.sampler import sample_tokens

transformers = pytest.importorskip("transformers")

ENGINE = dict(
    dtype="float64",  # batch-invariant: a row's token does not depend on its neighbours
    max_num_seqs=8,
    max_model_len=64,
    max_num_batched_tokens=16,  # the long prompt below is chunked
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4, 8),
)
SEED = 7  # save_hf_model's seed: its greedy continuations of these prompts repeat tokens
REPEATS = [1, 40, 181, 59]  # plain greedy: 91 five times in a row
REPEATS_LONGER = [1, 54, 69, 94, 190, 123, 148, 46, 181]  # plain greedy: 49 nine times in a row
EOS_PROMPT = [1, 23, 182]  # plain greedy: 91, 130, ...; 130 is the checkpoint's EOS
EOS = 130
LONG = [1, *range(100, 140)]  # 41 tokens: three prefill chunks
NEW_TOKENS = 16


def cases() -> dict[str, PromptRequest]:
    def case(prompt: list[int], **params) -> PromptRequest:
        params.setdefault("ignore_eos", True)
        return PromptRequest(prompt, SamplingParams(max_tokens=NEW_TOKENS, **params))

    named = {
        "repetition": case(REPEATS, repetition_penalty=1.8),
        "repetition_below_one": case(REPEATS_LONGER, repetition_penalty=0.7),
        "frequency": case(REPEATS_LONGER, frequency_penalty=2.0),
        "frequency_negative": case(REPEATS, frequency_penalty=-0.5),
        "presence": case(REPEATS, presence_penalty=1.5),
        "logit_bias": case(REPEATS, logit_bias={5: 8.0, 91: -100.0, 17: 0.5}),
        "min_tokens": case(EOS_PROMPT, min_tokens=6, ignore_eos=False),
        "min_tokens_stop_ids": case(EOS_PROMPT, min_tokens=4, stop_token_ids=(113,), ignore_eos=False),
        "everything_chunked": case(
            LONG, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={101: 3.0}
        ),
        "neutral": case(REPEATS),
    }
    return {name: PromptRequest(r.prompt_token_ids, r.sampling_params, name) for name, r in named.items()}


def reference(model, prompt: list[int], params: SamplingParams, eos: int) -> list[int]:
    """Greedy, float64, with transformers' processors in vLLM's order; stops at a stop token unless ignored."""
    lp = transformers
    processors = []
    stops = [*params.stop_token_ids, *(() if params.ignore_eos else (eos,))]
    if params.min_tokens:
        processors.append(lp.MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops))
    if params.logit_bias:
        processors.append(lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(ids).logits[:, -1].double()  # [1, vocab]
            for processor in processors:
                logits = processor(ids, logits)
            # vLLM's (and OpenAI's) presence and frequency penalties, on the output tokens
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).double()
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in stops:
                break
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("hf")
    model = save_hf_model(path, seed=SEED).double()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    return path, model


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str, list[int]]:
    _, model = checkpoint
    return {name: reference(model, r.prompt_token_ids, r.sampling_params, EOS) for name, r in cases().items()}


def test_the_prompts_lead_where_the_cases_need(checkpoint, expected):
    """Premises: unpenalized greedy repeats (so a penalty missing the last token would repeat it too),
    the EOS prompt reaches EOS early, and each case's reference differs from plain greedy."""
    _, model = checkpoint
    plain = {tuple(p): hf_greedy(model, p, NEW_TOKENS) for p in (REPEATS, REPEATS_LONGER, EOS_PROMPT)}
    assert plain[tuple(REPEATS)][:5] == [91] * 5 and plain[tuple(REPEATS_LONGER)][1:10] == [49] * 9
    assert plain[tuple(EOS_PROMPT)][1] == EOS
    for name, request in cases().items():
        if name not in ("neutral", "everything_chunked"):
            assert expected[name] != hf_greedy(model, request.prompt_token_ids, NEW_TOKENS)[: len(expected[name])], name
    assert EOS not in expected["min_tokens"][:6] and 113 not in expected["min_tokens_stop_ids"][:4]


@pytest.mark.parametrize(
    "mode",
    [dict(async_scheduling=False), dict(async_scheduling=True), dict(async_scheduling=False, on_device_sampling=False)],
    ids=["sync", "async", "host-sampling"],
)
def test_greedy_tokens_equal_transformers_with_the_same_processors(checkpoint, expected, mode):
    """Every case in one batch (rows with and without processing side by side). In async mode each
    decode step's input is the previous step's token, still on the device: a penalty that missed it
    (counted one step late) repeats the last token where the reference does not."""
    path, _ = checkpoint
    async_scheduling = mode["async_scheduling"]
    with LLM(str(path), device="cpu-inprocess", **mode, **ENGINE) as llm:
        outputs = llm.generate(list(cases().values()))
        stats = llm.stats()
    got = {out.request_id: out.output_token_ids for out in outputs}
    assert got == expected
    if async_scheduling:
        assert stats["async_steps"] >= stats["steps"] - 4, stats  # penalized requests stay async


def test_min_p_keeps_the_tokens_transformers_keeps():
    """Seeded sampling with min_p draws only tokens MinPLogitsWarper keeps, and draws each of them."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    temperature = 0.7
    kept_hf = transformers.MinPLogitsWarper(0.2)(None, logits / temperature).isfinite()[0]
    draws = 4000
    tokens = sample_tokens(
        logits.expand(draws, -1),
        temperature=torch.full((draws,), temperature),
        top_k=torch.zeros(draws, dtype=torch.int32),
        top_p=torch.ones(draws),
        seeds=torch.arange(draws),
        output_index=torch.zeros(draws, dtype=torch.int64),
        min_p=torch.full((draws,), 0.2),
    )
    drawn = torch.zeros(64, dtype=torch.bool)
    drawn[tokens] = True
    assert 2 < int(kept_hf.sum()) < 20  # the filter really filters
    assert torch.equal(drawn, kept_hf)
