"""Log-probabilities on the device, packed into the step's one output beside the sampled tokens.

They are vLLM's default (`logprobs_mode="raw_logprobs"`): `log_softmax` in float32 of the model's
logits as the forward gives them, before temperature, top-k / top-p or any logits processor, so they
are the same whatever a request samples with. One position's logprobs: the chosen token's (the
sampled one, or the prompt's next token), its rank (vLLM's: how many tokens have a logprob >= it, so
1 for the most likely), and the `top` most likely tokens with theirs.

The step's output stays one tensor, float32 `[B, 1 + width]` (`PACKED_DTYPE`), so the logprobs come
back with the tokens in one transfer and one materialization: column 0 is the sampled tokens (a later
step may take them as its input ids, `StepProgram` reads column 0 as integers), the other columns are
the float32 values (`LogprobsLayout`): the sampled token's block, then one block per prompt position of
the row's chunk. Token ids (the -1 placeholders too) and ranks ride in float32, exact below 2**24
(`MAX_VOCAB`). Float32, not int32 with the values' bits: torch_xla runs a bitcast (`view(torch.int32)`)
on the host, which split a step into two graphs with a read-back between them.

A speculative step (`model/spec_decode.py`) emits up to 1 + k tokens per row: its token columns come
first (`[B, 1 + k]`, draft_model: then `next_input`), then one sampled-token block per verified
position (`LogprobsLayout.sampled`), each of the token emitted there, then the prompt blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_VOCAB = 1 << 24  # token ids and ranks travel as float32, exact up to here
PACKED_DTYPE = torch.float32  # the packed output's: tokens as exact integers, logprobs as they are


def block_width(top: int) -> int:
    """Columns of one position's block: logprob, rank, `top` ids, `top` logprobs."""
    return 2 + 2 * top


def position_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> torch.Tensor:
    """float32 `[R, block_width(top)]` from logits `[R, vocab]` and the chosen token ids `[R]`."""
    logprobs = logits.float().log_softmax(dim=-1)  # [R, vocab]
    chosen_lp = logprobs.gather(1, chosen.long().unsqueeze(1))  # [R, 1]
    rank = (logprobs >= chosen_lp).sum(dim=-1, keepdim=True).float()  # [R, 1]
    top_lp, top_ids = logprobs.topk(top, dim=-1)  # [R, top] each
    return torch.cat([chosen_lp, rank, top_ids.float(), top_lp], dim=1)


def pack_output(tokens: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """float32 `[B, T + width]`: the tokens (`[B]`, or `[B, T]` columns of them), then each float32
    block `[B, ...]`. A cast, not a bitcast: the whole step stays one graph on XLA."""
    columns = tokens.to(PACKED_DTYPE)
    columns = columns.unsqueeze(1) if columns.dim() == 1 else columns
    values = torch.cat([b.reshape(b.shape[0], -1) for b in blocks], dim=1).to(PACKED_DTYPE)
    return torch.cat([columns, values.to(columns.device)], dim=1)


@dataclass(frozen=True)
class LogprobsLayout:
    """What one step's packed output holds besides the tokens, for the host to read it back."""

    sample_top: int  # top tokens per sampled token; -1: no sampled-token block
    prompt_top: int  # top tokens per prompt position; -1: no prompt blocks
    length: int  # L: prompt positions per row (the step's padded tokens per row)
    sampled: int = 1  # sampled-token blocks per row: 1, or a spec step's 1 + k verified positions

    @property
    def sample_width(self) -> int:
        return self.sampled * block_width(self.sample_top) if self.sample_top >= 0 else 0

    @property
    def width(self) -> int:
        prompt = self.length * block_width(self.prompt_top) if self.prompt_top >= 0 else 0
        return self.sample_width + prompt

    def split(self, output: torch.Tensor, token_columns: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host copy `[B, T + width]` (T = `token_columns`) as (the token columns int32 `[B, T]`,
        sampled-token blocks float32 `[B, sampled, block]`, prompt blocks float32 `[B, L, block]`;
        empty where the step has none)."""
        host = output.to(PACKED_DTYPE).numpy()  # [B, T + width]
        rows = host.shape[0]
        values = host[:, token_columns:]  # [B, width]
        sample = values[:, : self.sample_width]
        if self.sample_top >= 0:
            sample = sample.reshape(rows, self.sampled, block_width(self.sample_top))
        prompt = values[:, self.sample_width :]
        if self.prompt_top >= 0:
            prompt = prompt.reshape(rows, self.length, block_width(self.prompt_top))
        return host[:, :token_columns].astype(np.int32), sample, prompt
