"""Structured output under speculation (docs/structured-output.md, docs/spec-decode.md §12): the
scheduler cuts a masked request's drafts (n-gram's, or the ones draft_model's drafter proposed on the
device, read home with the request's run) to their grammar-valid prefix and builds one mask row per
verified position; constrained outputs satisfy their grammars, async equals sync (seeded, temperature
1.0), greedy equals no speculation, with masked and unmasked requests in one batch.

The model is test_structured_output.py's random Llama over a trained byte-level BPE: its JSON, regex,
choice and Lark outputs repeat their own syntax, so n-gram lookup proposes drafts the grammar both
accepts and rejects. The draft model is a noisy copy of it: its drafts follow the target's unmasked
argmax, which the strict grammars mostly reject (cut, on purpose) and the loose regex (`LOOSE`) mostly
accepts.
"""

from __future__ import annotations

import random

import pytest
from support.grammar_model import CONSTRAINTS, VOCAB_SIZE, Constraint, write_json_model
from tokenizers import Tokenizer

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import write_noisy_copy
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.structured_output import GrammarCompiler, StructuredOutputsParams

llguidance = pytest.importorskip("llguidance")

ENGINE = dict(device="cpu-inprocess", max_model_len=160, max_num_seqs=8, decode_buckets=(1, 2, 4, 8))
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# Most of the random model's tokens fit it: a masked request whose drafts are mostly accepted.
LOOSE = Constraint(StructuredOutputsParams(regex="[^\\n{}]{8,40}"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_json_model(tmp_path_factory.mktemp("json-model")))


@pytest.fixture(scope="module")
def draft(model, tmp_path_factory) -> str:
    """The target plus 1% noise: its drafts are the target's unmasked argmax, which a grammar often forbids."""
    return str(write_noisy_copy(model, tmp_path_factory.mktemp("draft"), 0.01))


def draft_model(draft: str, k: int) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_file(f"{model}/tokenizer.json")


def workload(
    seed: int, temperature: float, constrained: int = 15, free: int = 5, loose: int = 0
) -> list[tuple[Constraint | None, PromptRequest]]:
    rng = random.Random(seed)
    kinds = [CONSTRAINTS[i % len(CONSTRAINTS)] for i in range(constrained)] + [LOOSE] * loose + [None] * free
    rng.shuffle(kinds)
    items = []
    for i, kind in enumerate(kinds):
        prompt = [1, *rng.choices(range(3, 300), k=rng.randint(1, 12))]
        params = SamplingParams(
            max_tokens=120 if kind is not None else rng.randint(1, 60),
            temperature=temperature,
            seed=seed * 1000 + i,
            structured_outputs=kind.params if kind is not None else None,
        )
        items.append((kind, PromptRequest(prompt, params, f"r{i}")))
    return items


def run(model: str, items, **config) -> tuple[list, dict]:
    with LLM(model, **{**ENGINE, **config}) as llm:
        return llm.generate([request for _, request in items]), llm.stats()


def check_outputs(items, outputs, tokenizer) -> None:
    for (kind, _), output in zip(items, outputs, strict=True):
        if kind is None:
            continue
        assert output.finish_reason == "stop", (output.request_id, output.finish_reason, output.error)
        kind.check(tokenizer.decode(output.output_token_ids))


def test_seeded_constrained_outputs_satisfy_their_grammars_and_async_equals_sync_under_speculation(model, tokenizer):
    items = workload(3, temperature=1.0)
    sync, sync_stats = run(model, items, async_scheduling=False, speculative_config=NGRAM)
    check_outputs(items, sync, tokenizer)
    outputs, stats = run(model, items, async_scheduling=True, speculative_config=NGRAM)
    check_outputs(items, outputs, tokenizer)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in sync]
    for spec in (sync_stats["spec_decode"], stats["spec_decode"]):
        assert spec["num_accepted_tokens"] > 0, spec
    # Masks built when scheduled: a masked request waits for its step in flight, so none is deferred.
    assert stats["launch_counts"]["SampleInProgram"] > 0 and stats["deferred_steps"] == 0, stats


def test_greedy_constrained_outputs_under_speculation_equal_those_without(model, tokenizer):
    items = workload(5, temperature=0.0)
    plain, _ = run(model, items, async_scheduling=True)
    outputs, stats = run(model, items, async_scheduling=True, speculative_config=NGRAM)
    check_outputs(items, outputs, tokenizer)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in plain]
    assert stats["spec_decode"]["num_accepted_tokens"] > 0, stats["spec_decode"]


def test_drafts_are_cut_to_the_grammar_valid_prefix_and_the_mask_rows_follow_them(model, tokenizer):
    """Row j of a spec row's mask is the grammar after its first j drafts; a draft the grammar rejects
    ends the drafts; the matcher is left where it was."""
    compiler = GrammarCompiler(f"{model}/tokenizer.json", vocab_size=VOCAB_SIZE, eos_token_ids=[2])
    matcher = compiler.matcher({"choice": ["yes", "no"]})
    [yes] = tokenizer.encode("yes").ids
    valid, rows = compiler.draft_bitmask(matcher, [yes, yes, 7], 4)
    assert valid == [yes]  # nothing may follow "yes" but EOS
    assert rows.shape == (4, compiler.words)
    assert (rows[0] == compiler.bitmask([matcher])[0]).all()  # the grammar as it is
    allowed = [t for t in range(VOCAB_SIZE) if rows[1].view("uint32")[t // 32] >> (t % 32) & 1]
    assert allowed == [2]  # after "yes": EOS only
    assert (rows[2:] == -1).all()  # past the bonus position: nothing emitted, every token allowed
    assert matcher.validate_tokens([yes]) == 1  # rolled back: "yes" is still next


# -- draft_model: drafts proposed on the device, cut on the host ---------------------------------------


@pytest.fixture(scope="module")
def greedy_items() -> list:
    return workload(5, temperature=0.0, constrained=6, free=3, loose=2)


@pytest.fixture(scope="module")
def greedy_plain(model, greedy_items) -> list[list[int]]:
    return [o.output_token_ids for o in run(model, greedy_items, async_scheduling=True)[0]]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_constrained_outputs_under_draft_model_equal_those_without(
    model, draft, tokenizer, greedy_items, greedy_plain, k
):
    """Masked and unmasked requests in one batch, async and sync: the tokens of no speculation. The
    strict grammars cut most drafts (some rows verify fewer than k, or none), the loose one accepts some."""
    for async_scheduling in (True, False):
        outputs, stats = run(
            model, greedy_items, async_scheduling=async_scheduling, speculative_config=draft_model(draft, k)
        )
        check_outputs(greedy_items, outputs, tokenizer)
        assert [o.output_token_ids for o in outputs] == greedy_plain, async_scheduling
        spec = stats["spec_decode"]
        assert spec["num_accepted_tokens"] > 0, spec
        if k > 1:  # only a cut leaves a row with fewer than k drafts here (max_model_len is far)
            assert spec["num_draft_tokens"] < k * spec["num_spec_rows"], spec


def test_seeded_constrained_outputs_under_draft_model_satisfy_their_grammars_and_async_equals_sync(
    model, draft, tokenizer
):
    """Every request masked, at temperature 1.0: every draft verified is a masked request's, and some are
    accepted under its grammar's mask rows."""
    items = workload(3, temperature=1.0, constrained=5, free=0, loose=3)
    sync, _ = run(model, items, async_scheduling=False, speculative_config=draft_model(draft, 3))
    check_outputs(items, sync, tokenizer)
    outputs, stats = run(model, items, async_scheduling=True, speculative_config=draft_model(draft, 3))
    check_outputs(items, outputs, tokenizer)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in sync]
    assert stats["spec_decode"]["num_accepted_tokens"] > 0, stats["spec_decode"]


def test_a_dead_end_under_speculation_finishes_its_request_with_the_error_naming_it(model, tokenizer):
    """A choice of one token whose grammar can then only end, while min_tokens holds EOS back: the
    prompt repeats that token, so n-gram drafts it again; the request ends with the error after its one
    token, async as sync, and the others are unharmed."""
    [yes] = tokenizer.encode("yes").ids
    params = SamplingParams(
        max_tokens=20, temperature=1.0, seed=1, min_tokens=4, structured_outputs={"choice": ["yes"]}
    )
    items = [
        *workload(9, temperature=1.0, constrained=5, free=2),
        (None, PromptRequest([1, yes, yes, yes], params, "dead")),
    ]
    sync, _ = run(model, items, async_scheduling=False, speculative_config=NGRAM)
    outputs, _ = run(model, items, async_scheduling=True, speculative_config=NGRAM)
    assert [(o.output_token_ids, o.finish_reason, o.error) for o in outputs] == [
        (o.output_token_ids, o.finish_reason, o.error) for o in sync
    ]
    dead = outputs[-1]
    assert dead.finish_reason == "error" and "min_tokens=4 holds back" in dead.error, (dead.finish_reason, dead.error)
    assert dead.output_token_ids == [yes]
    check_outputs(items[:-1], outputs[:-1], tokenizer)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_masked_request_alone_under_speculation_waits_for_its_mask_and_async_equals_sync(
    model, draft, tokenizer, method
):
    """Alone, a masked request's step is followed by an empty one (it waits for its step in flight), so
    its next step finds its own step pending: the machine defers the sampling (SampleDeferred) and the
    spec program, which samples in verification, is enqueued with the mask the engine core builds at once."""
    spec = NGRAM if method == "ngram" else draft_model(draft, 3)
    short = Constraint(StructuredOutputsParams(regex="[^\\n{}]{4,12}"))
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_outputs=short.params)
    items = [(short, PromptRequest([1, 40, 41, 40, 41], params, "alone"))]
    sync, _ = run(model, items, async_scheduling=False, speculative_config=spec)
    outputs, stats = run(model, items, async_scheduling=True, speculative_config=spec)
    check_outputs(items, outputs, tokenizer)
    assert outputs[0].output_token_ids == sync[0].output_token_ids
    assert stats["deferred_steps"] > 0 and stats["spec_decode"]["num_draft_tokens"] > 0, stats
