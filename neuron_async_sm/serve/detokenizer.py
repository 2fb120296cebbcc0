"""A request's output text as vLLM's detokenizer writes it: decoded in the prompt's context, its stop
strings found as vLLM finds them (vLLM 0.33: v1/engine/detokenizer.py, FastIncrementalDetokenizer).

The output is decoded by a `tokenizers` DecodeStream prefilled with the prompt's ids, one step per new
token: the text reads as prompt and output decoded together, minus the prompt's text (a SentencePiece
"▁the" after the prompt is " the", a word-level tokenizer's next word comes with its separating
space), and each push costs O(new tokens), never a re-decode of the whole output. A token that ends
inside a multi-byte character yields nothing until the character is complete.
"""

from __future__ import annotations

import logging
from bisect import bisect_left

from neuron_async_sm.serve.tokenizer import ServedTokenizer

logger = logging.getLogger("uvicorn.error")

# tokenizers' error when a stream's text stops being a prefix of its decoded ids (vLLM issue 17448)
INVALID_PREFIX = "Invalid prefix encountered"


class OutputDecoder:
    """One token at a time to its text, after the prompt's (vLLM's FastIncrementalDetokenizer.decode_next)."""

    def __init__(
        self,
        tokenizer: ServedTokenizer,
        prompt_ids: list[int],
        *,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._new_stream = lambda ids: DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
        self._tokenizer = tokenizer.tokenizer
        self._stream = self._new_stream(list(prompt_ids))
        # vLLM's: without spaces between special tokens, an added token right after another is written
        # as its raw content (the stream would put a space before it).
        self._added = None if skip_special_tokens or spaces_between_special_tokens else tokenizer.added_tokens
        self._last_added = False

    def step(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            # Non-monotonic UTF-8 output broke the stream's state: vLLM restarts it without context.
            logger.warning("Invalid prefix while detokenizing token %d: decode stream reset", token_id)
            self._stream = self._new_stream([])
            text = self._stream.step(self._tokenizer, token_id)
        if self._added:
            content = self._added.get(token_id)
            if content is not None and self._last_added:
                text = content
            self._last_added = content is not None
        return text or ""


class IncrementalText:
    """Decode a request's tokens as they stream, find its stop strings, say what may be sent.

    Stop strings (vLLM's rules): searched only in the text new tokens added, and only once the output
    is past its first `min_tokens` tokens (their text does not count); the one that completes earliest
    wins (ties: the first in `stop`); the text is cut before it, or after it with `include_stop`;
    tokens after the one completing it are dropped from `token_ids` (a speculative step appends
    several). While stop strings are set and cut out, the last `len(longest) - 1` characters are held
    back until the request ends, so a stop string split over two steps is never partly sent. A request
    the engine ended on a stop token (eos, stop_token_ids: finish reason "stop") does not decode that
    token unless `include_stop`.
    """

    def __init__(
        self,
        tokenizer: ServedTokenizer | None,
        stop: tuple[str, ...],
        *,
        prompt_ids: list[int] | tuple[int, ...] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.decoder = (
            None
            if tokenizer is None
            else OutputDecoder(
                tokenizer,
                list(prompt_ids),
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        )
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop  # the text ends with the stop string that matched (vLLM's option)
        self.min_tokens = min_tokens
        self._holdback = max((len(s) for s in self.stop), default=1) - 1 if not include_stop else 0
        self.token_ids: list[int] = []  # the output's (those after a matched stop string dropped)
        self.text = ""  # decoded so far (cut at a stop string once one matched)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string matched: the request must end now

    def push(self, new_token_ids: list[int], finish_reason: str | None = None) -> str:
        """Add a step's tokens (`finish_reason`: the engine's, on its last delta); the text that may be
        sent now: all of it once the request ends."""
        if self.stopped:
            return ""
        ids = list(new_token_ids)
        if ids:
            self._add(ids, stop_token=finish_reason == "stop" and not self.include_stop)
        end = len(self.text)
        if finish_reason is None and not self.stopped:
            end -= self._holdback
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def _add(self, ids: list[int], *, stop_token: bool) -> None:
        """vLLM's BaseIncrementalDetokenizer.update: decode `ids`, then look for a stop string."""
        num_before = len(self.token_ids)
        skipped = ids.pop() if stop_token else None  # the engine's stop token is not decoded
        offsets = [len(self.text)]  # the text's length at each new token's end
        for token_id in ids:
            self.token_ids.append(token_id)
            if self.decoder is not None:
                self.text += self.decoder.step(token_id)
            offsets.append(len(self.text))
        if skipped is not None:
            self.token_ids.append(skipped)
            offsets.append(len(self.text))
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return
        searched_from = offsets[max(self.min_tokens - num_before, 0)]
        hit = first_stop(self.text, len(self.text) - searched_from, self.stop)
        if hit is None:
            return
        start, end = hit
        self.stopped = True
        self.text = self.text[: end if self.include_stop else start]
        # Tokens after the one that completed the stop string are not part of the output.
        del self.token_ids[num_before + bisect_left(offsets, end, lo=1) :]


def first_stop(text: str, new_chars: int, stop: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) in `text` of the stop string that completes first in its last `new_chars`
    characters (ties: the first in `stop`); None when none does (vLLM's check_stop_strings)."""
    if not new_chars:
        return None
    best: tuple[int, int] | None = None
    for s in stop:
        # Only where a match can be new: one ending before the new characters was looked for already.
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i >= 0 and (best is None or i + len(s) < best[1]):
            best = (i, i + len(s))
    return best
