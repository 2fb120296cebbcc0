"""Speculative verification on the device: one forward scores a row's last accepted token and its drafts.

A spec row holds `[x0, d1 .. dn]` (n = its `num_drafts`, 0..k) at consecutive positions after the
request's accepted tokens. The forward writes their K/V like a prompt chunk's; the logits at x0 and
each draft decide, left to right, whether the next draft is accepted (`rejection_sample`). The row's
output is the accepted drafts, then one more token (the recovered token at the first rejection, or
the bonus after the last draft), then -1 (docs/spec-decode.md §2, §8). Prefill and plain decode rows
are rows with no drafts: their one token is the ordinary sample at their last position.

KV of rejected drafts: written at positions past the request's accepted tokens. No later query
attends to them (a query attends to positions up to its own), and the request's next row starts at
its last accepted token, so it overwrites them before any query could reach them.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron_async_sm.model.packed import PackedBatch
from neuron_async_sm.model.program import StepProgram
from neuron_async_sm.model.sampler import _filtered_out, sample_tokens, uniform_noise

# The acceptance draw's stream: its key is output_index with this bit set, so it never equals an
# ordinary sample's key (an output index is far below 2**62) and the plain stream stays today's.
ACCEPT_STREAM = 1 << 62


def rejection_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    output_index: torch.Tensor,
) -> torch.Tensor:
    """The tokens a spec row emits, int64 `[B, W]` (-1 past them), from the target's logits `[B, W, vocab]`
    at the row's last accepted token and each draft, and `drafts` int64 `[B, W]`: drafts[b, c] is the
    draft after logits position c (-1: none; a row's drafts are a prefix of its columns).

    Per row: temperature, top_k, top_p, seeds `[B]`; output_index `[B]` the output index of the token
    at position 0 (position c: output_index + c). Greedy: a draft is accepted while it equals the
    argmax. Sampled, the drafter's q one-hot on its draft (n-gram): accepted when u < p(d), u drawn
    per (seed, output index) in its own stream; at a rejection the token is drawn from p without d,
    with the ordinary sampler's noise for that output index, so it is the ordinary sample whenever
    that is not d. With no draft left the bonus is the ordinary sample. Every draw is keyed by
    (seed, output index) alone: the same tokens in any batch, in async and in sync mode.
    """
    b, width, vocab = logits.shape
    flat = logits.reshape(b * width, vocab)
    index = (output_index.long().unsqueeze(1) + torch.arange(width, device=logits.device)).reshape(-1)  # [B*W]

    def per_position(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(width)

    temp, k, p, seed = (per_position(x) for x in (temperature, top_k, top_p, seeds))
    sampled = sample_tokens(flat, temperature=temp, top_k=k, top_p=p, seeds=seed, output_index=index)  # [B*W]
    greedy = temp <= 0
    draft = drafts.reshape(-1).long()
    has_draft = draft >= 0
    if logits.device.type == "cpu" and bool(greedy.all()):  # a host branch costs no device sync
        return _runs(has_draft & (draft == sampled), draft, sampled, b, width)
    safe = draft.clamp(min=0).unsqueeze(1)  # [B*W, 1]
    scaled = flat.double() / torch.where(greedy, 1.0, temp.double()).unsqueeze(1)
    scaled = scaled.masked_fill(_filtered_out(scaled, k, p, (k > 0) & (k < vocab), p < 1.0), float("-inf"))
    p_draft = torch.softmax(scaled, dim=-1).gather(1, safe).squeeze(1)  # p(d) [B*W]
    u = uniform_noise(seed, index | ACCEPT_STREAM, 1)[:, 0]  # [B*W]
    accept = has_draft & torch.where(greedy, draft == flat.argmax(dim=-1), u < p_draft)
    # The residual max(p - q, 0) for a one-hot q: p without d, by Gumbel-max with the ordinary noise.
    gumbel = -torch.log(-torch.log(uniform_noise(seed, index, vocab)))
    residual = (scaled + gumbel).scatter(1, safe, float("-inf")).argmax(dim=-1)
    recovered = torch.where(greedy | (sampled != draft), sampled, residual)  # [B*W]
    return _runs(accept, draft, torch.where(has_draft, recovered, sampled), b, width)


def _runs(accept: torch.Tensor, draft: torch.Tensor, last: torch.Tensor, b: int, width: int) -> torch.Tensor:
    """`[B, W]`: each row's drafts up to its first rejection, then `last` at that position, then -1.
    accept, draft, last: `[B*W]`; last is the token emitted where a row's run ends."""
    accept, draft, last = accept.view(b, width), draft.view(b, width), last.view(b, width)
    accepted = accept.long().cumprod(dim=1).sum(dim=1, keepdim=True)  # [B, 1] a
    col = torch.arange(width, device=draft.device).unsqueeze(0)  # [1, W]
    return torch.where(col < accepted, draft, torch.where(col == accepted, last, -1))


class SpecStepProgram:
    """The step program with verification: the target's forward, then `rejection_sample`; `[B, W]` int32.

    Inputs: the step program's nine (`model/inputs.py`; input_ids `[B, L]` on the host: the drafts
    come from the host, n-gram) and num_drafts int32 `[B]`, the last num_drafts real tokens of each row
    being drafts. output_index is the output index of the token after each row's first verified
    token (x0 for a spec row, the last token otherwise). Eager only (config: enforce_eager).
    """

    def __init__(self, program: StepProgram, width: int) -> None:
        self.program = program
        self.width = width  # W = 1 + k

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seeds: torch.Tensor,
        output_index: torch.Tensor,
        num_drafts: torch.Tensor,
    ) -> torch.Tensor:
        program, width = self.program, self.width
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(1)  # [B, L]
        pos = positions if positions.dim() == 2 else positions.unsqueeze(1)
        rows, length = ids.shape
        lens = query_lens.numpy().astype(np.int64)  # [B]
        drafted = num_drafts.numpy().astype(np.int64)  # [B]
        if (drafted < 0).any() or (drafted >= np.maximum(lens, 1)).any() or drafted.max(initial=0) >= width:
            raise ValueError(f"num_drafts {drafted.tolist()} must lie in [0, min(query_len, {width}))")
        first = np.maximum(lens - 1 - drafted, 0)  # [B] column of the first verified token
        cols = first[:, None] + np.arange(width)[None, :]  # [B, W]
        real = np.arange(width)[None, :] < drafted[:, None]  # [B, W] a draft follows column c
        host_ids = ids.numpy().astype(np.int64)
        draft_ids = np.where(real, host_ids[np.arange(rows)[:, None], np.minimum(cols + 1, length - 1)], -1)
        at = np.minimum(cols, np.maximum(lens - 1, 0)[:, None])  # [B, W] positions past a row's end: its last
        with program._no_autograd():
            batch = program._prepare(ids, pos, query_lens, slot_ids)
            dev = program.device
            if isinstance(batch, PackedBatch):
                if batch.input_ids.numel() == 0:  # all padding: nothing ran
                    return torch.full((rows, width), -1, dtype=torch.int32)
                starts = np.cumsum(lens) - lens
                hidden = program.model.hidden_states(batch, program.kv_cache)  # [N, hidden]
                picked = hidden[torch.from_numpy(np.where(lens[:, None] > 0, starts[:, None] + at, 0)).to(dev)]
            else:
                hidden = program.model.hidden_states(batch, program.kv_cache)  # [B, L, hidden]
                picked = hidden[torch.arange(rows, device=dev).unsqueeze(1), torch.from_numpy(at).to(dev)]
            logits = program.model.logits_of(picked)  # [B, W, vocab]
            out = rejection_sample(
                logits,
                torch.from_numpy(draft_ids).to(dev),
                temperature=temperature.to(dev),
                top_k=top_k.to(dev),
                top_p=top_p.to(dev),
                seeds=seeds.to(dev),
                output_index=output_index.to(dev),
            )
            return out.masked_fill(torch.from_numpy(lens == 0).to(dev).unsqueeze(1), -1).to(torch.int32)
