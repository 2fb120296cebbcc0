"""Logits processing before sampling, on the device: vLLM's allowed_token_ids, bad_words, min_tokens,
logit_bias and penalties.

Order (vLLM's `Sampler`): allowed_token_ids (every other token gets -inf), bad_words (a word's last
token gets -inf when the outputs just before it are the word's other tokens), min_tokens (stop
tokens get -inf while the output is shorter), logit_bias (added), then the repetition, frequency and
presence penalties; the sampler then takes the greedy argmax, or applies temperature, min_p, top-k
and top-p (`sampler.py`).

Where the history lives. The penalties depend on a request's tokens so far, including the one the
previous step sampled, which in async mode is still a device future when this step is enqueued.
That token is this step's input id (fed from the future on the device), so the program itself holds
the history: `TokenHistory`, the token id at each (KV slot, position), written by the program with
each step's input ids exactly where the KV cache gets their K/V. A row sampling position p counts
its slot's positions 0..p-1: prompt below `prompt_len`, output from there. Like the KV cache it is
addressed by position, not kept as running counts, so it needs no lifecycle of its own:

- a request that takes a slot overwrites positions 0.. as its prefill chunks run; a previous
  owner's tokens at higher positions are never read (only positions below the row's own count);
- a preempted request resumed with its outputs in its prompt recomputes them: they are rewritten
  and counted again as outputs (`prompt_len` is the original prompt's length);
- an abort leaves stale entries that the next owner overwrites before reading, as with its K/V;
- a retried or replayed step rewrites the same positions with the same ids (no double count);
- padding rows and padding tokens write the scratch slot, which no real row reads;
- tensor parallel: the history is written after the ids are broadcast from the output rank, so
  every rank counts the same tokens and samples the same one.

The program writes the history on steps that carry processing inputs and read it (penalties,
bad words: `READS_HISTORY`); such a request is in every step that computes one of its tokens,
so its history is complete. A step without them pays nothing. Counts are rebuilt per step from
the history rows (`[rows, tokens]` scatter-add into `[rows, vocab]`), as vLLM rebuilds them
from its token lists, so there is no host round trip and no data-dependent branch: on a lazy
device (XLA) every operation here is a fixed-shape tensor op on device values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ProcessingInput:
    """One optional step input of logits processing: `[B]`, or `[B, W]` for a list per row."""

    name: str
    dtype: torch.dtype
    pad: float  # what a padding row (or a list's padding) holds: the neutral value
    listed: bool = False  # [B, W]: W the step's width, a power of two


PROCESSING_INPUTS: tuple[ProcessingInput, ...] = (
    ProcessingInput("prompt_len", torch.int32, 0),  # tokens of the original prompt: positions below it are prompt
    ProcessingInput("presence_penalty", torch.float32, 0.0),
    ProcessingInput("frequency_penalty", torch.float32, 0.0),
    ProcessingInput("repetition_penalty", torch.float32, 1.0),
    ProcessingInput("min_p", torch.float32, 0.0),
    ProcessingInput("min_tokens", torch.int32, 0),
    ProcessingInput("stop_ids", torch.int32, -1, listed=True),  # min_tokens' stop tokens; -1: none
    ProcessingInput("bias_ids", torch.int32, -1, listed=True),  # logit_bias tokens; -1: none
    ProcessingInput("bias_values", torch.float32, 0.0, listed=True),
    ProcessingInput("allowed_ids", torch.int32, -1, listed=True),  # allowed_token_ids; -1 first: all allowed
    # bad_words' token sequences one after another, each token with its word (the row's index of
    # it) and how many of the word's tokens follow it (0: the last, the one banned).
    ProcessingInput("bad_ids", torch.int32, -1, listed=True),  # -1: none
    ProcessingInput("bad_word", torch.int32, -1, listed=True),
    ProcessingInput("bad_back", torch.int32, 0, listed=True),
)
PROCESSING = {spec.name: spec for spec in PROCESSING_INPUTS}


class TokenHistory:
    """Token ids by (KV slot, position), int32 `[max_num_seqs + 1, max_model_len]`, on the device.

    The program's state beside the KV cache, with the same layout (the last slot is the scratch
    slot), written with each processed step's input ids (see the module docstring)."""

    def __init__(self, num_slots: int, max_model_len: int, device: torch.device) -> None:
        self.ids = torch.zeros((num_slots, max_model_len), dtype=torch.int32, device=device)  # [slots + 1, T]
        self.max_model_len = max_model_len

    def write(self, flat_index: torch.Tensor, input_ids: torch.Tensor) -> None:
        """ids at flat index slot * max_model_len + position (int64, any shape, as `input_ids`)."""
        self.ids.view(-1).index_copy_(0, flat_index.reshape(-1), input_ids.reshape(-1).to(torch.int32))

    def rows(self, slot_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Positions 0..length-1 of each row's slot, `[B, length]`."""
        return self.ids[:, :length].index_select(0, slot_ids)


def tokens_so_far(positions: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    """int64 `[B]`: each row's tokens so far, its last real token's position + 1 (padding rows 0);
    positions `[B]` (a decode) or `[B, L]`."""
    lens = query_lens.astype(np.int64)
    if positions.ndim == 1:
        positions = positions[:, None]
    last = positions[np.arange(len(lens)), np.maximum(lens - 1, 0)].astype(np.int64)
    return np.where(lens > 0, last + 1, 0)


PARTS = frozenset({"allowed", "bad_words", "min_tokens", "logit_bias", "penalties", "min_p"})
READS_HISTORY = frozenset({"penalties", "bad_words"})  # a step running either writes its ids to the history


def parts_used(inputs: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The parts of processing some row of the step uses, from the host inputs. A host program runs
    only those (the others are no-ops for every row); a compiled one runs all of them (`PARTS`), one
    program whatever the rows ask for."""
    used = set()
    if bool((inputs["allowed_ids"] >= 0).any()):
        used.add("allowed")
    if bool((inputs["bad_ids"] >= 0).any()):
        used.add("bad_words")
    if bool((inputs["min_tokens"] > 0).any()):
        used.add("min_tokens")
    if bool((inputs["bias_ids"] >= 0).any()):
        used.add("logit_bias")
    if bool(((inputs["presence_penalty"] != 0) | (inputs["frequency_penalty"] != 0)).any()) or bool(
        (inputs["repetition_penalty"] != 1).any()
    ):
        used.add("penalties")
    if bool((inputs["min_p"] > 0).any()):
        used.add("min_p")
    return frozenset(used)


def process_logits(
    logits: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    history: torch.Tensor,
    num_computed: torch.Tensor,
    output_index: torch.Tensor,
    parts: frozenset[str] = PARTS,
) -> torch.Tensor:
    """Logits `[B, vocab]` after allowed_token_ids, bad_words, min_tokens, logit_bias and the
    penalties, in vLLM's order.

    inputs: the processing inputs on the logits' device; history: `[B, T]` each row's token ids by
    position; num_computed `[B]` int64: the row's positions 0..num_computed-1 are its tokens so far
    (prompt below `prompt_len`, outputs from there); output_index `[B]`: outputs before the sampled one.
    `parts`: those to run (`parts_used`); a part no row uses changes nothing.
    """
    rows, vocab = logits.shape
    dtype = logits.dtype
    spare = torch.full((), vocab, dtype=torch.long, device=logits.device)  # a column dropped after scatters
    if "allowed" in parts:  # vLLM's allowed_token_ids_mask
        allowed = inputs["allowed_ids"].long()  # [B, A]
        index = torch.where(allowed >= 0, allowed, spare)
        kept = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=logits.device).scatter_(1, index, True)
        restricted = (allowed[:, :1] >= 0) & ~kept[:, :vocab]  # a row without the list keeps every token
        logits = logits.masked_fill(restricted, float("-inf"))
    if "bad_words" in parts:
        logits = logits.masked_fill(_bad_words_banned(logits, inputs, history, num_computed), float("-inf"))
    if "min_tokens" in parts:  # no stop token while the output is shorter (vLLM's MinTokensLogitsProcessor)
        stop_ids = inputs["stop_ids"].long()  # [B, S]
        short = (output_index < inputs["min_tokens"]).unsqueeze(1)  # [B, 1]
        index = torch.where(short & (stop_ids >= 0), stop_ids, spare)
        banned = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=logits.device).scatter_(1, index, True)
        logits = logits.masked_fill(banned[:, :vocab], float("-inf"))
    if "logit_bias" in parts:  # added (vLLM's LogitBiasLogitsProcessor; entries are distinct token ids)
        bias_ids = inputs["bias_ids"].long()  # [B, K]
        index = torch.where(bias_ids >= 0, bias_ids, spare)
        bias = torch.zeros((rows, vocab + 1), dtype=dtype, device=logits.device)
        logits = logits + bias.scatter_add_(1, index, inputs["bias_values"].to(dtype))[:, :vocab]
    if "penalties" in parts:  # vLLM's apply_penalties: repetition on prompt and output, the others on output
        logits = _penalize(logits, inputs, history, num_computed)
    return logits


def _bad_words_banned(
    logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], history: torch.Tensor, num_computed: torch.Tensor
) -> torch.Tensor:
    """bool `[B, vocab]`: the last token of each bad word whose other tokens are the row's latest
    outputs (vLLM's apply_bad_words: a word longer than the outputs + 1 bans nothing, and the prompt
    never completes a word's start)."""
    rows, vocab = logits.shape
    ids, word, back = (inputs[name].long() for name in ("bad_ids", "bad_word", "bad_back"))  # [B, N] each
    width = ids.shape[1]
    at = num_computed.unsqueeze(1) - back  # [B, N] the position each token must be at (0 back: the sampled one)
    seen = history.long().gather(1, at.clamp(0, history.shape[1] - 1))  # [B, N]
    output = at >= inputs["prompt_len"].long().unsqueeze(1)  # only outputs start a word (vLLM's past tokens)
    missed = (ids >= 0) & (back > 0) & ~(output & (seen == ids))  # [B, N] a token before the last, not there
    index = torch.where(word >= 0, word, width)  # [B, N] its word's column; padding: a spare one
    misses = torch.zeros((rows, width + 1), dtype=torch.long, device=logits.device)
    misses.scatter_add_(1, index, missed.long())  # [B, N + 1] per word
    ban = (ids >= 0) & (back == 0) & (misses.gather(1, index) == 0)  # [B, N] a whole prefix there
    column = torch.where(ban, ids, vocab)
    banned = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=logits.device).scatter_(1, column, True)
    return banned[:, :vocab]


def _penalize(
    logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], history: torch.Tensor, num_computed: torch.Tensor
) -> torch.Tensor:
    rows, vocab = logits.shape
    dtype = logits.dtype
    position = torch.arange(history.shape[1], device=history.device).unsqueeze(0)  # [1, T]
    seen = position < num_computed.unsqueeze(1)  # [B, T]
    in_prompt = position < inputs["prompt_len"].long().unsqueeze(1)  # [B, T]
    # One scatter for both: output tokens count in columns [0, vocab), prompt tokens in
    # [vocab + 1, 2 * vocab + 1); unseen positions land in column vocab, dropped.
    index = torch.where(seen, history.long() + in_prompt * (vocab + 1), vocab)
    bins = torch.zeros((rows, 2 * vocab + 1), dtype=dtype, device=logits.device)
    bins.scatter_add_(1, index, torch.ones_like(index, dtype=dtype))
    counts = bins[:, :vocab]  # [B, vocab] occurrences in the output
    in_output = counts > 0
    repetition = torch.where(
        in_output | (bins[:, vocab + 1 :] > 0), inputs["repetition_penalty"].to(dtype).unsqueeze(1), 1.0
    )
    logits = logits * torch.where(logits > 0, 1.0 / repetition, repetition)
    logits = logits - inputs["frequency_penalty"].to(dtype).unsqueeze(1) * counts
    return logits - inputs["presence_penalty"].to(dtype).unsqueeze(1) * in_output.to(dtype)
