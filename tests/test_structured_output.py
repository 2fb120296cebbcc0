"""Structured output (issue 30): every constrained output satisfies its grammar, async and sync; async
equals sync; greedy equals transformers' float64 logits under the same llguidance masks; a grammar
that does not compile is refused naming the field; the mask is applied on the device.

The model is a random Llama over a byte-level BPE trained in the test (tests/support/grammar_model.py):
its random logits make every walk through a grammar a different one, so the checks see many shapes
of output, not one.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from support.grammar_model import CONSTRAINTS, MAX_TOKENS, PERSON, VOCAB_SIZE, write_json_model
from support.processes import config_flags, generate_argv
from tokenizers import Tokenizer
from trace_check import read_trace, stale_masks

from neuron_async_sm import LLM, InvalidRequestError, SamplingParams
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.model.grammar_mask import allowed_tokens, apply_token_bitmask
from neuron_async_sm.model.sampler import sample_tokens
from neuron_async_sm.structured_output import (
    GrammarCompiler,
    StructuredOutputsParams,
    as_structured_outputs,
    dead_end,
)

llguidance = pytest.importorskip("llguidance")

ENGINE = dict(device="cpu-inprocess", max_model_len=160, max_num_seqs=16, decode_buckets=(1, 2, 4, 8, 16))
NUM_CONSTRAINED = 60
NUM_FREE = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_json_model(tmp_path_factory.mktemp("json-model")))


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_file(f"{model}/tokenizer.json")


def workload(seed: int, *, temperature: float) -> list[tuple[int | None, PromptRequest]]:
    """NUM_CONSTRAINED constrained requests (every constraint, round robin) shuffled among NUM_FREE
    unconstrained ones, each with its own prompt and seed: (index into CONSTRAINTS or None, request)."""
    rng = random.Random(seed)
    kinds: list[int | None] = [i % len(CONSTRAINTS) for i in range(NUM_CONSTRAINED)] + [None] * NUM_FREE
    rng.shuffle(kinds)
    items = []
    for i, kind in enumerate(kinds):
        prompt = [1, *rng.choices(range(3, 300), k=rng.randint(1, 12))]
        params = SamplingParams(
            max_tokens=MAX_TOKENS if kind is not None else rng.randint(1, 60),
            temperature=temperature,
            seed=seed * 1000 + i,
            structured_outputs=CONSTRAINTS[kind].params if kind is not None else None,
        )
        items.append((kind, PromptRequest(prompt, params, f"r{i}")))
    return items


def run(model: str, items, **config) -> list:
    with LLM(model, **{**ENGINE, **config}) as llm:
        outputs = llm.generate([request for _, request in items])
        return outputs, llm.stats()


def check_outputs(items, outputs, tokenizer) -> None:
    for (kind, _), output in zip(items, outputs, strict=True):
        if kind is None:
            continue
        assert output.finish_reason == "stop", (output.request_id, output.finish_reason, output.error)
        assert output.output_token_ids[-1] == 2  # the grammar ended: EOS is all it allowed
        CONSTRAINTS[kind].check(tokenizer.decode(output.output_token_ids))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_constrained_output_satisfies_its_grammar_and_async_equals_sync(model, tokenizer, temperature):
    items = workload(7, temperature=temperature)
    sync, _ = run(model, items, async_scheduling=False)
    check_outputs(items, sync, tokenizer)
    for relay in (True, False) if temperature > 0 else (True,):
        outputs, stats = run(model, items, async_scheduling=True, async_relay=relay)
        check_outputs(items, outputs, tokenizer)
        assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in sync], f"relay={relay}"
        # Constrained rows sampled under masks that waited for the step in flight, and under masks
        # built in the program (a request's first token: its grammar is in its start state).
        assert stats["deferred_steps"] > 0 and stats["launch_counts"]["SampleInProgram"] > 0, stats


def test_tensor_parallel_ranks_defer_together_and_equal_sync(model, tokenizer):
    """Two ranks (device processes): every rank takes the same launch and samples under the same mask."""
    items = workload(4, temperature=1.0)[:20]
    reference, _ = run(model, items, async_scheduling=False)
    outputs, stats = run(model, items, async_scheduling=True, tensor_parallel_size=2, device="cpu")
    check_outputs(items, outputs, tokenizer)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in reference]
    assert stats["launch_counts"]["SampleDeferred"] > 0, stats


def test_penalties_beside_grammars_async_equals_sync(model, tokenizer):
    """Logits processing (penalties, min_p) on constrained and unconstrained rows: a deferred step's
    forward writes the token history, its sampling program processes, masks and samples."""
    items = [
        (kind, PromptRequest(r.prompt_token_ids, replace(r.sampling_params, **PROCESSING[i % 3]), r.request_id))
        for i, (kind, r) in enumerate(workload(8, temperature=1.0)[:24])
    ]
    sync, _ = run(model, items, async_scheduling=False)
    outputs, stats = run(model, items, async_scheduling=True)
    check_outputs(items, outputs, tokenizer)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in sync]
    assert stats["launch_counts"]["SampleDeferred"] > 0, stats


def test_logprobs_beside_grammars_async_equals_sync(model, tokenizer):
    """Sampled-token and prompt logprobs on constrained and unconstrained rows: a deferred step's
    forward carries the prompt's blocks after its logits, its sampling program packs them with the
    tokens, so every request gets the logprobs the fused program gives in sync mode."""
    asks = ({"logprobs": 2}, {"logprobs": 0, "prompt_logprobs": 1}, {})
    items = [
        (kind, PromptRequest(r.prompt_token_ids, replace(r.sampling_params, **asks[i % 3]), r.request_id))
        for i, (kind, r) in enumerate(workload(10, temperature=1.0)[:24])
    ]
    sync, _ = run(model, items, async_scheduling=False)
    outputs, stats = run(model, items, async_scheduling=True)
    check_outputs(items, outputs, tokenizer)
    assert stats["launch_counts"]["SampleDeferred"] > 0, stats
    for (_, request), ours, theirs in zip(items, outputs, sync, strict=True):
        assert ours.output_token_ids == theirs.output_token_ids
        # float32 programs over other batch shapes (async steps are composed differently): close, not bitwise
        assert same_logprobs(ours.logprobs, theirs.logprobs), request.request_id
        assert same_logprobs(ours.prompt_logprobs, theirs.prompt_logprobs), request.request_id
        if request.sampling_params.logprobs is not None:
            assert ours.logprobs is not None and len(ours.logprobs) == len(ours.output_token_ids)
        if request.sampling_params.prompt_logprobs is not None:
            assert ours.prompt_logprobs is not None and len(ours.prompt_logprobs) == len(request.prompt_token_ids)


# Dead ends made on purpose: a choice of one token, whose grammar can only end (EOS) after it, under a
# rule that takes EOS away: min_tokens holds it back, or ignore_eos makes it not end the request.
DEAD_ENDS = {
    "dead-min-tokens": (dict(min_tokens=4), r"allows only token\(s\) \[2\] here, and min_tokens=4 holds back"),
    "dead-ignore-eos": (dict(ignore_eos=True), r"allows only token\(s\) \[2\] here, and ignore_eos is set"),
}


def test_a_row_whose_grammar_allows_no_token_finishes_its_request_with_an_error_naming_it(model, tokenizer):
    """Each dead end is found when its mask is built, before anything is sampled under it: the request
    finishes with an error naming why, after the tokens its grammar allowed, and never samples from a
    row with no allowed token. The other requests get what they get without it; async equals sync."""
    others = workload(11, temperature=1.0)[:9]
    dead = [
        (
            None,
            PromptRequest(
                [1, 5 + i],
                SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured_outputs={"choice": ["yes"]}, **extra),
                req_id,
            ),
        )
        for i, (req_id, (extra, _)) in enumerate(DEAD_ENDS.items())
    ]
    items = others[:3] + dead[:1] + others[3:6] + dead[1:] + others[6:]
    alone, _ = run(model, others, async_scheduling=False)
    sync, _ = run(model, items, async_scheduling=False)
    outputs, stats = run(model, items, async_scheduling=True)
    assert stats["deferred_steps"] > 0, stats
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in sync]
    assert [(o.finish_reason, o.error) for o in outputs] == [(o.finish_reason, o.error) for o in sync]
    by_id = {o.request_id: o for o in outputs}
    for req_id, (_, message) in DEAD_ENDS.items():
        output = by_id[req_id]
        assert output.finish_reason == "error", (req_id, output.finish_reason, output.output_token_ids)
        assert re.search(message, output.error), (req_id, output.error)
        assert tokenizer.decode(output.output_token_ids) == "yes", (req_id, output.output_token_ids)
    kept = [by_id[r.request_id] for _, r in others]
    check_outputs(others, kept, tokenizer)
    assert [o.output_token_ids for o in kept] == [o.output_token_ids for o in alone]


def test_a_mask_row_with_no_allowed_token_is_a_dead_end(model):
    """A row llguidance fills with no token at all is a dead end, whatever the request's own rules."""
    compiler = GrammarCompiler(f"{model}/tokenizer.json", vocab_size=VOCAB_SIZE, eos_token_ids=[2])
    matcher = compiler.matcher({"regex": "a+"})
    row = compiler.bitmask([matcher])[0]  # [W]
    assert dead_end(matcher, row, {2}, "EOS ruled out") is None  # "a..." tokens are left
    assert (
        dead_end(matcher, np.zeros_like(row), (), "")
        == "structured output: the grammar allows no token here (a dead end)"
    )


def same_logprobs(ours, theirs) -> bool:
    if ours is None or theirs is None:
        return ours is theirs
    pairs = list(zip(ours, theirs, strict=True))
    return all(
        (a is None and b is None)
        or (
            a.token_id == b.token_id
            and a.top_ids == b.top_ids
            and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            and a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
        )
        for a, b in pairs
    )


PROCESSING = (
    {"presence_penalty": 0.8, "frequency_penalty": 0.3},
    {"repetition_penalty": 1.3, "min_p": 0.05},
    {},
)


def test_host_sampling_applies_the_same_mask(model, tokenizer):
    """Sync mode with sampling on the host (the logits program): the mask goes with the logits."""
    items = workload(9, temperature=1.0)[:24]
    on_device, _ = run(model, items, async_scheduling=False)
    on_host, _ = run(model, items, async_scheduling=False, on_device_sampling=False)
    check_outputs(items, on_host, tokenizer)
    assert [o.output_token_ids for o in on_host] == [o.output_token_ids for o in on_device]


def test_greedy_constrained_tokens_equal_transformers_float64_under_the_same_masks(model, tokenizer):
    transformers = pytest.importorskip("transformers")
    items = [(k, r) for k, r in workload(3, temperature=0.0) if k is not None][:8]
    outputs, _ = run(model, items, async_scheduling=True, dtype="float64")
    hf = transformers.LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float64).eval()
    compiler = GrammarCompiler(f"{model}/tokenizer.json", vocab_size=hf.config.vocab_size, eos_token_ids=[2])
    for (kind, request), output in zip(items, outputs, strict=True):
        matcher = compiler.matcher(CONSTRAINTS[kind].params)
        ids, expected = list(request.prompt_token_ids), []
        while len(expected) < MAX_TOKENS:
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1].double()  # [V]
            allowed = torch.from_numpy(compiler.bitmask([matcher]))  # [1, W]
            token = int(logits.masked_fill(~allowed_tokens(allowed, logits.shape[0])[0], float("-inf")).argmax())
            assert matcher.consume_token(token)
            expected.append(token)
            ids.append(token)
            if token == 2:
                break
        assert output.output_token_ids == expected, request.request_id
        CONSTRAINTS[kind].check(tokenizer.decode(expected))


def constrained_lines(items) -> list[dict]:
    """The workload as `generate` JSONL lines (structured_outputs as vLLM's fields)."""
    lines = []
    for kind, request in items:
        p = request.sampling_params
        line = {"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids}
        line |= {"max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed}
        if kind is not None:
            so = CONSTRAINTS[kind].params
            line["structured_outputs"] = {so.kind: list(so.choice) if so.choice else getattr(so, so.kind)}
        lines.append(line)
    return lines


def run_cli(folder: Path, model: str, items) -> tuple[list[dict], list[dict]]:
    """`generate` in its own process, async, traced: its output lines and its trace."""
    folder.mkdir()
    prompts, trace, out = folder / "in.jsonl", folder / "trace.ndjson", folder / "out.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in constrained_lines(items)), encoding="utf-8")
    flags = ["--model", model, "--trace", trace, "--no-progress"]
    flags += config_flags(**{k: v for k, v in ENGINE.items()}, async_scheduling=True)
    proc = subprocess.run(generate_argv(prompts, out, *flags), cwd=folder, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a request failed
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    return outputs, read_trace(trace)


def test_every_mask_of_a_real_run_was_built_from_the_grammar_after_the_previous_token(model, tmp_path):
    """FreshMaskInv, checked in Python (`stale_masks`), on the trace of a real async run. The spec's
    MCMaskBeforeInFlightToken run for real (a source mutant whose deferred mask is built before the
    step in flight is applied: stale masks, tokens its grammars reject) is model_check's
    test_trace_of_a_constrained_run_is_a_behaviour_of_the_spec_and_a_stale_mask_fails_it, by TLC."""
    items = workload(5, temperature=1.0)[:40]
    outputs, trace = run_cli(tmp_path / "engine", model, items)
    masks = [e for e in trace if e["event"] == "mask"]
    assert {e["state"] for e in trace if e["event"] == "launch"} == {"SampleInProgram", "SampleDeferred"}
    assert masks and stale_masks(trace) == []
    assert all(o["finish_reason"] == "stop" for (kind, _), o in zip(items, outputs, strict=True) if kind is not None)


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        ({"json": {"type": "object", "properties": 5}}, r"^structured_outputs\.json: .*properties must be an object"),
        ({"regex": "(ab"}, r"^structured_outputs\.regex: "),
        ({"grammar": "start: missing_rule"}, r"^structured_outputs\.grammar: "),
        ({"choice": []}, r"^structured_outputs\.choice: must not be empty"),
        ({"regex": "a", "choice": ["a"]}, r"^structured_outputs: exactly one of json, regex, choice, grammar"),
        ({"jsn": {}}, r"^structured_outputs: unknown field\(s\) \['jsn'\]"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(model, structured, message):
    with LLM(model, **ENGINE) as llm:
        with pytest.raises(InvalidRequestError, match=message):
            llm.add_request([1, 5], SamplingParams(structured_outputs=structured))
        # The engine goes on: the next request (constrained too) is served.
        [ok] = llm.generate(
            [PromptRequest([1, 5], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs={"json": PERSON}))]
        )
        assert ok.finish_reason == "stop"


def test_a_model_without_a_tokenizer_refuses_a_grammar():
    with LLM("tiny-llama", device="cpu-inprocess", max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError, match=r"^structured_outputs\.regex: the model has no tokenizer.json"):
            llm.add_request([1, 5], SamplingParams(structured_outputs={"regex": "a+"}))


def test_the_device_mask_is_llguidances_bit_layout():
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = rng.integers(-(2**31), 2**31, size=(5, 3), dtype=np.int64).astype(np.int32)  # [B, W]
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, bitmask)
    got = apply_token_bitmask(torch.from_numpy(logits), torch.from_numpy(bitmask))
    assert torch.equal(got, torch.from_numpy(expected))


def test_a_masked_token_is_never_sampled_at_any_temperature():
    vocab, rows = 100, 64
    logits = torch.randn(rows, vocab, dtype=torch.float64) * 5
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[torch.arange(rows), torch.randint(0, vocab, (rows,))] = True
    allowed[: rows // 2, 7] = True  # half the rows allow two tokens
    words = torch.zeros(rows, 4, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    for temperature in (0.0, 1.0, 5.0):
        tokens = sample_tokens(
            apply_token_bitmask(logits, bitmask),
            temperature=torch.full((rows,), temperature),
            top_k=torch.zeros(rows, dtype=torch.int32),
            top_p=torch.ones(rows),
            seeds=torch.arange(rows),
            output_index=torch.zeros(rows, dtype=torch.int64),
        )
        assert allowed[torch.arange(rows), tokens].all(), temperature


def test_structured_outputs_params_take_vllms_fields():
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    assert as_structured_outputs({"json": True}) == StructuredOutputsParams(json=True)


def test_bench_constrains_the_fraction_asked_spread_over_the_workload():
    from neuron_async_sm.bench.workloads import BENCH_CONSTRAINTS, build_workload, with_constraints

    workload = build_workload("steady", num_requests=16, vocab_size=320)
    for fraction, expected in ((0.0, 0), (0.25, 4), (1.0, 16)):
        requests = with_constraints(workload, fraction).requests
        constrained = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs is not None]
        assert len(constrained) == expected
        assert all(not requests[i].sampling_params.ignore_eos for i in constrained)  # they stop at EOS
    assert [
        i for i, r in enumerate(with_constraints(workload, 0.25).requests) if r.sampling_params.structured_outputs
    ] == [3, 7, 11, 15]
    assert len(BENCH_CONSTRAINTS) == 3
    with pytest.raises(ValueError, match="constrained_fraction"):
        with_constraints(workload, 1.5)
