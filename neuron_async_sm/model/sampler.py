"""On-device sampling: greedy, temperature, top-k, top-p with counter-based (stateless) randomness.

A row's token is a pure function of (logits row, temperature, top_k, top_p, seed, output_index): the
noise for vocab id v is a hash of (seed, output_index, v), never a draw from a shared generator. So a
request samples the same tokens whatever batch, batch position or step it runs in, and a retried or
replayed step reproduces its tokens.

Device-friendly: every tensor is created on the logits' device, and the shortcuts that skip work for
a batch (all greedy, no filter) are taken only when the tensors are on the host. On a lazy device
(XLA) such a data-dependent branch would be a blocking device->host read in the middle of the step,
which silently makes every async step synchronous; there both branches are computed and selected
with `torch.where`, which gives the same tokens because a skipped filter is a no-op for its rows.
"""

from __future__ import annotations

import torch

# splitmix64 constants as wrapped signed int64 (torch has no uint64 arithmetic; int64 mul/add wrap).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_LOW63 = (1 << 63) - 1


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (1 <= bits <= 63): the 63 low bits are shifted as a non-negative
    number and the sign bit is put back where a logical shift leaves it. `>>` on a negative int64 is
    not the same everywhere (XLA does not shift it arithmetically), so it is never used on one."""
    low = (x & _LOW63) >> bits
    return torch.where(x < 0, low | (1 << (63 - bits)), low)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer (with its gamma increment) on int64 tensors; bijective on 64-bit words."""
    z = x + _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), float64 `[B, vocab]`, for (seeds[b], output_index[b], v). Same inputs, same bits."""
    key = splitmix64(splitmix64(seeds.long()) ^ output_index.long())  # [B]
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = splitmix64(key.unsqueeze(1) + vocab * _GAMMA)  # [B, vocab]: splitmix64's own counter stream
    return (_shr(bits, 11).double() + 0.5) * 2.0**-53  # 53 random bits; +0.5 keeps 0 and 1 out


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    output_index: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row, int64 `[B]`, from logits `[B, vocab]` (float32 or float64).

    temperature `[B]` (0 -> greedy argmax), top_k `[B]` (0 -> off), top_p `[B]` (1.0 -> off),
    seeds `[B]` int64, output_index `[B]` int64, min_p `[B]` (0 -> off; None: off for all).
    Sampling is Gumbel-max over the filtered, temperature-scaled logits, which draws exactly from
    their softmax. Filters apply in vLLM's order: min_p, then top-k and top-p.
    """
    greedy_tokens = logits.argmax(dim=-1)
    greedy = temperature <= 0
    on_host = logits.device.type == "cpu"  # a branch on a host value costs no device sync
    if on_host and bool(greedy.all()):
        return greedy_tokens
    # Per-row branches below are taken for the whole batch or skipped, but a skipped filter would
    # have been a no-op for that row, so a row's token never depends on its neighbours' parameters.
    scaled = logits.double() / torch.where(greedy, 1.0, temperature.double()).unsqueeze(1)
    vocab = logits.shape[-1]
    if min_p is not None and (not on_host or bool((min_p > 0).any())):
        scaled = scaled.masked_fill(_below_min_p(scaled, min_p), float("-inf"))
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if not on_host or bool((k_on | p_on).any()):
        scaled = scaled.masked_fill(_filtered_out(scaled, top_k, top_p, k_on, p_on), float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, output_index, vocab)))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)


def _filtered_out(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_on: torch.Tensor, p_on: torch.Tensor
) -> torch.Tensor:
    """Bool `[B, vocab]`: tokens outside the row's top-k, or outside the smallest set with mass >= top_p."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)  # [1, vocab]
    drop = k_on.unsqueeze(1) & (rank >= top_k.long().unsqueeze(1))
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens; rank 0 always has 0
    drop |= p_on.unsqueeze(1) & (mass_before >= top_p.double().unsqueeze(1)) & (rank > 0)  # top_p=0: greedy
    return torch.zeros_like(drop).scatter(1, order, drop)


def _below_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool `[B, vocab]`: tokens whose probability is below min_p x the row's top probability
    (vLLM's MinPLogitsProcessor; min_p 0 drops nothing)."""
    probs = torch.softmax(scaled, dim=-1)
    return probs < probs.amax(dim=-1, keepdim=True) * min_p.double().unsqueeze(1)
