"""`AsyncLLM` without HTTP: aborts from the event loop at every point of the two-deep pipeline, and the
streaming text decoder's stop strings.
"""

from __future__ import annotations

import asyncio

import pytest
from support.engine_invariants import SMALL_ENGINE

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.async_llm import AsyncLLM
from neuron_async_sm.sampling_params import InvalidRequestError
from neuron_async_sm.serve.tokenizer import IncrementalText

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


class Words:
    """A stand-in tokenizer: token i decodes to word i, joined by spaces."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in ids)


def test_a_stop_string_split_over_two_steps_is_never_partly_sent():
    text = IncrementalText(Words(["ab", "cd", "ef", "gh"]), ("d e",))  # type: ignore[arg-type]
    sent = [text.push([0]), text.push([1])]  # "ab", "ab cd": "cd" may start the stop string
    assert "".join(sent) == "ab " and not text.stopped
    assert text.push([2]) == "c" and text.stopped  # "ab cd ef" contains "d e": cut before it
    assert text.push([3]) == ""


def test_include_stop_keeps_the_longest_stop_string_that_matched_first():
    text = IncrementalText(Words(["ab", "cd", "ef"]), ("cd", "cd e", "b"), include_stop=True)  # type: ignore[arg-type]
    assert text.push([0]) == "ab" and text.stopped  # "b" matched first
    text = IncrementalText(Words(["xy", "cd", "ef"]), ("cd", "cd e"), include_stop=True)  # type: ignore[arg-type]
    assert text.push([0]) + text.push([1, 2]) == "xy cd e" and text.stopped  # both matched in one step


def test_a_stop_string_within_the_first_min_tokens_tokens_does_not_stop():
    """vLLM's min_tokens holds back stop strings too: one that ends within the first min_tokens
    tokens' text is output; the next one stops."""
    words = Words(["ab", "cd", "ef"])
    eager = IncrementalText(words, ("cd",))  # type: ignore[arg-type]
    eager.push([1])
    assert eager.stopped
    text = IncrementalText(words, ("cd",), min_tokens=2)  # type: ignore[arg-type]
    text.push([1])
    text.push([0])
    assert not text.stopped
    text.push([1], final=True)
    assert text.stopped and text.text == "cd ab "


def test_without_stop_strings_text_streams_at_once_and_the_rest_comes_on_the_final_piece():
    text = IncrementalText(Words(["x", "y"]), ())  # type: ignore[arg-type]
    assert text.push([0]) == "x" and text.push([1], final=True) == " y"
    held = IncrementalText(Words(["x", "yz"]), ("zz",))  # type: ignore[arg-type]
    assert held.push([0]) == "" and held.push([1], final=True) == "x yz" and not held.stopped
