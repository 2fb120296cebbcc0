"""Slot-indexed static KV cache, allocated once, written in place by (slot id, position)."""

from __future__ import annotations

import math

import torch

from neuron_async_sm.model.config import LlamaConfig


class KVCache:
    """K and V caches `[layers, max_num_seqs + 1, max_model_len, kv_heads, head_dim]` in the model dtype.

    Slots 0..max_num_seqs-1 belong to requests (like Neuron continuous batching's seq ids). Slot
    `max_num_seqs` is the scratch slot: padding rows and padding tokens write there, so a static-shape
    batch never needs a branch to skip its padding, and no real slot is ever written by padding.
    Nothing reads the scratch slot on behalf of a real row.
    """

    def __init__(
        self,
        config: LlamaConfig,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = kv_cache_shape(config, max_num_seqs, max_model_len)
        # Zeros, so a read of a never-written position is deterministic.
        # k, v: [layers, max_num_seqs + 1, max_model_len, kv_heads, head_dim]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch_slot = max_num_seqs
        self.max_model_len = max_model_len

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v `[B, L, kv_heads, head_dim]` at cache[layer, slots[b, j], positions[b, j]].

        slots/positions `[B, L]` int64. Caller routes padding tokens to the scratch slot; their duplicate
        indices make the scratch contents unspecified, which is harmless because nothing real reads it.
        """
        self.write_at(layer, (slots * self.max_model_len + positions).reshape(-1), k, v)

    def write_at(self, layer: int, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` with the flat indices (slot * max_model_len + position, int64 `[N]`) given, so a
        step computes them once for all layers; k, v `[..., kv_heads, head_dim]` with N tokens."""
        heads_dim = k.shape[-2:]
        self.k[layer].view(-1, *heads_dim).index_copy_(0, flat, k.reshape(-1, *heads_dim))
        self.v[layer].view(-1, *heads_dim).index_copy_(0, flat, v.reshape(-1, *heads_dim))

    def read(self, layer: int, slot_ids: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[B, context_len, kv_heads, head_dim]`: positions 0..context_len-1 of each row's slot.

        Positions past a row's own position may hold a previous request's entries; the caller's causal
        mask (key position <= query position) is what keeps them out of attention.
        """
        # index_select on the prefix view copies only context_len positions (3x faster than x[slot_ids]).
        return (
            self.k[layer, :, :context_len].index_select(0, slot_ids),
            self.v[layer, :, :context_len].index_select(0, slot_ids),
        )


def kv_cache_shape(config: LlamaConfig, max_num_seqs: int, max_model_len: int) -> tuple[int, int, int, int, int]:
    """The shape of each of K and V: `[layers, max_num_seqs + 1, max_model_len, kv_heads, head_dim]`."""
    return (config.num_hidden_layers, max_num_seqs + 1, max_model_len, config.num_key_value_heads, config.head_dim)


def kv_cache_bytes(config: LlamaConfig, max_num_seqs: int, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes `KVCache` allocates: K and V, every slot including the scratch slot, in `dtype`."""
    return 2 * math.prod(kv_cache_shape(config, max_num_seqs, max_model_len)) * dtype.itemsize
