"""The packed step: only a step's real tokens go through the model (eager devices).

A step arrives padded (`[B, L]`: decode rows and bucket padding rows padded to the prefill length),
because a device that compiles one program per shape needs that. An eager device does not, so its
forward runs on the packed tokens `[N]` (N = the real tokens): the projections and the MLP see N
rows, not B x L, and attention runs per group of rows of one query length:

- one-token rows (decodes) attend as `[R, 1]`, reading the cache where it lies when their slots
  are close together (a window of the cache, no copy), else gathering their slots;
- rows of a prompt chunk attend as `[R, Lp]`, Lp the longest chunk among them (not the bucket).

A mixed step (a prompt chunk beside decode rows) used to cost its decode rows the whole chunk length
each; packed, it costs its real tokens. Everything here is built once per step on the host, from
host values (query lengths, slots, positions), then moved to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A window of the cache may hold up to this many times the group's rows: a slot in the window that
# no row uses costs one dummy query's attention, which is cheaper than copying a used one (a gather
# reads and writes each row's K/V before attention reads them again).
WINDOW_SLACK = 2


@dataclass(frozen=True)
class AttentionGroup:
    """Rows of one query length, attended together.

    Queries: `query_index` `[R * Lg]` picks them from the packed tokens (a window's unused slots
    and a chunk's padding pick token 0; their results are dropped), or None when the group is all
    packed tokens in order. Keys: `window_start` set -> slots window_start..window_start+R-1 of the
    cache, read in place; else the gathered slots `slot_ids` `[R]`. `mask` `[R, 1, Lg, T]`: key
    position t is visible to query (r, j) iff t <= its position (position 0 for dropped queries).
    Results: group row `result_rows` `[M]` goes to packed token `result_tokens` `[M]`, or all in
    order when both are None.
    """

    rows: int
    query_len: int
    query_index: torch.Tensor | None
    window_start: int | None
    slot_ids: torch.Tensor | None
    mask: torch.Tensor
    context_len: int
    result_rows: torch.Tensor | None
    result_tokens: torch.Tensor | None


@dataclass(frozen=True)
class PackedBatch:
    """One step's real tokens, packed row by row: `input_ids`, `positions`, `write_slots` `[N]`."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    write_slots: torch.Tensor  # [N] int64: each token's KV slot
    last_token: torch.Tensor  # [B] int64: packed index of each row's last token (0 for padding rows)
    groups: tuple[AttentionGroup, ...]
    rows: int  # B, the padded step's rows: the logits are `[B, vocab]`


def pack_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    device: torch.device,
) -> PackedBatch:
    """Packs a padded step (`input_ids` on `device`, the rest host int64: positions `[B, L]`,
    query_lens and slot_ids `[B]`) into its real tokens and attention groups."""
    b, length = positions.shape
    valid = torch.arange(length).unsqueeze(0) < query_lens.unsqueeze(1)  # [B, L]
    flat = valid.reshape(-1).nonzero().squeeze(1)  # [N]: packed token -> index in [B * L]
    starts = query_lens.cumsum(0) - query_lens  # [B]: each row's first packed token
    pos = positions.reshape(-1)[flat]
    groups = []
    one = (query_lens == 1).nonzero().squeeze(1)
    if one.numel():
        groups.append(_one_token_group(one, starts[one], slot_ids[one], positions[one, 0], int(flat.numel())))
    chunks = (query_lens > 1).nonzero().squeeze(1)
    if chunks.numel():
        groups.append(_chunk_group(chunks, starts[chunks], query_lens[chunks], slot_ids[chunks], positions[chunks]))
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[flat.to(device)],
        positions=pos.to(device),
        write_slots=slot_ids.repeat_interleave(query_lens).to(device),
        last_token=torch.where(query_lens > 0, starts + query_lens - 1, 0).to(device),
        groups=tuple(_to(g, device) for g in groups),
        rows=b,
    )


def _one_token_group(
    rows: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, num_tokens: int
) -> AttentionGroup:
    """Rows of one token each (`tokens` their packed indices); a window of the cache if it fits."""
    count = rows.numel()
    low, high = int(slots.min()), int(slots.max())
    span = high - low + 1
    context_len = int(positions.max()) + 1
    if span > WINDOW_SLACK * count:  # scattered slots: gather them
        in_order = count == num_tokens and bool((tokens == torch.arange(count)).all())
        return AttentionGroup(
            rows=count,
            query_len=1,
            query_index=None if in_order else tokens,
            window_start=None,
            slot_ids=slots,
            mask=_mask(positions.unsqueeze(1), context_len),
            context_len=context_len,
            result_rows=None if in_order else torch.arange(count),
            result_tokens=None if in_order else tokens,
        )
    at = slots - low  # [R]: each row's place in the window
    window_pos = torch.zeros(span, dtype=torch.int64).index_copy_(0, at, positions)
    in_order = (
        span == count == num_tokens
        and bool((at == torch.arange(count)).all())
        and bool((tokens == torch.arange(count)).all())
    )
    query_index = torch.zeros(span, dtype=torch.int64).index_copy_(0, at, tokens)
    return AttentionGroup(
        rows=span,
        query_len=1,
        query_index=None if in_order else query_index,
        window_start=low,
        slot_ids=None,
        mask=_mask(window_pos.unsqueeze(1), context_len),
        context_len=context_len,
        result_rows=None if in_order else at,
        result_tokens=None if in_order else tokens,
    )


def _chunk_group(
    rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> AttentionGroup:
    """Rows of a prompt chunk each, padded to the longest chunk among them; their slots gathered."""
    count, longest = rows.numel(), int(lens.max())
    col = torch.arange(longest).unsqueeze(0)  # [1, Lp]
    valid = col < lens.unsqueeze(1)  # [R, Lp]
    tokens = (starts.unsqueeze(1) + col).masked_fill(~valid, 0)  # [R, Lp]
    pos = positions[:, :longest].masked_fill(~valid, 0)  # [R, Lp]
    context_len = int(pos.max()) + 1
    flat_valid = valid.reshape(-1)
    return AttentionGroup(
        rows=count,
        query_len=longest,
        query_index=tokens.reshape(-1),
        window_start=None,
        slot_ids=slots,
        mask=_mask(pos, context_len),
        context_len=context_len,
        result_rows=flat_valid.nonzero().squeeze(1),
        result_tokens=tokens.reshape(-1)[flat_valid],
    )


def _mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """Bool `[R, 1, Lg, T]`: key t visible to query (r, j) iff t <= positions[r, j]."""
    return (torch.arange(context_len).view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)


def _to(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    if device.type == "cpu":
        return group

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return AttentionGroup(
        rows=group.rows,
        query_len=group.query_len,
        query_index=move(group.query_index),
        window_start=group.window_start,
        slot_ids=move(group.slot_ids),
        mask=move(group.mask),  # type: ignore[arg-type]
        context_len=group.context_len,
        result_rows=move(group.result_rows),
        result_tokens=move(group.result_tokens),
    )
