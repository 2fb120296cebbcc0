"""The engine's logprobs in OpenAI's response shapes, as vLLM's server writes them.

Each position's candidates are in vLLM's order: the chosen token first, then the top ones (a token in
both keeps its first place, `TokenLogprobs.as_dict`). Completions return the first `logprobs + 1` of
them per position, keyed by token text; chat returns the first `top_logprobs`. A token's text is
vLLM's: where the engine scored it, `ServedTokenizer.token_text` (its leading SentencePiece space kept,
a split character completed from the sampled tokens before it); an echoed prompt token without
logprobs is plain `decode([id])`; `token_id:<id>` for a model without a tokenizer (or when asked).
A logprob below -9999 (-inf) is written as -9999, as vLLM and OpenAI do (JSON has no -inf).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from neuron_async_sm.outputs import TokenLogprobs
from neuron_async_sm.serve import protocol as p
from neuron_async_sm.serve.tokenizer import ServedTokenizer

FLOOR = -9999.0


def token_text(tokenizer: ServedTokenizer | None, token_id: int, context: list[int] | None = None) -> str:
    """`token_id`'s text where the engine scored it after the sampled tokens `context`; None: where it
    did not (an echoed prompt token without logprobs)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    if context is None:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return tokenizer.token_text(token_id, context)


def _contexts(positions: Sequence[TokenLogprobs | None], before: list[int]) -> list[list[int]]:
    """Per position, the chosen tokens before it (`before`, then the scored positions'): what vLLM's
    engine completes a split character from."""
    out, context = [], before[-4:]
    for position in positions:
        out.append(context)
        if position is not None:
            context = [*context[-3:], position.token_id]
    return out


@dataclass(frozen=True)
class Scored:
    """Tokens and their logprobs, one position each (None: a prompt token without logprobs); `before`:
    the tokens scored before them in the same sequence (a stream's earlier output; the prompt's: none)."""

    token_ids: list[int]
    positions: Sequence[TokenLogprobs | None]
    before: list[int]


def completion_logprobs(
    tokenizer: ServedTokenizer | None, parts: list[Scored], count: int, offset: int
) -> p.CompletionLogprobs:
    """One choice's (or one chunk's) `logprobs` for the tokens of `parts` (an echo's prompt, then the
    output); text offsets start at `offset`, the characters before these tokens."""
    out = p.CompletionLogprobs()
    for token_id, position, context in (
        item
        for part in parts
        for item in zip(part.token_ids, part.positions, _contexts(part.positions, part.before), strict=True)
    ):
        text = token_text(tokenizer, token_id, None if position is None else context)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(position.logprob, FLOOR))
        top: dict[str, float] = {}
        for candidate, logprob in islice(position.as_dict().items(), count + 1):
            top.setdefault(token_text(tokenizer, candidate, context), max(logprob, FLOOR))
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(
    tokenizer: ServedTokenizer | None, positions: list[TokenLogprobs | None] | None
) -> list[dict[int, p.PromptLogprob] | None] | None:
    """A response's `prompt_logprobs` as vLLM returns them: per prompt token (None for the first) the
    token's own logprob and rank, then the top tokens' (ranks 1, 2, ...), keyed by token id; None
    when the request asked for none."""
    if positions is None:
        return None
    out: list[dict[int, p.PromptLogprob] | None] = []
    for position, context in zip(positions, _contexts(positions, []), strict=True):
        if position is None:
            out.append(None)
            continue
        ranks = {position.token_id: position.rank}
        for i, token in enumerate(position.top_ids):
            ranks.setdefault(token, i + 1)
        out.append(
            {
                token: p.PromptLogprob(
                    logprob=max(logprob, FLOOR), rank=ranks[token], decoded_token=token_text(tokenizer, token, context)
                )
                for token, logprob in position.as_dict().items()
            }
        )
    return out


def chat_logprobs(
    tokenizer: ServedTokenizer | None, positions: list[TokenLogprobs], top: int, before: list[int]
) -> p.ChatLogprobs:
    """One choice's (or one chunk's) `logprobs`: each sampled token's, and its first `top` candidates;
    `before`: the tokens sampled before these."""
    content = []
    for position, context in zip(positions, _contexts(positions, before), strict=True):
        candidates = [
            _chat_logprob(token_text(tokenizer, candidate, context), logprob)
            for candidate, logprob in islice(position.as_dict().items(), top)
        ]
        chosen = _chat_logprob(token_text(tokenizer, position.token_id, context), position.logprob)
        content.append(p.ChatLogprobContent(**chosen.model_dump(), top_logprobs=candidates))
    return p.ChatLogprobs(content=content)


def _chat_logprob(text: str, logprob: float) -> p.ChatLogprob:
    return p.ChatLogprob(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode("utf-8", errors="replace")))
