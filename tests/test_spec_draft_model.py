"""Speculative decoding with a draft model (docs/spec-decode.md §1, §2, §8): greedy tokens equal tokens
without it and transformers' assisted generation, seeded async equals sync, and a draft equal to the
target has every draft accepted (so the drafter's KV, positions and q are exactly right).

The target is the repetitive checkpoint of test_spec_decode.py; the high-acceptance draft is a copy
of it with noise added to every weight (`write_noisy_copy`), the low-acceptance one independently
seeded weights with the same vocabulary.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from support.workloads import (
    SPEC_ENGINE,
    WorkItem,
    assert_matches,
    drive,
    drive_batches,
    greedy,
    random_workload,
    workloads,
)

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint, write_noisy_copy
from neuron_async_sm.config import ConfigError, EngineConfig
from neuron_async_sm.model.spec_decode import rejection_sample
from neuron_async_sm.worker import async_machine as sm

ENGINE = SPEC_ENGINE
HIGH_NOISE = 0.01  # the high-acceptance draft's noise, relative to each weight's standard deviation


def draft_model(model: str, k: int) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("target"), layer_scale=0.02))


@pytest.fixture(scope="module")
def close_draft(target, tmp_path_factory) -> str:
    return str(write_noisy_copy(target, tmp_path_factory.mktemp("close"), HIGH_NOISE))


@pytest.fixture(scope="module")
def far_draft(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("far"), seed=5, layer_scale=0.02))


# -- configuration --------------------------------------------------------------------------------


def test_draft_model_config_is_checked_naming_speculative_config_model(target, tmp_path):
    with pytest.raises(ConfigError, match="speculative_config.model: method 'draft_model' needs"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="speculative_config.model: only method 'draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": target})
    other_vocab = write_checkpoint(tmp_path / "vocab", MICRO_LLAMA_CONFIG)
    short = dict(json_config(target), max_position_embeddings=64)
    for bad, reason in [
        (str(tmp_path / "missing"), "neither"),
        (str(other_vocab), "vocab_size"),
        (str(write_checkpoint(tmp_path / "short", short)), "max_position_embeddings"),
    ]:
        with pytest.raises(ConfigError, match=f"speculative_config.model: .*{reason}"):
            LLM(target, speculative_config=draft_model(bad, 2), **ENGINE)


def json_config(path: str) -> dict:
    import json  # noqa: PLC0415

    with open(f"{path}/config.json", encoding="utf-8") as f:
        return json.load(f)


# -- verification with the drafter's q ---------------------------------------------------------------


def test_rejection_sample_with_q_keeps_the_target_distribution():
    """Drafts drawn from q, accepted with min(1, p/q), else resampled from max(p - q, 0): the first
    token is distributed as p, and a draft is accepted with probability sum(min(p, q))."""
    vocab, rows = 5, 6000
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64), -1)
    q = torch.softmax(torch.tensor([0.0, 1.5, 0.5, 1.0, 0.0], dtype=torch.float64), -1)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(rows, vocab), 1, generator=gen)[:, 0]  # d ~ q
    logits = torch.log(p).expand(rows, 2, vocab).clone()
    probs = torch.stack([q.expand(rows, vocab), torch.ones(rows, vocab, dtype=torch.float64)], 1)  # [B, 2, vocab]
    out = rejection_sample(
        logits,
        torch.stack([drafts, torch.full((rows,), -1)], 1),
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int32),
        top_p=torch.ones(rows),
        seeds=torch.arange(rows, dtype=torch.int64),
        output_index=torch.full((rows,), 3, dtype=torch.int64),
        draft_probs=probs,
    )
    accepted = out[:, 1] >= 0
    assert abs(accepted.double().mean().item() - torch.minimum(p, q).sum().item()) < 0.03
    freq = torch.bincount(out[:, 0], minlength=vocab).double() / rows
    assert (freq - p).abs().max().item() < 0.03


# -- equality with no speculation ---------------------------------------------------------------------


# A steady batch: three requests that arrive together and run long, none near max_model_len.
STEADY = [
    WorkItem(f"s{i}", [5 + i, 17, 3 + i, 99, 42, 8 + i], SamplingParams(max_tokens=100, ignore_eos=True), 0)
    for i in range(3)
]


@pytest.fixture(scope="module")
def reference(target):
    """Greedy tokens without speculation, sync: the reference every spec run must give. The last
    batch is the steady one."""
    batches = [*(greedy(items) for items in workloads(7, 2)), greedy(STEADY)]
    with LLM(target, async_scheduling=False, **ENGINE) as llm:
        return batches, drive_batches(llm, batches)


# k = 1..4 in each mode but sync k = 2: every pair would double the file's time for little more coverage.
@pytest.mark.parametrize(
    ("k", "async_scheduling"),
    [(1, False), (2, True), (3, False), (4, True), (1, True)],
    ids=["sync-1", "async-2", "sync-3", "async-4", "async-1"],
)
def test_greedy_tokens_with_a_draft_model_equal_tokens_without(target, close_draft, reference, k, async_scheduling):
    """Churny workloads, then the steady batch; async, the steady batch's decode steps take SpecSteady
    nine times in ten (docs/spec-decode.md §7: next_input is the next input, on the device)."""
    batches, expected = reference
    with LLM(
        target, async_scheduling=async_scheduling, speculative_config=draft_model(close_draft, k), **ENGINE
    ) as llm:
        got = drive_batches(llm, batches[:-1])
        before = dict(llm.stats().get("state_counts", {}))
        got.append(drive(llm, batches[-1], aborts=False))
        stats = llm.stats()
    spec = stats["spec_decode"]
    for want, have in zip(expected, got, strict=True):
        assert have.tokens == want.tokens
        assert have.finish == want.finish
    # The high-acceptance draft: most drafts are accepted (a drafter whose KV or positions were off
    # would agree with the target far less often).
    assert spec["num_accepted_tokens"] >= 0.85 * spec["num_draft_tokens"] > 0, spec
    if async_scheduling:
        steady = {s: n - before.get(s, 0) for s, n in stats["state_counts"].items() if n > before.get(s, 0)}
        decode_steps = sum(steady.values()) - 1  # the first step is the batch's prefill
        assert steady.get(sm.SPEC_STEADY, 0) >= 0.9 * decode_steps, steady
        assert sm.STEADY not in steady and sm.HOST_DRAFT_BREAK not in steady, steady


def test_a_draft_equal_to_the_target_has_every_draft_accepted(target, reference):
    """Greedy and seeded sampling: q equals p, so min(1, p/q) = 1 and every draft is accepted. A
    drafter reading a stale KV entry, a wrong position or another slot's q rejects some."""
    batches, _ = reference
    sampled = [dataclasses.replace(w, params=dataclasses.replace(w.params, temperature=0.8)) for w in batches[0]]
    with LLM(target, async_scheduling=True, speculative_config=draft_model(target, 3), **ENGINE) as llm:
        drive_batches(llm, [batches[0], sampled])
        spec = llm.stats()["spec_decode"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0, spec


def test_one_request_alone_gives_the_tokens_it_gives_batched(target, close_draft, reference):
    batches, expected = reference
    with LLM(target, async_scheduling=True, speculative_config=draft_model(close_draft, 3), **ENGINE) as llm:
        for item in batches[0]:
            solo = drive(llm, [dataclasses.replace(item, arrival_turn=0)], aborts=False)
            assert solo.tokens[item.request_id] == expected[0].tokens[item.request_id]


def test_seeded_sampling_with_a_draft_model_gives_the_same_tokens_async_and_sync(target, far_draft):
    """The low-acceptance draft: rejections, so the residual max(p - q, 0) is drawn often. The second
    workload has penalties, logit_bias, min_tokens and min_p: async, a SpecSteady row's history counts
    and output index come from the device's positions (slot_len), sync's from the host's."""
    batches = [workloads(11, 1)[0], random_workload(random.Random(12), "p", processing=True)]
    spec = draft_model(far_draft, 3)
    with (
        LLM(target, async_scheduling=False, speculative_config=spec, **ENGINE) as sync_llm,
        LLM(target, async_scheduling=True, speculative_config=spec, **ENGINE) as async_llm,
    ):
        for items in batches:
            want, got = drive(sync_llm, items, aborts=False), drive(async_llm, items, aborts=True)
            assert_matches(got, want, items)
        counts, states = async_llm.stats()["spec_decode"], async_llm.stats()["state_counts"]
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
    assert states[sm.SPEC_STEADY] > 0, states


def test_seeded_sampling_under_a_tight_token_budget_gives_the_same_tokens_async_and_sync(target, close_draft):
    """Two spec rows do not fit the budget together. Async schedules the first request one step more
    (its end by max_tokens is in flight), where sync gives the second its whole row: a budget that cut
    drafts would verify the second's next positions against other drafts. A spec row runs whole."""
    spec = draft_model(close_draft, 4)
    tight = {**ENGINE, "device": "cpu-inprocess", "max_num_batched_tokens": 8, "prefill_buckets": (8,)}
    items = [
        WorkItem("a", [43, 419, 77], SamplingParams(max_tokens=27, temperature=0.3, seed=848, ignore_eos=True), 1),
        WorkItem("b", [120, 632, 604], SamplingParams(max_tokens=27, temperature=0.3, seed=584, ignore_eos=True), 4),
    ]
    with (
        LLM(target, async_scheduling=False, speculative_config=spec, **tight) as sync_llm,
        LLM(target, async_scheduling=True, speculative_config=spec, **tight) as async_llm,
    ):
        want, got = drive(sync_llm, items, aborts=False), drive(async_llm, items, aborts=False)
        assert_matches(got, want, items)
        assert async_llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    with pytest.raises(
        ConfigError, match="^max_num_batched_tokens: a spec row computes 1 \\+ num_speculative_tokens = 5"
    ):
        EngineConfig(max_num_batched_tokens=4, prefill_buckets=(4,), speculative_config=draft_model(target, 4))


def test_up_to_max_model_len_the_output_ends_where_it_would_without_speculation(target, close_draft):
    """Requests that fill their room: the drafter drafts only as far as max_model_len (a draft past it
    would be a position the program refuses) and the output ends where the plain run's does.

    Then the switch, built on purpose: with the target as its own draft every draft is accepted, so
    three requests of one prompt length advance in lockstep, and all turn speculation off at the same
    step (room - 1 is not a multiple of 1 + k): the steps after it take SpecExit, whose rows compute
    on next_input's first column, the last accepted token (docs/spec-decode.md §4)."""
    engine = {**ENGINE, "max_model_len": 40}
    prompts = [[5, 17, 3, 99, 42, 8, 11], [7, 300, 1], [64, 2, 9, 9, 13, 500, 31, 4, 77]]
    lockstep = [[5 + i, 17, 3, 99, 42, 8, 11, 6] for i in range(3)]  # room 32: 1 + 4n never reaches 31
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with LLM(target, async_scheduling=False, **engine) as plain:
        want = [(o.output_token_ids, o.finish_reason) for o in plain.generate(prompts, params)]
        want_lockstep = [o.output_token_ids for o in plain.generate(lockstep, params)]
    with LLM(target, async_scheduling=True, speculative_config=draft_model(close_draft, 4), **engine) as llm:
        got = [(o.output_token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
    assert got == want
    assert [len(tokens) for tokens, _ in got] == [40 - len(p) for p in prompts]
    with LLM(target, async_scheduling=True, speculative_config=draft_model(target, 3), **engine) as llm:
        got_lockstep = [o.output_token_ids for o in llm.generate(lockstep, params)]
        counts = llm.stats()["state_counts"]
    assert got_lockstep == want_lockstep
    assert counts[sm.SPEC_EXIT] >= 2 and counts[sm.SPEC_STEADY] > 0, counts


# -- transformers' assisted generation ------------------------------------------------------------------


def test_greedy_tokens_equal_transformers_assisted_generation(target, close_draft):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float64).eval()
    assistant = transformers.LlamaForCausalLM.from_pretrained(close_draft, torch_dtype=torch.float64).eval()
    prompts, new_tokens, k = [[5, 17, 3, 99, 42], [200, 13, 64, 81, 9, 33, 2, 150]], 12, 3
    expected = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            assistant_model=assistant,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(target, speculative_config=draft_model(close_draft, k), **ENGINE) as llm:
        got = [o.output_token_ids for o in llm.generate(prompts, params)]
    assert [list(g) for g in got] == expected


# -- the drafter, program level -------------------------------------------------------------------------


def test_the_drafter_proposes_its_own_continuation_of_the_accepted_tokens(target, far_draft):
    """Each step's next_input is the last accepted token, then the draft model's greedy continuation
    of the request's accepted tokens (as the draft model alone computes it), for two rows in one
    batch, with rejections (the low-acceptance draft); with temperature the kept q is the draft's
    softmax at that position. A drafter that kept the KV of rejected drafts, or read another slot's
    q, proposes other drafts."""
    from support.reference import RowStep, generate_alone, pack_step  # noqa: PLC0415

    from neuron_async_sm.model import ModelSpec, build_step_program  # noqa: PLC0415
    from neuron_async_sm.model.drafter import Drafter  # noqa: PLC0415
    from neuron_async_sm.model.spec_decode import SpecStepProgram  # noqa: PLC0415

    k, width = 3, 4

    def spec(model: str) -> ModelSpec:
        return ModelSpec(model, "float64", max_num_seqs=4, max_model_len=64)

    drafter = Drafter(build_step_program(spec(far_draft)), k)
    program = SpecStepProgram(build_step_program(spec(target)), width, drafter)
    alone = build_step_program(spec(far_draft))  # the reference: the draft model by itself
    prompts = {1: [5, 17, 3, 99, 42, 8], 3: [7, 300, 1, 64]}
    tokens = {slot: list(p) for slot, p in prompts.items()}  # accepted so far
    rows = [RowStep(tuple(p), 0, slot) for slot, p in prompts.items()]
    num_drafts = [0, 0]
    rejected = 0
    for _ in range(4):
        step = pack_step(rows, alone.scratch_slot)
        out = program(**step, num_drafts=torch.tensor(num_drafts, dtype=torch.int32))
        assert out.shape == (2, 2 * width)
        rows, num_drafts = [], []
        for slot, result in zip(prompts, out.tolist(), strict=True):
            run, next_input = [t for t in result[:width] if t >= 0], result[width:]
            rejected += width - len(run) if len(tokens[slot]) > len(prompts[slot]) else 0
            tokens[slot] += run
            want = generate_alone(alone, tokens[slot], k, slot=0)
            assert next_input == [tokens[slot][-1], *want], (slot, tokens[slot])
            rows.append(RowStep((tokens[slot][-1], *next_input[1:]), len(tokens[slot]) - 1, slot))
            num_drafts.append(k)
    assert rejected > 0  # rejections happened: the drafter's KV past them was rewritten

    # Sampled: q of the first draft after a fresh prefill is the draft model's softmax there.
    temperature = 0.7
    row = RowStep(tuple(prompts[1]), 0, 2, temperature=temperature, seed=4)
    out = program(**pack_step([row], alone.scratch_slot), num_drafts=torch.zeros(1, dtype=torch.int32))
    first = out[0, 0].item()
    context = [*prompts[1], first]
    logits = alone.forward_logits(
        **{
            n: v
            for n, v in pack_step([RowStep(tuple(context), 0, 0)], 4).items()
            if n in ("input_ids", "positions", "query_lens", "slot_ids")
        }
    )
    want = torch.softmax(logits[0].double() / temperature, -1)
    assert drafter.probs is not None and torch.allclose(drafter.probs[2, 0], want, atol=1e-12)


def test_rows_fed_from_next_input_at_slot_len_compute_what_exact_host_rows_compute(target, far_draft):
    """SpecSteady at program level: one program gets each row built on the host from the accepted
    tokens at their true positions; a twin gets the previous call's output as `drafted_input` with
    placeholder ids and the host's optimistic positions (every draft counted as accepted), and places
    the rows itself (slot_len). Seeded sampling, the low-acceptance draft (rejections): every call's
    tokens and next_input agree, so the twin's positions, output indices and KV are the true ones."""
    from support.reference import RowStep, pack_step  # noqa: PLC0415

    from neuron_async_sm.model import ModelSpec, build_step_program  # noqa: PLC0415
    from neuron_async_sm.model.drafter import Drafter  # noqa: PLC0415
    from neuron_async_sm.model.spec_decode import SpecStepProgram  # noqa: PLC0415

    k, width = 3, 4

    def program() -> SpecStepProgram:
        def spec(model: str) -> ModelSpec:
            return ModelSpec(model, "float64", max_num_seqs=4, max_model_len=64)

        return SpecStepProgram(build_step_program(spec(target)), width, Drafter(build_step_program(spec(far_draft)), k))

    exact, fed = program(), program()
    scratch = exact.program.scratch_slot
    prompts = {1: [5, 17, 3, 99, 42, 8], 3: [7, 300, 1, 64]}
    sampling = {1: dict(temperature=0.8, seed=4), 3: dict(temperature=0.0)}
    tokens = {slot: list(p) for slot, p in prompts.items()}  # accepted so far
    optimistic = {slot: len(p) for slot, p in prompts.items()}  # the host's position of the next row's x0
    rows = [RowStep(tuple(p), 0, slot, **sampling[slot]) for slot, p in prompts.items()]
    step = pack_step(rows, scratch)
    drafts = torch.zeros(2, dtype=torch.int32)
    out = exact(**step, num_drafts=drafts)
    fed_out = fed(**step, num_drafts=drafts)
    assert torch.equal(fed_out, out)
    rejected = 0
    for _ in range(5):
        exact_rows, fed_rows = [], []
        for slot, result in zip(prompts, out.tolist(), strict=True):
            run, next_input = [t for t in result[:width] if t >= 0], result[width:]
            rejected += width - len(run) if len(tokens[slot]) > len(prompts[slot]) else 0
            tokens[slot] += run
            at, host_at = len(tokens[slot]) - 1, optimistic[slot]
            index = {"output_index": at + 1 - len(prompts[slot])}  # the output index of x0's successor
            exact_rows.append(RowStep((next_input[0], *next_input[1:]), at, slot, **sampling[slot], **index))
            host_index = {"output_index": host_at + 1 - len(prompts[slot])}  # optimistic, as the host's
            fed_rows.append(RowStep((0,) * width, host_at, slot, **sampling[slot], **host_index))
            optimistic[slot] = host_at + width
        drafts = torch.full((2,), k, dtype=torch.int32)
        out = exact(**pack_step(exact_rows, scratch), num_drafts=drafts)
        fed_out = fed(**pack_step(fed_rows, scratch), num_drafts=drafts, drafted_input=fed_out)
        assert torch.equal(fed_out, out), (fed_out, out)
    assert rejected > 0  # positions diverged from the host's optimistic ones
