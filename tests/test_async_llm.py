"""`AsyncLLM` without HTTP: aborts from the event loop at every point of the two-deep pipeline."""

from __future__ import annotations

import asyncio

import pytest
from support.engine_invariants import SMALL_ENGINE

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.async_llm import AsyncLLM
from neuron_async_sm.sampling_params import InvalidRequestError

LONG = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", device="cpu-inprocess", device_time_ms=5, **SMALL_ENGINE) as engine:
        yield engine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.mark.parametrize("after_tokens", [0, 1, 2, 5])
def test_an_abort_from_the_loop_ends_the_request_and_frees_its_slot(llm, after_tokens):
    """Aborted after `after_tokens` tokens: waiting, prefilling, or with steps in flight on the device."""

    async def scenario() -> tuple[int, int, list[int]]:
        engine = AsyncLLM(llm, owns_llm=False)  # the module's LLM serves every test
        engine.start()
        try:
            gone = await engine.add_request([5, 6, 7, 8], LONG)
            stays = await engine.add_request([9, 10], LONG)
            seen = 0
            if after_tokens:
                async for delta in gone:
                    seen += len(delta.new_token_ids)
                    if seen >= after_tokens:
                        break
            engine.abort(gone.request_id)
            queued = gone.deltas.qsize()
            kept = [t async for d in stays for t in d.new_token_ids]
            return queued, gone.deltas.qsize(), kept
        finally:
            await engine.shutdown()

    queued_at_abort, queued_after, kept = run(scenario())
    assert queued_after == queued_at_abort, "a delta reached the stream after its abort"
    assert len(kept) == 12
    scheduler = llm.engine.scheduler
    assert scheduler.num_free_slots == llm.config.max_num_seqs and scheduler.requests == {}


def test_invalid_requests_are_refused_before_any_token(llm):
    async def scenario() -> int:
        engine = AsyncLLM(llm, owns_llm=False)
        engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
                await engine.add_request([llm.vocab_size], LONG)
            stream = await engine.add_request([5], SamplingParams(max_tokens=2, ignore_eos=True))
            return sum([len(d.new_token_ids) async for d in stream])
        finally:
            await engine.shutdown()

    assert run(scenario()) == 2
