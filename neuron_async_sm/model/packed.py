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

import numpy as np
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
    cache, read in place; else the gathered slots `slot_ids` `[R]`. `mask` `[R, 1, Lg, T]`, additive
    (0 or -inf): key position t is visible to query (r, j) iff t <= its position (position 0 for
    dropped queries).
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
    write_index: torch.Tensor  # [N] int64: each token's place in a layer's flat cache, slot * max_model_len + position
    # [B] int64: packed index of each row's last token (0 for padding rows); None when that is every
    # packed token in order (a step of one-token rows and no padding row)
    last_token: torch.Tensor | None
    groups: tuple[AttentionGroup, ...]
    rows: int  # B, the padded step's rows: the logits are `[B, vocab]`


def pack_step(
    input_ids: torch.Tensor,
    positions: np.ndarray,
    query_lens: np.ndarray,
    slot_ids: np.ndarray,
    device: torch.device,
    max_model_len: int,
    dtype: torch.dtype,
) -> PackedBatch:
    """Packs a padded step (`input_ids` `[B, L]` on `device`; host int64 arrays: positions `[B, L]`,
    query_lens and slot_ids `[B]`) into its real tokens and attention groups, masks in `dtype`.

    The index arithmetic runs in numpy on the host (arrays of at most a few hundred entries, where a
    numpy call costs a fraction of a torch op's dispatch); only the results become tensors.
    """
    lens, slots, pos = query_lens, slot_ids, positions
    b, length = pos.shape
    if length == 1 and b and lens.min() == 1 and (np.diff(slots) == 1).all():
        return _pack_window_decode(input_ids, pos[:, 0], slots, device, max_model_len, dtype)
    starts = np.cumsum(lens) - lens  # [B]: each row's first packed token
    if length == 1:
        flat = np.flatnonzero(lens)  # [N]: packed token -> index in [B * L]
    else:
        flat = np.flatnonzero(np.arange(length)[None, :] < lens[:, None])
    num_tokens = flat.size
    groups = []
    one = np.flatnonzero(lens == 1)
    if one.size:
        groups.append(_one_token_group(starts[one], slots[one], pos[one, 0], num_tokens, device, dtype))
    chunks = np.flatnonzero(lens > 1)
    if chunks.size:
        groups.append(_chunk_group(starts[chunks], lens[chunks], slots[chunks], pos[chunks], device, dtype))
    ids = input_ids.reshape(-1)
    if num_tokens != b * length:
        ids = ids[_tensor(flat, device)]
    packed_pos = pos.reshape(-1)[flat]
    in_order = num_tokens == b and length == 1  # one token per row, no padding row
    return PackedBatch(
        input_ids=ids,
        positions=_tensor(packed_pos, device),
        write_index=_tensor(np.repeat(slots, lens) * max_model_len + packed_pos, device),
        last_token=None if in_order else _tensor(np.where(lens > 0, starts + lens - 1, 0), device),
        groups=tuple(groups),
        rows=b,
    )


def _pack_window_decode(
    input_ids: torch.Tensor,
    positions: np.ndarray,
    slots: np.ndarray,
    device: torch.device,
    max_model_len: int,
    dtype: torch.dtype,
) -> PackedBatch:
    """`pack_step` of the steady decode step: every row one token, the rows' slots consecutive and in
    order (slots[0] + row), so one window group whose rows are the packed tokens, nothing to pick or
    place (what the general path builds for it, in a third of the numpy calls)."""
    rows = slots.size
    context_len = int(positions.max()) + 1
    group = AttentionGroup(
        rows=rows,
        query_len=1,
        query_index=None,
        window_start=int(slots[0]),
        slot_ids=None,
        mask=_mask(positions[:, None], context_len, device, dtype),
        context_len=context_len,
        result_rows=None,
        result_tokens=None,
    )
    return PackedBatch(
        input_ids=input_ids.reshape(-1),
        positions=_tensor(positions, device),
        write_index=_tensor(slots * max_model_len + positions, device),
        last_token=None,
        groups=(group,),
        rows=rows,
    )


def _one_token_group(
    tokens: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    num_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionGroup:
    """Rows of one token each (`tokens` their packed indices); a window of the cache if it fits."""
    count = tokens.size
    low, high = int(slots.min()), int(slots.max())
    span = high - low + 1
    context_len = int(positions.max()) + 1
    tokens_in_order = count == num_tokens and bool((tokens == np.arange(count)).all())
    if span > WINDOW_SLACK * count:  # scattered slots: gather them
        return AttentionGroup(
            rows=count,
            query_len=1,
            query_index=None if tokens_in_order else _tensor(tokens, device),
            window_start=None,
            slot_ids=_tensor(slots, device),
            mask=_mask(positions[:, None], context_len, device, dtype),
            context_len=context_len,
            result_rows=None if tokens_in_order else _tensor(np.arange(count), device),
            result_tokens=None if tokens_in_order else _tensor(tokens, device),
        )
    at = slots - low  # [R]: each row's place in the window
    window_pos = np.zeros(span, dtype=np.int64)
    window_pos[at] = positions
    in_order = tokens_in_order and span == count and bool((at == np.arange(count)).all())
    query_index = np.zeros(span, dtype=np.int64)
    query_index[at] = tokens
    return AttentionGroup(
        rows=span,
        query_len=1,
        query_index=None if in_order else _tensor(query_index, device),
        window_start=low,
        slot_ids=None,
        mask=_mask(window_pos[:, None], context_len, device, dtype),
        context_len=context_len,
        result_rows=None if in_order else _tensor(at, device),
        result_tokens=None if in_order else _tensor(tokens, device),
    )


def _chunk_group(
    starts: np.ndarray,
    lens: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionGroup:
    """Rows of a prompt chunk each, padded to the longest chunk among them; their slots gathered."""
    count, longest = lens.size, int(lens.max())
    col = np.arange(longest)[None, :]  # [1, Lp]
    valid = col < lens[:, None]  # [R, Lp]
    tokens = np.where(valid, starts[:, None] + col, 0)  # [R, Lp]
    pos = np.where(valid, positions[:, :longest], 0)  # [R, Lp]
    context_len = int(pos.max()) + 1
    flat_valid = valid.reshape(-1)
    return AttentionGroup(
        rows=count,
        query_len=longest,
        query_index=_tensor(tokens.reshape(-1), device),
        window_start=None,
        slot_ids=_tensor(slots, device),
        mask=_mask(pos, context_len, device, dtype),
        context_len=context_len,
        result_rows=_tensor(np.flatnonzero(flat_valid), device),
        result_tokens=_tensor(tokens.reshape(-1)[flat_valid], device),
    )


def _mask(positions: np.ndarray, context_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive `[R, 1, Lg, T]` in `dtype`: 0 where key t is visible to query (r, j) (t <= positions[r, j]),
    -inf elsewhere. Additive rather than bool: CPU attention runs it faster, the same result."""
    visible = np.arange(context_len)[None, None, :] <= positions[:, :, None]
    return _tensor(np.where(visible, np.float32(0), np.float32(-np.inf))[:, None], device).to(dtype)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device)
