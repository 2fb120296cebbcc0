"""Speculative decoding (n-gram): greedy tokens equal tokens without it, seeded async equals sync, stops
inside an accepted run end the output exactly there, speculation off near max_model_len.

The target is a checkpoint whose layers add little to the residual stream (`write_checkpoint`'s
`layer_scale`): its greedy output soon repeats, so n-gram drafts are accepted in runs, while attention
over the context still moves the logits (a KV entry read where it must not be changes tokens).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
import torch
from support.workloads import SPEC_ENGINE, assert_matches, drive, drive_batches, greedy, workloads

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.config import ConfigError, EngineConfig
from neuron_async_sm.model.sampler import sample_tokens
from neuron_async_sm.model.spec_decode import rejection_sample
from neuron_async_sm.outputs import ModelRunnerOutput
from neuron_async_sm.request import Request
from neuron_async_sm.scheduler import Scheduler
from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.drafts import propose_ngram

ENGINE = SPEC_ENGINE


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("repetitive"), layer_scale=0.02))


# -- units ----------------------------------------------------------------------------------------


def test_propose_ngram_takes_the_longest_suffix_at_its_latest_earlier_occurrence():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 1, 3) == [7, 5]  # latest of two matches
    assert propose_ngram([4, 2, 3, 8, 1, 3], 3, 1, 4) == [8, 1, 3]  # only the 1-gram "3" recurs
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []  # nothing recurs
    assert propose_ngram([5, 5], 4, 1, 4) == [5]  # the continuation may overlap the suffix
    assert propose_ngram([1, 2, 1, 3, 1, 2], 2, 2, 2) == [1, 3]  # min = max = 2


def test_rejection_sample_greedy_accepts_the_longest_prefix_equal_to_the_argmax():
    vocab, width = 6, 4
    argmax = torch.tensor([[3, 1, 4, 2], [3, 1, 4, 2], [5, 0, 0, 0]])  # the target's choice at each position
    logits = torch.nn.functional.one_hot(argmax, vocab).double() * 5.0  # [3, W, vocab]
    drafts = torch.tensor([[3, 1, 4, -1], [3, 0, 4, -1], [-1, -1, -1, -1]])
    out = rejection_sample(
        logits,
        drafts,
        temperature=torch.zeros(3),
        top_k=torch.zeros(3, dtype=torch.int32),
        top_p=torch.ones(3),
        seeds=torch.zeros(3, dtype=torch.int64),
        output_index=torch.tensor([7, 7, 0]),
    )
    assert out.tolist() == [
        [3, 1, 4, 2],  # all three accepted, then the bonus
        [3, 1, -1, -1],  # the second draft rejected: the target's token there, nothing after
        [5, -1, -1, -1],  # no drafts: the ordinary token
    ]
    assert width == out.shape[1]


def sampled_rows(rows: int, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sampling inputs for `rows` rows at temperature 1 (no top-k/top-p), seed = row, output index 3."""
    return dict(
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int32),
        top_p=torch.ones(rows),
        seeds=torch.arange(rows, dtype=torch.int64),
        output_index=torch.full((rows,), 3, dtype=torch.int64),
        **extra,
    )


def test_rejection_sample_draws_by_seed_and_output_index_and_keeps_the_target_distribution():
    """Sampled rows: no draft gives the ordinary sampler's token at every position; a draft is accepted
    about p(d) of the time; the same (seed, output index) always gives the same token."""
    torch.manual_seed(0)
    vocab, rows = 5, 4000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    logits = base.expand(rows, 2, vocab).clone()
    params = sampled_rows(rows)
    none = rejection_sample(logits, torch.full((rows, 2), -1), **params)
    plain = sample_tokens(logits[:, 0], **params)
    assert none[:, 0].tolist() == plain.tolist() and (none[:, 1] == -1).all()
    drafted = rejection_sample(logits, torch.tensor([[1, -1]]).expand(rows, 2), **params)
    assert torch.equal(drafted, rejection_sample(logits, torch.tensor([[1, -1]]).expand(rows, 2), **params))
    accepted = drafted[:, 1] >= 0  # a second token only when the draft was accepted
    p = torch.softmax(base, -1)
    assert abs(accepted.double().mean().item() - p[1].item()) < 0.03
    # The first token's distribution is the target's whether the draft is accepted or not.
    freq = torch.bincount(drafted[:, 0], minlength=vocab).double() / rows
    assert (freq - p).abs().max().item() < 0.03
    assert (drafted[~accepted, 0] != 1).all()  # a rejected draft is never the recovered token


def test_speculative_config_is_parsed_and_checked_naming_the_key():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config.num_speculative_tokens == 3 and config.speculative_config.width == 4
    for bad, key in [
        ({"method": "eagle"}, "method"),
        ({"method": "draft_model"}, "model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ]:
        with pytest.raises(ConfigError, match=f"speculative_config.{key}"):
            EngineConfig(speculative_config=bad)


def test_the_relay_switched_off_under_speculation_says_so_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="neuron_async_sm.config"):
        config = EngineConfig(speculative_config=ngram(2))  # the relay is on by default: a user asked for it
        assert not config.async_relay
        dataclasses.replace(config, max_num_seqs=4)  # validated again, the relay already off: no second line
        EngineConfig(async_relay=False, speculative_config=ngram(2))  # not asked for: nothing to say
        EngineConfig(async_scheduling=False, speculative_config=ngram(2))  # sync mode has no relay
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("async_relay: off with speculative_config"), lines


def test_a_request_that_processes_logits_is_accepted_under_speculation():
    """Verification processes each position's logits (tests/test_spec_decode_tp.py checks the tokens)."""
    config = EngineConfig(max_model_len=32, speculative_config=ngram(2))
    scheduler = Scheduler(config, eos_token_ids=(), vocab_size=100)
    for field, value in [("presence_penalty", 0.5), ("min_p", 0.1), ("min_tokens", 2), ("logit_bias", {5: 1.0})]:
        scheduler.add_request(Request(field, [1, 2], SamplingParams(**{field: value}), 0, 0))


# -- equality with no speculation ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(target):
    """Greedy tokens without speculation, sync: the reference every spec run must give."""
    batches = [greedy(items) for items in workloads(7, 4)]
    with LLM(target, async_scheduling=False, **ENGINE) as llm:
        return batches, drive_batches(llm, batches)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_tokens_with_speculation_equal_tokens_without(target, reference, k, async_scheduling):
    batches, expected = reference
    with LLM(target, async_scheduling=async_scheduling, speculative_config=ngram(k), **ENGINE) as llm:
        got = drive_batches(llm, batches)
        stats = llm.stats()
    for want, have in zip(expected, got, strict=True):
        assert have.tokens == want.tokens
        assert have.finish == want.finish
    spec = stats["spec_decode"]
    assert spec["num_accepted_tokens"] > spec["num_draft_tokens"] // 2  # runs were accepted, not only rejected
    if async_scheduling:  # every step with a pending future materializes first: drafts need the history
        counts = stats["state_counts"]
        assert counts[sm.HOST_DRAFT_BREAK] == stats["steps"] - counts[sm.NO_PENDING_FUTURE] > 0, counts
        assert stats["sync_fallback_steps"] == stats["steps"] and stats["async_steps"] == 0


def test_one_request_alone_gives_the_tokens_it_gives_batched(target, reference):
    batches, expected = reference
    items = batches[0]
    with LLM(target, async_scheduling=True, speculative_config=ngram(3), **ENGINE) as llm:
        for item in items:
            solo = drive(llm, [dataclasses.replace(item, arrival_turn=0)], aborts=False)
            assert solo.tokens[item.request_id] == expected[0].tokens[item.request_id]


def test_seeded_sampling_with_speculation_gives_the_same_tokens_async_and_sync(target):
    batches = workloads(11, 4)
    with (
        LLM(target, async_scheduling=False, speculative_config=ngram(3), **ENGINE) as sync_llm,
        LLM(target, async_scheduling=True, speculative_config=ngram(3), **ENGINE) as async_llm,
    ):
        for items in batches:
            want, got = drive(sync_llm, items, aborts=False), drive(async_llm, items, aborts=True)
            assert_matches(got, want, items)
        assert async_llm.stats()["spec_decode"]["num_accepted_tokens"] > 0


# -- stops inside an accepted run, on purpose --------------------------------------------------------------


def deltas_of(llm: LLM, prompt: list[int], params: SamplingParams) -> list[tuple[list[int], str | None]]:
    """One request alone, turn by turn: the tokens each delta brought, and its finish reason."""
    rid = llm.add_request(prompt, params)
    out = []
    while llm.has_unfinished_requests():
        out += [(list(d.new_token_ids), d.finish_reason) for d in llm.step() if d.request_id == rid]
    return out


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def repeating(target) -> tuple[list[int], list[int]]:
    """A prompt that carries its own greedy continuation (so that continuation repeats what the prompt
    ends with), and its greedy output without speculation: one sync run serves both modes below."""
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(target, async_scheduling=False, **ENGINE) as plain:
        prompt = PROMPT + [t for tokens, _ in deltas_of(plain, PROMPT, long) for t in tokens]
        return prompt, [t for tokens, _ in deltas_of(plain, prompt, long) for t in tokens]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_inside_an_accepted_run_ends_the_output_exactly_there(target, repeating, async_scheduling):
    """n-gram drafts copy the request's history, so a stop token inside a run must be one the outputs
    have not had yet: the prompt carries the continuation (the target's own greedy output, which then
    repeats), and a run's second token, new to the outputs, is the stop."""
    prompt, full = repeating
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(target, async_scheduling=async_scheduling, speculative_config=ngram(4), **ENGINE) as llm:
        runs = deltas_of(llm, prompt, long)
        assert [t for tokens, _ in runs for t in tokens] == full
        start, chosen = 0, None
        for tokens, _ in runs:
            if len(tokens) >= 3 and tokens[1] not in full[: start + 1]:
                chosen = tokens
                break
            start += len(tokens)
        assert chosen is not None, "no accepted run of three tokens: the workload does not test this"
        cut = start + 2  # outputs up to and including the run's second token
        for params, reason in [
            (SamplingParams(max_tokens=cut, ignore_eos=True), "length"),
            (SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(chosen[1],)), "stop"),
        ]:
            got = deltas_of(llm, prompt, params)
            assert [t for d, _ in got for t in d] == full[:cut], reason
            assert got[-1][1] == reason and len(got[-1][0]) >= 2  # it ended inside a run of several tokens
        assert llm.engine.scheduler.num_free_slots == ENGINE["max_num_seqs"]


NEAR_LIMIT = {**ENGINE, "max_model_len": 48}
UNCAPPED = SamplingParams(max_tokens=100, ignore_eos=True)  # max_model_len ends it


@pytest.fixture(scope="module")
def near_limit_plain(target) -> list[tuple[list[int], str | None]]:
    """PROMPT's deltas up to max_model_len without speculation (sync): the output both modes must give."""
    with LLM(target, async_scheduling=False, **NEAR_LIMIT) as plain:
        return deltas_of(plain, PROMPT, UNCAPPED)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_near_max_model_len_speculation_turns_off_and_the_output_ends_where_it_would(
    target, near_limit_plain, async_scheduling
):
    want = near_limit_plain
    with LLM(target, async_scheduling=async_scheduling, speculative_config=ngram(4), **NEAR_LIMIT) as llm:
        got = deltas_of(llm, PROMPT, UNCAPPED)
        scheduler = llm.engine.scheduler
        assert scheduler.num_accepted_tokens > 0
    assert [t for d, _ in got for t in d] == [t for d, _ in want for t in d]
    assert got[-1][1] == "length" and len([t for d, _ in got for t in d]) == 48 - len(PROMPT)
    assert len(got[-1][0]) == 1  # the last output came from a plain row: speculation was off by then


def test_seeded_sampling_near_max_model_len_gives_the_same_tokens_async_and_sync(target, repeating):
    """Speculation turns off at the same output in both modes: async knows that output only as a range
    while a row is in flight, and a seeded position verified against a draft draws another token than a
    plain one. The prompt carries its continuation, so drafts are accepted up to the switch."""
    prompt, _ = repeating
    near = {**ENGINE, "device": "cpu-inprocess", "max_model_len": len(prompt) + 16}
    with (
        LLM(target, async_scheduling=False, speculative_config=ngram(3), **near) as sync_llm,
        LLM(target, async_scheduling=True, speculative_config=ngram(3), **near) as async_llm,
    ):
        for seed in (0, 1):
            params = SamplingParams(max_tokens=100, temperature=0.5, seed=seed, ignore_eos=True)
            want, got = deltas_of(sync_llm, prompt, params), deltas_of(async_llm, prompt, params)
            assert [t for d, _ in got for t in d] == [t for d, _ in want for t in d], seed
            assert got[-1][1] == want[-1][1] == "length"
            starts = itertools.accumulate((len(d) for d, _ in want), initial=0)
            # sync accepted drafts in a row starting at n >= room - 2 - 2k: where async, counting
            # the row in flight as all accepted (U <= n + 1 + k), would have turned speculation off
            assert any(len(d) > 1 and n >= 16 - 2 - 2 * 3 for (d, _), n in zip(want, starts, strict=False)), want


def test_the_scheduler_reserves_one_plus_k_and_turns_speculation_off_for_good():
    """Two steps in flight (async): placeholders are reconciled with each run; a spec row needs its
    first output n with n + k <= room - 1, so while U = outputs + placeholders says no but the fewest
    outputs the rows in flight give say yes, the request waits for the reconcile (the switch falls at
    sync mode's n); once n is past, its rows are plain for good."""
    config = EngineConfig(max_model_len=22, max_num_seqs=1, speculative_config=ngram(4))
    scheduler = Scheduler(config, eos_token_ids=(), vocab_size=100)
    request = Request("r", list(range(1, 9)), SamplingParams(max_tokens=50), 0, 0)  # room 14
    scheduler.add_request(request)

    def apply(step, run):
        output = ModelRunnerOutput(step.step_id, ["r"], [run[0]], [run])
        return scheduler.update_from_output(step, output)

    def invariant():
        held = len(request.output_token_ids) + request.num_output_placeholders
        assert request.num_computed_tokens - request.num_output_placeholders == 8 + len(request.output_token_ids) - 1
        return held

    s0 = scheduler.schedule()  # the prompt
    s1 = scheduler.schedule()
    assert s1.num_scheduled_tokens == {"r": 5} and s1.num_draft_tokens == {"r": 4}
    apply(s0, [50])
    assert invariant() == 1 + 5
    s2 = scheduler.schedule()  # U = 6: 6 + 4 <= 13
    assert s2.num_scheduled_tokens == {"r": 5}
    apply(s1, [51, 52, 53, 54, 55])  # every draft accepted
    assert invariant() == 6 + 5
    assert scheduler.schedule().is_empty  # U = 11: 11 + 4 > 13, but n >= 7 and 7 + 4 <= 13: wait
    apply(s2, [56])  # every draft rejected: n = 7 exactly
    assert invariant() == 7
    s3 = scheduler.schedule()
    assert s3.num_scheduled_tokens == {"r": 5}, "n = 7 fits a spec row, as in sync mode"
    apply(s3, [57, 58, 59, 60, 61])
    assert invariant() == 12
    s4 = scheduler.schedule()  # n = 12: 12 + 4 > 13, off
    assert s4.num_scheduled_tokens == {"r": 1} and not s4.num_draft_tokens
    s5 = scheduler.schedule()
    assert s5.num_scheduled_tokens == {"r": 1}, "speculation came back after it was turned off"
    steps, outputs = [s4, s5], 12
    while steps:
        outputs += 1
        apply(steps.pop(0), [60 + outputs])
        invariant()
        if not request.is_finished:
            nxt = scheduler.schedule()
            if nxt.num_scheduled_tokens:
                assert nxt.num_scheduled_tokens == {"r": 1}
                steps.append(nxt)
    assert request.finish_reason.value == "length" and len(request.output_token_ids) == 14
    assert request.num_output_placeholders == 0
