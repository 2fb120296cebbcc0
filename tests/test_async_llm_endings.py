"""`AsyncLLM`'s own ways of ending a request, where no test looked: a client cancelled while its add
is still queued, a shutdown with streams open, an observer that raises. Each is a request that would
otherwise run unseen, a stream that would never end, or an engine taken down by its metrics.

The engine's turns are watched through the observers `AsyncLLM` takes (what the server's metrics
see); the module's LLM outlives each AsyncLLM (`owns_llm=False`), so the scheduler can be read after.
"""

from __future__ import annotations

import asyncio

import pytest
from support.engine_invariants import SMALL_ENGINE

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.async_llm import AsyncLLM, EngineTurn

LONG = SamplingParams(max_tokens=40, ignore_eos=True)  # 40 steps of 5 ms programs: long after we act


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", device="cpu-inprocess", device_time_ms=5, **SMALL_ENGINE) as engine:
        yield engine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def ended(turns: list[EngineTurn], request_id: str) -> tuple[list[int], str | None]:
    """The tokens the engine produced for a request, and how it finished, from its turns."""
    tokens = [t for turn in turns for d in turn.deltas if d.request_id == request_id for t in d.new_token_ids]
    reasons = [d.finish_reason for turn in turns for d in turn.deltas if d.request_id == request_id]
    return tokens, next((r for r in reasons if r is not None), None)


def assert_idle(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not llm.has_unfinished_requests() and scheduler.requests == {}
    assert scheduler.num_free_slots == llm.config.max_num_seqs


def test_a_client_cancelled_before_its_add_was_taken_is_aborted_not_run_unseen(llm):
    turns: list[EngineTurn] = []

    async def scenario() -> bool:
        engine = AsyncLLM(llm, owns_llm=False, observers=(turns.append,))
        engine.start()
        try:
            busy = await engine.add_request([5, 6, 7], LONG, "busy")  # the engine thread is stepping
            task = asyncio.ensure_future(engine.add_request([9, 10], LONG, "gone"))
            await asyncio.sleep(0)  # the add is queued; the task waits for the engine thread to take it
            cancelled = task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            kept = [t async for d in busy for t in d.new_token_ids]
            assert len(kept) == LONG.max_tokens
            return cancelled
        finally:
            await engine.shutdown()

    assert run(scenario()), "the add finished before the cancel: nothing was tested"
    tokens, reason = ended(turns, "gone")
    assert (tokens, reason) == ([], "abort"), (len(tokens), reason)  # taken and aborted in one turn: no step between
    assert_idle(llm)


def test_a_shutdown_aborts_open_requests_before_the_engine_stops(llm):
    turns: list[EngineTurn] = []

    async def scenario() -> list[str | None]:
        engine = AsyncLLM(llm, owns_llm=False, observers=(turns.append,))
        engine.start()
        streams = [await engine.add_request([5 + i, 6], LONG, f"open{i}") for i in range(3)]
        async for delta in streams[0]:
            if delta.new_token_ids:
                break  # tokens are flowing: steps are in flight
        await engine.shutdown()
        reasons = []
        for stream in streams:
            reasons.append([d async for d in stream][-1].finish_reason)  # ends: no stream waits for ever
        return reasons

    assert run(scenario()) == ["abort"] * 3  # not "error": nothing failed
    for i in range(3):
        tokens, reason = ended(turns, f"open{i}")
        assert reason == "abort" and len(tokens) < LONG.max_tokens
    assert not llm.engine.scheduler.has_unfinished_requests()  # every one aborted before the thread ended
    for _ in range(10):  # the steps still in flight, applied by the LLM's next owner: it is reusable
        if not llm.has_unfinished_requests():
            break
        assert llm.step() == []  # aborted: their tokens are discarded
    assert_idle(llm)


def test_an_observer_that_raises_never_takes_the_engine_down(llm, caplog):
    def broken(turn: EngineTurn) -> None:
        raise RuntimeError("metrics bug")

    async def scenario() -> tuple[list[int], str | None]:
        engine = AsyncLLM(llm, owns_llm=False, observers=(broken,))
        engine.start()
        try:
            stream = await engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
            deltas = [d async for d in stream]
            return [t for d in deltas for t in d.new_token_ids], deltas[-1].finish_reason
        finally:
            await engine.shutdown()

    tokens, reason = run(scenario())
    assert (len(tokens), reason) == (6, "length")
    assert "engine observer failed" in caplog.text
    assert llm.engine.dead_reason is None
    assert_idle(llm)
