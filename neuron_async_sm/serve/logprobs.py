"""The engine's logprobs in OpenAI's response shapes, as vLLM's server writes them.

Each position's candidates are in vLLM's order: the chosen token first, then the top ones (a token in
both keeps its first place, `TokenLogprobs.as_dict`). Completions return the first `logprobs + 1` of
them per position, keyed by token text; chat returns the first `top_logprobs`. A token's text is
`decode([id])` with special tokens kept, or vLLM's `token_id:<id>` for a model without a tokenizer.
A logprob below -9999 (-inf) is written as -9999, as vLLM and OpenAI do (JSON has no -inf).
"""

from __future__ import annotations

from itertools import islice

from neuron_async_sm.outputs import TokenLogprobs
from neuron_async_sm.serve import protocol as p
from neuron_async_sm.serve.tokenizer import ServedTokenizer

FLOOR = -9999.0


def token_text(tokenizer: ServedTokenizer | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: ServedTokenizer | None,
    token_ids: list[int],
    positions: list[TokenLogprobs | None],
    count: int,
    offset: int,
) -> p.CompletionLogprobs:
    """One choice's (or one chunk's) `logprobs` for `token_ids`, one position each (None: the first
    prompt token's); text offsets start at `offset`, the characters before these tokens."""
    out = p.CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=True):
        text = token_text(tokenizer, token_id)
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
            top.setdefault(token_text(tokenizer, candidate), max(logprob, FLOOR))
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
    for position in positions:
        if position is None:
            out.append(None)
            continue
        ranks = {position.token_id: position.rank}
        for i, token in enumerate(position.top_ids):
            ranks.setdefault(token, i + 1)
        out.append(
            {
                token: p.PromptLogprob(
                    logprob=max(logprob, FLOOR), rank=ranks[token], decoded_token=token_text(tokenizer, token)
                )
                for token, logprob in position.as_dict().items()
            }
        )
    return out


def chat_logprobs(tokenizer: ServedTokenizer | None, positions: list[TokenLogprobs], top: int) -> p.ChatLogprobs:
    """One choice's (or one chunk's) `logprobs`: each sampled token's, and its first `top` candidates."""
    content = []
    for position in positions:
        candidates = [
            _chat_logprob(token_text(tokenizer, candidate), logprob)
            for candidate, logprob in islice(position.as_dict().items(), top)
        ]
        chosen = _chat_logprob(token_text(tokenizer, position.token_id), position.logprob)
        content.append(p.ChatLogprobContent(**chosen.model_dump(), top_logprobs=candidates))
    return p.ChatLogprobs(content=content)


def _chat_logprob(text: str, logprob: float) -> p.ChatLogprob:
    return p.ChatLogprob(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode("utf-8", errors="replace")))
