"""`n` sequences of one prompt (vLLM's parallel sampling) in `LLM` and `AsyncLLM`: n child requests,
child i seeded `seed + i`, so each is token for token a request of its own with that seed; async
scheduling gives the tokens sync gives; n=1 is the request it always was; a child that is aborted
leaves its siblings' tokens alone. (The server's `n`: tests/test_serve_parallel_sampling.py.)
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from support.engine_invariants import SMALL_ENGINE

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.async_llm import AsyncLLM, EngineOverloadedError
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.sampling_params import InvalidRequestError

PROMPTS = [[5, 6, 7, 8], [9, 10]]
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, n=3)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    with LLM("tiny-llama", device="cpu-inprocess", async_scheduling=request.param, **SMALL_ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def solo():
    """Each child's reference: a request of its own with the child's seed (sync scheduling)."""
    with LLM("tiny-llama", device="cpu-inprocess", async_scheduling=False, **SMALL_ENGINE) as engine:
        yield lambda prompt, seed: engine.generate([prompt], replace(SAMPLED, n=1, seed=seed))[0].output_token_ids


def test_each_child_equals_a_solo_request_with_its_seed(llm, solo):
    outputs = llm.generate([PromptRequest(p, SAMPLED, f"p{i}") for i, p in enumerate(PROMPTS)])
    assert [(o.request_id, o.index) for o in outputs] == [
        (f"{i}_p{p}", i) for p in range(len(PROMPTS)) for i in range(SAMPLED.n)
    ]
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == SAMPLED.max_tokens for o in outputs)
    for k, output in enumerate(outputs):
        prompt, child = PROMPTS[k // SAMPLED.n], k % SAMPLED.n
        assert output.prompt_token_ids == prompt
        assert output.output_token_ids == solo(prompt, SAMPLED.seed + child), output.request_id
    # The children of one prompt are different samples, not one sample n times.
    assert len({tuple(o.output_token_ids) for o in outputs[: SAMPLED.n]}) == SAMPLED.n


def test_n_1_is_the_request_it_always_was(llm):
    plain = replace(SAMPLED, n=1)
    a = llm.generate([PROMPTS[0]], plain)
    b = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True))
    assert a[0].output_token_ids == b[0].output_token_ids and a[0].index == b[0].index == 0
    assert a[0].request_id.startswith("req-") and "_" not in a[0].request_id


def test_unseeded_children_draw_different_seeds_and_stream_with_their_index(llm):
    unseeded = replace(SAMPLED, seed=None, n=4)
    streamed: dict[int, list[int]] = {}
    for out in llm.stream([PROMPTS[1]], unseeded):
        streamed.setdefault(out.index, []).extend(out.output_token_ids)
    assert sorted(streamed) == [0, 1, 2, 3]
    assert all(len(tokens) == SAMPLED.max_tokens for tokens in streamed.values())
    assert len({tuple(t) for t in streamed.values()}) > 1


def test_n_is_validated_and_the_engine_itself_takes_one_sequence(llm):
    with pytest.raises(InvalidRequestError, match="^n: must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequestError, match="^seed: the children's seeds"):
        SamplingParams(seed=2**63 - 2, n=3)
    with pytest.raises(InvalidRequestError, match="^n: the engine runs one sequence a request"):
        llm.add_request([5, 6], SAMPLED)
    assert not llm.has_unfinished_requests()


async def tokens(stream) -> list[int]:
    return [t async for d in stream for t in d.new_token_ids]


def test_async_llm_children_equal_llm_children_and_an_aborted_child_leaves_the_others_alone(solo):
    async def scenario() -> tuple[list[list[int]], list[str]]:
        with LLM("tiny-llama", device="cpu-inprocess", **SMALL_ENGINE) as llm:
            engine = AsyncLLM(llm, owns_llm=False)
            engine.start()
            try:
                streams = await engine.add_parallel_request(PROMPTS[0], SAMPLED, "parent")
                ids = [s.request_id for s in streams]
                first = streams[1]
                async for delta in first:  # the middle child is aborted after its first tokens
                    if delta.new_token_ids:
                        break
                engine.abort(first.request_id)
                kept = [await tokens(streams[0]), await tokens(streams[2])]
                scheduler = llm.engine.scheduler
                assert scheduler.num_free_slots == llm.config.max_num_seqs and scheduler.requests == {}
                return kept, ids
            finally:
                await engine.shutdown()

    kept, ids = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert ids == ["0_parent", "1_parent", "2_parent"]
    assert kept == [solo(PROMPTS[0], SAMPLED.seed), solo(PROMPTS[0], SAMPLED.seed + 2)]


def test_async_llm_refuses_all_children_or_none():
    async def scenario() -> int:
        with LLM("tiny-llama", device="cpu-inprocess", **SMALL_ENGINE) as llm:
            engine = AsyncLLM(llm, owns_llm=False, max_waiting=1)
            engine.start()
            try:
                long = replace(SAMPLED, n=8, max_tokens=50)  # the children added would still run
                with pytest.raises(EngineOverloadedError, match="waiting"):
                    await engine.add_parallel_request(PROMPTS[0], long)
                return engine.num_open
            finally:
                await engine.shutdown()

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) == 0
