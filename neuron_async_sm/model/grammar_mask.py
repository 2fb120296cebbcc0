"""The grammar's token bitmask, applied to logits on the device before sampling.

The bitmask is int32 `[B, ceil(V/32)]`: bit `t % 32` of word `t // 32` set means token `t` may be
sampled. A masked-out token's logit becomes -inf before temperature, top-k/top-p and Gumbel-max, so
greedy is the argmax of the masked logits and a sampled token is always one the grammar allows. A row
without a grammar is all ones, which changes nothing.
"""

from __future__ import annotations

import torch

_WORD = 0xFFFFFFFF


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool `[B, vocab_size]` from the int32 bitmask `[B, W]` (bits past vocab_size are ignored)."""
    # As non-negative int64 words first: a right shift of a negative value is not the same on every device.
    words = bitmask.long() & _WORD  # [B, W]
    shifts = torch.arange(32, dtype=torch.int64, device=bitmask.device)  # [32]
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` `[B, V]` with every token the bitmask forbids set to -inf (a new tensor)."""
    return logits.masked_fill(~allowed_tokens(bitmask.to(logits.device), logits.shape[-1]), float("-inf"))
