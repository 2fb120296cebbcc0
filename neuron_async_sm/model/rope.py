"""Rotary position embedding: inverse frequencies (plain, linear- or llama3-scaled) and their application."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from neuron_async_sm.model.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies, float64 `[head_dim // 2]`, with the config's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between
    # (same formula as transformers' _compute_llama3_parameters).
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeTable:
    """cos/sin for every position a KV slot can hold: computed once in float64, stored in the model dtype.

    `sin_rot` is sin with its first half negated: rotating half of x is then a roll of x (see
    `apply_rope`), one op where the negation and the concatenation were two.
    """

    cos: torch.Tensor  # [max_model_len, head_dim]
    sin_rot: torch.Tensor  # [max_model_len, head_dim]: -sin on the first half, sin on the second

    @staticmethod
    def build(config: LlamaConfig, max_model_len: int, dtype: torch.dtype) -> RopeTable:
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float64), rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # HF layout: the two halves share frequencies
        half = emb.shape[-1] // 2
        sign = torch.cat((-torch.ones(half, dtype=emb.dtype), torch.ones(half, dtype=emb.dtype)))
        return RopeTable(cos=emb.cos().to(dtype), sin_rot=(emb.sin() * sign).to(dtype))

    def to(self, device: torch.device) -> RopeTable:
        return RopeTable(cos=self.cos.to(device), sin_rot=self.sin_rot.to(device))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_rot `[..., 1, head_dim]` for positions `[...]` (`[B, L]` padded, `[N]` packed): gathered
        once per step for all layers, broadcast over the heads."""
        return self.cos[positions].unsqueeze(-2), self.sin_rot[positions].unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """Rotates x `[..., heads, head_dim]` by cos/sin_rot `[..., 1, head_dim]` (HF's rotate-half convention).

    HF's x * cos + cat(-x2, x1) * sin, written as x * cos + cat(x2, x1) * sin_rot: the roll swaps
    the halves and sin_rot carries the sign. Three ops (mul, roll, addcmul) where there were six.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_rot)
