"""Speculative decoding, what tests/test_spec_decode.py leaves: at tensor_parallel_size=2 with n-gram
(the non-output rank builds its rows from the output rank's drafts and row starts) and with a draft
model (split over the same ranks as the target), against transformers' prompt lookup, a row in
flight past its request's end, and logits processing in verification.

Every TP=2 engine here is two real device processes in a gloo group, each with its shard; the
target is test_spec_decode's repetitive checkpoint, whose greedy output soon repeats so that n-gram
drafts are accepted in runs; the draft model is test_spec_draft_model's noisy copy of it.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from support.workloads import RunResult, WorkItem, assert_matches, drive, greedy, random_workload
from test_spec_decode import ENGINE, PROMPT, deltas_of, ngram, sampled_rows, target  # noqa: F401
from test_spec_draft_model import close_draft, draft_model  # noqa: F401

from neuron_async_sm import LLM, ConfigError, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.model import TINY_LLAMA_CONFIG
from neuron_async_sm.model.spec_decode import rejection_sample
from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.input_batch import POISON_TOKEN, InputBatch


@pytest.fixture(scope="module")
def churn(target):  # noqa: F811
    """A greedy churny workload (arrivals, chunked prompts, stops, aborts; most requests with logits
    processing) and its tokens at TP=1 without speculation, sync: the reference. Outputs long
    enough that the target's greedy output settles into a cycle, so that most rows verify drafts
    and most drafts are accepted."""
    rng = random.Random(7)
    items = [longer(item, rng) for item in random_workload(rng, "w0", max_prompt=40, processing=True)]
    with LLM(target, async_scheduling=False, **ENGINE) as llm:
        items, want = churned(llm, items)
        return [items], [want]


def longer(item, rng: random.Random, shortest: int = 20, longest: int = 80):
    params = dataclasses.replace(item.params, temperature=0.0, max_tokens=rng.randint(shortest, longest))
    return dataclasses.replace(item, params=params)


def churned(llm: LLM, items: list[WorkItem]) -> tuple[list[WorkItem], RunResult]:
    """`items` with a stop and an abort placed on purpose, and their tokens on `llm` (the reference).

    Random stop tokens rarely meet the target's cycling output, and random aborts land before a
    request's first token or after its end once speculation takes fewer steps: so the longest output
    stops at its first new token from output 4 on (past min_tokens), and the next longest is aborted
    six turns after it arrives (its output 60 long), mid-decode in every mode and k here.
    """
    want = drive(llm, items, aborts=False)
    longest = sorted(
        (w for w in items if want.finish[w.request_id] == "length"), key=lambda w: -len(want.tokens[w.request_id])
    )
    stopped, aborted = longest[0], longest[1]
    out = want.tokens[stopped.request_id]
    at = next(j for j in range(max(4, stopped.params.min_tokens), len(out)) if out[j] not in out[:j])
    stop = dataclasses.replace(stopped.params, stop_token_ids=(*stopped.params.stop_token_ids, out[at]))
    long = dataclasses.replace(aborted.params, max_tokens=max(aborted.params.max_tokens, 60))
    changed = {
        stopped.request_id: dataclasses.replace(stopped, params=stop),
        aborted.request_id: dataclasses.replace(aborted, params=long, abort_turn=aborted.arrival_turn + 6),
    }
    items = [changed.get(w.request_id, w) for w in items]
    want = drive(llm, items, aborts=False)
    assert (want.finish[stopped.request_id], len(want.tokens[stopped.request_id])) == ("stop", at + 1)
    return items, want


def check_tp2(llm: LLM, churn: tuple, accepted: float = 0.5) -> None:
    """`llm` (two ranks, speculating) gives the reference's tokens on churn; an aborted request a
    prefix; more than the share `accepted` of the drafts was accepted."""
    batches, expected = churn
    assert len(llm.engine.runtimes) == 2
    before = llm.stats()["spec_decode"]  # an engine shared between tests counts theirs too
    ends = set()
    for items, want in zip(batches, expected, strict=True):
        got = drive(llm, items, aborts=True)
        assert_matches(got, want, items)
        ends |= {got.finish[r] for r, tokens in got.tokens.items() if len(tokens) > 1}
    assert ends >= {"stop", "abort"}, f"no stop or no abort after a decode step: {ends}; the workload lost its churn"
    spec = {name: count - before[name] for name, count in llm.stats()["spec_decode"].items()}
    # Most rows verified drafts and most drafts were accepted: runs, not only rejections.
    assert spec["num_spec_rows"] > 10 and spec["num_accepted_tokens"] > accepted * spec["num_draft_tokens"], spec
    # The drafts came from the output rank's history: the other rank never brought a token to the host.
    output_rank, other = (runtime.stats().host_transfers for runtime in llm.engine.runtimes)
    assert output_rank > 0 and other == 0, (output_rank, other)


@pytest.mark.parametrize(
    ("async_scheduling", "k"),
    [(True, 1), (False, 2), (True, 3), (False, 4)],  # every k and both modes, in four engines of two ranks
    ids=["async-1", "sync-2", "async-3", "sync-4"],
)
def test_tp2_greedy_tokens_with_speculation_equal_tp1_tokens_without(request, target, churn, k, async_scheduling):  # noqa: F811
    if (async_scheduling, k) == (True, 3):
        check_tp2(request.getfixturevalue("ngram_tp2"), churn)
        return
    with LLM(
        target, tensor_parallel_size=2, async_scheduling=async_scheduling, speculative_config=ngram(k), **ENGINE
    ) as llm:
        check_tp2(llm, churn)


@pytest.fixture(scope="module")
def ngram_tp2(target):  # noqa: F811
    """An engine of two ranks, async, n-gram k = 3, shared by the test above and the solo test."""
    with LLM(target, tensor_parallel_size=2, async_scheduling=True, speculative_config=ngram(3), **ENGINE) as llm:
        yield llm


# -- draft_model at TP = 2 ------------------------------------------------------------------------------


# Finish and condense (tests/test_async_scenarios.py) with drafts in flight: b ends with its prefill, so
# the first decode step leaves it out (CompositionBreak); then it leaves the batch, condense() moves d
# into its row, and the next step has the same set in a new order: ReorderRemap of a drafted future.
CONDENSE = [
    WorkItem(name, [5 + i, 17, 3 + i, 99, 42, 8 + i], SamplingParams(max_tokens=1 if name == "b" else 20), 0)
    for i, name in enumerate("abcd")
]


@pytest.fixture(scope="module")
def draft_churn(target):  # noqa: F811
    """Greedy churny workloads without logits processing (which the target applies and the draft does
    not), so that the close draft's drafts are mostly accepted, then CONDENSE, and their tokens at
    TP=1 without speculation, sync: the reference."""
    rng = random.Random(6)  # ten requests
    items = [longer(item, rng, 12, 32) for item in random_workload(rng, "d0", max_prompt=30)]
    with LLM(target, async_scheduling=False, **ENGINE) as llm:
        items, want = churned(llm, items)
        return [items, greedy(CONDENSE)], [want, drive(llm, greedy(CONDENSE), aborts=False)]


@pytest.fixture(scope="module")
def drafting_tp2(target, close_draft):  # noqa: F811
    """Two engines of two ranks each, sync and async, with the close draft split over both ranks
    (k = 4), shared by the tests below: each engine is two device processes."""
    engine = dict(ENGINE, tensor_parallel_size=2, speculative_config=draft_model(close_draft, 4))
    with (
        LLM(target, async_scheduling=False, **engine) as sync_llm,
        LLM(target, async_scheduling=True, **engine) as async_llm,
    ):
        yield {False: sync_llm, True: async_llm}


# k = 1..4 over both modes; k = 3 (async) runs on Ray actors: tests/test_tensor_parallel_ray.py.
@pytest.mark.parametrize(
    ("async_scheduling", "k"),
    [(True, 1), (False, 2), (False, 4), (True, 4)],
    ids=["async-1", "sync-2", "sync-4", "async-4"],
)
def test_tp2_greedy_tokens_with_a_draft_model_equal_tp1_tokens_without(
    request,
    target,  # noqa: F811
    close_draft,  # noqa: F811
    draft_churn,
    async_scheduling,
    k,
):
    """The draft split over both ranks as the target is: the reference's tokens."""
    if k == 4:
        check_draft_tp2(request.getfixturevalue("drafting_tp2")[async_scheduling], draft_churn)
        return
    engine = dict(ENGINE, tensor_parallel_size=2, speculative_config=draft_model(close_draft, k))
    with LLM(target, async_scheduling=async_scheduling, **engine) as llm:
        check_draft_tp2(llm, draft_churn)


def check_draft_tp2(llm: LLM, draft_churn: tuple) -> None:
    """check_tp2 at the close draft's high acceptance (a rank drafting from its own vocabulary shard
    would propose drafts the target rejects). Async, steps fed each rank's own next_input on the
    device: as it is (SpecSteady), and permuted (CONDENSE's ReorderRemap: the non-output rank's
    program permutes its rows, so check_tp2 sees no transfer of that rank's)."""
    before = dict(llm.stats().get("state_counts", {}))
    check_tp2(llm, draft_churn, accepted=0.8)
    if llm.stats()["async_scheduling"]:
        after = llm.stats()["state_counts"]
        for path in (sm.SPEC_STEADY, sm.REORDER_REMAP):
            assert after[path] > before.get(path, 0), (path, after)


def spec_steady_steps(llm: LLM) -> int:
    """Steps that took SpecSteady (the executor checks that every rank took the same path)."""
    return llm.stats().get("state_counts", {}).get(sm.SPEC_STEADY, 0)


def test_tp2_seeded_sampling_with_a_draft_model_gives_the_same_tokens_async_and_sync(drafting_tp2):
    """Seeded and greedy requests (with logits processing) at TP = 2: every rank samples the drafts and
    keeps q the same way, so async gives sync's tokens, rejections and residual draws included."""
    items = random_workload(random.Random(11), "s", max_prompt=40, processing=True)
    before, steady = drafting_tp2[True].stats()["spec_decode"], spec_steady_steps(drafting_tp2[True])
    want = drive(drafting_tp2[False], items, aborts=False)
    got = drive(drafting_tp2[True], items, aborts=True)
    assert_matches(got, want, items)
    after = drafting_tp2[True].stats()["spec_decode"]
    accepted, drafted = (after[n] - before[n] for n in ("num_accepted_tokens", "num_draft_tokens"))
    assert 0 < accepted < drafted, (before, after)
    # Steps fed from each rank's own next_input: a rank whose drafts or q differed would diverge there.
    assert spec_steady_steps(drafting_tp2[True]) > steady


def test_tp2_seeded_sampling_with_ngram_gives_the_tokens_of_tp1_sync(target, ngram_tp2):  # noqa: F811
    """Seeded and greedy requests (with logits processing) on the shared async TP = 2 n-gram engine
    give a sync TP = 1 engine's tokens: the non-output rank builds its rows from the output rank's
    drafts, and every rank draws the same noise per (seed, position), so rejections, residual draws
    and bonus tokens agree (float64: the shards' sums differ from TP = 1's in the last bits only)."""
    rng = random.Random(13)
    items = [  # long enough to settle into cycles, the sampled ones at a low temperature (drafts get
        # accepted) and every one seeded (an unseeded draw depends on what the engine ran before)
        dataclasses.replace(w, params=dataclasses.replace(longer(w, rng).params, temperature=0.3 * (t > 0), seed=i))
        for i, (w, t) in enumerate(
            (w, w.params.temperature) for w in random_workload(rng, "n", max_prompt=40, processing=True)
        )
    ]
    before = ngram_tp2.stats()["spec_decode"]
    with LLM(target, async_scheduling=False, speculative_config=ngram(3), **ENGINE) as sync_tp1:
        want = drive(sync_tp1, items, aborts=False)
    got = drive(ngram_tp2, items, aborts=True)
    assert_matches(got, want, items)
    after = ngram_tp2.stats()["spec_decode"]
    accepted, drafted = (after[n] - before[n] for n in ("num_accepted_tokens", "num_draft_tokens"))
    assert 0 < accepted < drafted, (before, after)


# Each method on its shared async engine (n-gram k = 3, draft_model k = 4) with its churn.
SOLO = {"ngram": ("ngram_tp2", "churn"), "draft_model": ("drafting_tp2", "draft_churn")}


@pytest.mark.parametrize("method", SOLO)
def test_tp2_one_request_alone_gives_the_tokens_it_gives_batched(request, method):
    """Four of the churn's requests, each alone, give the reference's tokens (batched, TP=1, no
    speculation), as they do in the churn at TP=2: rows and rank shards of other sizes change nothing."""
    engine, (batches, expected) = (request.getfixturevalue(name) for name in SOLO[method])
    llm = engine[True] if method == "draft_model" else engine
    for item in batches[0][:4]:  # the others would add seconds, not cases
        solo = drive(llm, [dataclasses.replace(item, arrival_turn=0, abort_turn=None)], aborts=False)
        assert solo.tokens[item.request_id] == expected[0].tokens[item.request_id], item.request_id


def test_a_draft_that_does_not_split_over_the_ranks_is_refused_naming_speculative_config_model(target, tmp_path):  # noqa: F811
    odd = write_checkpoint(tmp_path / "odd", dataclasses.replace(TINY_LLAMA_CONFIG, intermediate_size=351))
    with pytest.raises(ConfigError, match=r"^speculative_config.model: the draft is split over .* intermediate_size"):
        LLM(target, tensor_parallel_size=2, speculative_config=draft_model(str(odd), 2), **ENGINE)


# -- against transformers' prompt lookup ---------------------------------------------------------------


def hf_prompt_lookup(model, prompt: list[int], max_new_tokens: int, k: int) -> list[int]:
    """transformers' greedy generate with prompt lookup decoding (its own n-gram drafter, k drafts)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        prompt_lookup_num_tokens=k,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_speculation_equals_transformers_prompt_lookup(target):  # noqa: F811
    """Both verify drafts greedily on the same float64 checkpoint; their lookups may pick other matches
    (transformers' takes the earliest occurrence of a suffix of at most 2 tokens, ours the latest of
    up to 4), which changes only what is accepted: the tokens are the greedy ones either way."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    rng, k = random.Random(3), 3
    prompts = [PROMPT, [rng.randrange(3, 1024) for _ in range(30)], [5, 6, 7, 8] * 6]
    expected = [hf_prompt_lookup(model, prompt, 32, k) for prompt in prompts]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(target, async_scheduling=True, speculative_config=ngram(k), **ENGINE) as llm:
        got = [out.output_token_ids for out in llm.generate(prompts, params)]
        spec = llm.stats()["spec_decode"]
    assert got == expected
    assert spec["num_accepted_tokens"] > 32, spec  # most tokens came in accepted runs


# -- a row in flight past max_tokens, and the slot its request frees --------------------------------------


def own_history(batch: InputBatch, continuations: dict[str, list[int]]) -> None:
    """Every request the worker holds has in its slot its prompt, then its own greedy tokens, then
    nothing (POISON_TOKEN): no token of the slot's previous owner survives."""
    with batch.lock:  # the output thread writes back under it
        for req_id, state in batch.requests.items():
            slot, held = state.kv_slot, int(batch.num_tokens[state.kv_slot])
            row = batch.token_ids[slot].tolist()
            assert row[: state.num_prompt_tokens] == state.prompt_token_ids, req_id
            outputs = row[state.num_prompt_tokens : held]
            assert outputs == continuations[req_id][: len(outputs)], req_id
            assert set(row[held:]) <= {POISON_TOKEN}, (req_id, "a previous owner's token in the slot")


def test_a_row_in_flight_past_a_stop_is_never_emitted_nor_left_in_its_recycled_slot(target, tmp_path):  # noqa: F811
    """Async, one KV slot: request A ends at an accepted run's second token (by max_tokens, then by a
    stop token), so the row of A scheduled while that run was in flight verifies drafts past A's
    end. That row's tokens are never emitted; B, queued behind A, takes A's slot at once (the device
    still runs A's row first) and gives its own tokens, with nothing of A in the slot's history."""
    engine = {**ENGINE, "max_num_seqs": 1}
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    other = [21, 22, 23, 24, 25, 26]
    with LLM(target, async_scheduling=False, **engine) as plain:
        lead = [t for tokens, _ in deltas_of(plain, PROMPT, long) for t in tokens]
        prompt = PROMPT + lead[:40]  # its greedy continuation repeats what the prompt ends with
        full = [t for tokens, _ in deltas_of(plain, prompt, long) for t in tokens]
        b_full = [t for tokens, _ in deltas_of(plain, other, long) for t in tokens]
    trace = tmp_path / "trace.ndjson"
    with LLM(target, async_scheduling=True, speculative_config=ngram(4), trace_path=str(trace), **engine) as llm:
        start, chosen = 0, None
        for tokens, _ in deltas_of(llm, prompt, long):
            if len(tokens) >= 3 and tokens[1] not in full[: start + 1]:  # a stop there ends A there
                chosen = tokens
                break
            start += len(tokens)
        assert chosen is not None, "no accepted run of three tokens: the workload does not test this"
        cut = start + 2  # A's last output is the run's second token
        ends = {
            "length": SamplingParams(max_tokens=cut, ignore_eos=True),
            "stop": SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=(chosen[1],)),
        }
        for reason, params in ends.items():
            a = llm.add_request(prompt, params)
            b = llm.add_request(other, SamplingParams(max_tokens=20, ignore_eos=True))
            got: dict[str, list[int]] = {a: [], b: []}
            while llm.has_unfinished_requests():
                for delta in llm.step():
                    got[delta.request_id] += delta.new_token_ids
                own_history(llm.engine.runner.batch, {a: full, b: b_full})
            assert got == {a: full[:cut], b: b_full[:20]}, reason
            events = [json.loads(line) for line in trace.read_text().splitlines()]
            materialized = [e for e in events if e["event"] == "Materialize"]
            rows = [(e["step"], r, p) for e in materialized for r, p in zip(e["req_ids"], e["positions"], strict=True)]
            past = [step for step, r, p in rows if r == a and p is not None and p > len(prompt) + cut - 1]
            assert past, f"{reason}: no row of A verified drafts past its end; the case was not built"
            assert any(r == b and step == past[0] + 1 for step, r, _ in rows), f"{reason}: B waited"


# -- logits processing in verification ---------------------------------------------------------------------


def processing_cases(lead: list[int]) -> dict[str, tuple[list[int], SamplingParams]]:
    """Requests whose processing changes tokens inside accepted runs. `lead` is the target's greedy
    continuation of PROMPT, which soon cycles: a prompt holding it makes most runs long."""
    prompt = PROMPT + lead[:40]
    stop = next(t for t in range(3, 1024) if t not in prompt)
    plain = dict(max_tokens=50, ignore_eos=True)
    return {
        # The biased token repeats until its own count outweighs the bias: each position of a run
        # must count the drafts before it.
        "frequency": (PROMPT, SamplingParams(**plain, logit_bias={7: 12.0}, frequency_penalty=1.0)),
        "presence and repetition": (prompt, SamplingParams(**plain, presence_penalty=0.8, repetition_penalty=1.3)),
        # A token every position prefers, a stop token held back until output 23: the run that
        # reaches output 23 must stop there, so each position must know its own output index.
        "min_tokens": (prompt, SamplingParams(**plain, min_tokens=23, stop_token_ids=(stop,), logit_bias={stop: 50.0})),
        "min_p and bias": (prompt, SamplingParams(**plain, min_p=0.2, logit_bias={lead[30]: -5.0})),
    }


@pytest.fixture(scope="module")
def processed(target):  # noqa: F811
    """The processing cases, all at once, and their greedy tokens without speculation (sync)."""
    with LLM(target, async_scheduling=False, **ENGINE) as llm:
        lead = llm.generate([PROMPT], SamplingParams(max_tokens=60, ignore_eos=True))[0].output_token_ids
        items = [WorkItem(name, prompt, params, 0) for name, (prompt, params) in processing_cases(lead).items()]
        return items, drive(llm, items, aborts=False).tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_tokens_with_logits_processing_equal_tokens_without_speculation(target, processed, async_scheduling):  # noqa: F811
    items, expected = processed
    with LLM(target, async_scheduling=async_scheduling, speculative_config=ngram(4), **ENGINE) as llm:
        got = drive(llm, items, aborts=False).tokens
        spec = llm.stats()["spec_decode"]
    for name in expected:
        assert got[name] == expected[name], name
    assert spec["num_accepted_tokens"] > 40, spec  # the cases' tokens came mostly in accepted runs


def test_rejection_sample_under_min_p_never_gives_a_token_min_p_drops():
    """A draft below min_p's floor is never accepted and no token below it is drawn: the tokens
    follow the min_p-filtered distribution, as the sampler's do without speculation."""
    vocab, rows = 5, 4000
    base = torch.tensor([2.0, 1.6, 0.5, 0.0, -1.0], dtype=torch.float64)  # p ≈ .47 .32 .10 .06 .02
    logits = base.expand(rows, 2, vocab).clone()
    params = sampled_rows(rows, min_p=torch.full((rows,), 0.3))  # min_p keeps tokens 0 and 1 only
    for draft in (2, 1):
        out = rejection_sample(logits, torch.tensor([[draft, -1]]).expand(rows, 2), **params)
        assert set(out[:, 0].tolist()) <= {0, 1}, draft
        kept = torch.softmax(base[:2], -1)
        freq = torch.bincount(out[:, 0], minlength=2).double() / rows
        assert (freq - kept).abs().max().item() < 0.03, draft


def test_seeded_sampling_with_processing_under_speculation_gives_the_same_tokens_async_and_sync(target):  # noqa: F811
    rng = random.Random(5)
    batches = [random_workload(rng, f"p{n}", max_prompt=40, processing=True) for n in range(1)]
    with (
        LLM(target, async_scheduling=False, speculative_config=ngram(3), **ENGINE) as sync_llm,
        LLM(target, async_scheduling=True, speculative_config=ngram(3), **ENGINE) as async_llm,
    ):
        for items in batches:
            want, got = drive(sync_llm, items, aborts=False), drive(async_llm, items, aborts=False)
            assert got.tokens == want.tokens and got.finish == want.finish
        assert async_llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
