"""Building one step's padded program inputs from the worker's CPU state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model import sample_tokens
from neuron_async_sm.outputs import SchedulerOutput
from neuron_async_sm.worker.input_batch import InputBatch

_FORWARD_INPUTS = ("input_ids", "positions", "query_lens", "slot_ids")
INPUT_IDS_DTYPE = torch.int32
SAMPLED_DTYPE = torch.int32  # the program's output; it must equal INPUT_IDS_DTYPE to feed the next step


@dataclass(frozen=True)
class ModelInput:
    """Padded inputs of one program call. B = padded rows, L = padded tokens per row."""

    req_ids: tuple[str, ...]  # real rows in order; rows past len(req_ids) are padding
    sample_positions: tuple[int | None, ...]  # per real row: position of the token it samples
    is_decode: bool  # every row computes one decode token: input_ids is 1-D
    input_ids: torch.Tensor  # int32 [B] (decode) or [B, L]
    positions: torch.Tensor  # int32, same shape as input_ids
    query_lens: torch.Tensor  # int32 [B]
    slot_ids: torch.Tensor  # int32 [B]; padding rows use the scratch slot
    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int32 [B]
    top_p: torch.Tensor  # float32 [B]
    seeds: torch.Tensor  # int64 [B]
    output_index: torch.Tensor  # int64 [B]

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def program_inputs(self, input_ids: object | None = None) -> dict[str, object]:
        """Keyword inputs of the step program; `input_ids` may be replaced by a device future."""
        return {
            "input_ids": self.input_ids if input_ids is None else input_ids,
            "positions": self.positions,
            "query_lens": self.query_lens,
            "slot_ids": self.slot_ids,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seeds": self.seeds,
            "output_index": self.output_index,
        }

    def forward_inputs(self) -> dict[str, object]:
        """Inputs of the logits-only program (host sampling)."""
        return {k: v for k, v in self.program_inputs().items() if k in _FORWARD_INPUTS}

    def sample_on_host(self, logits: torch.Tensor) -> torch.Tensor:
        """Host sampling: the same pure sampler the device runs, on logits [B, vocab]."""
        return sample_tokens(
            logits,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seeds=self.seeds,
            output_index=self.output_index,
        )


def logits_dtype(dtype: str) -> torch.dtype:
    """dtype of the logits program's output: float64 models keep float64, others give float32."""
    return torch.float64 if dtype == "float64" else torch.float32


def padded_input_shape(config: EngineConfig, scheduled: SchedulerOutput) -> tuple[int, ...]:
    """Shape of the step's input_ids: [decode bucket] for decode, [rows, prefill bucket] otherwise.

    A prefill step is not padded in rows, so its output is [num_reqs]; the first decode after it
    pads to a bucket, which is the shape mismatch the design describes.
    """
    num_rows = len(scheduled.num_scheduled_tokens)
    if scheduled.all_decode:
        return (config.decode_bucket(num_rows),)
    return (num_rows, config.prefill_bucket(max(scheduled.num_scheduled_tokens.values())))


def build_model_input(
    config: EngineConfig,
    scheduled: SchedulerOutput,
    batch: InputBatch,
    req_ids: tuple[str, ...],
    slots: np.ndarray,
) -> ModelInput:
    """Inputs from CPU state: vectorized gathers from the batch's arrays, no loop over requests.

    `req_ids` are the step's rows in order and `slots` [num_rows] their KV slots. Tokens that exist
    only in a pending future come out as POISON_TOKEN (hazard: stale input ids; the device rejects them).
    """
    is_decode = scheduled.all_decode
    shape = padded_input_shape(config, scheduled)
    num_padded, num_rows = shape[0], len(req_ids)
    computed = scheduled.num_computed_tokens
    start = np.fromiter(map(computed.__getitem__, req_ids), np.int64, num_rows)  # [R]
    if is_decode:
        count = np.ones(num_rows, dtype=np.int64)  # [R]
        ids = np.zeros(num_padded, dtype=np.int32)  # [B]
        pos = np.zeros(num_padded, dtype=np.int32)  # [B]
        ids[:num_rows] = batch.token_ids[slots, start]
        pos[:num_rows] = start
    else:
        width = shape[1]
        count = np.fromiter(map(scheduled.num_scheduled_tokens.__getitem__, req_ids), np.int64, num_rows)  # [R]
        cols = np.arange(width, dtype=np.int64)  # [L]
        real = cols[None, :] < count[:, None]  # [R, L]
        at = np.where(real, start[:, None] + cols[None, :], 0)  # [R, L] positions; padding reads position 0
        ids = np.zeros((num_padded, width), dtype=np.int32)  # [B, L]
        pos = np.zeros((num_padded, width), dtype=np.int32)  # [B, L]
        ids[:num_rows] = np.where(real, batch.token_ids[slots[:, None], at], 0)
        pos[:num_rows] = at
    end = start + count  # [R] position of the token each row samples
    num_prompt = batch.num_prompt_tokens[slots]  # [R]

    def padded(values: np.ndarray, fill: float, dtype: type) -> torch.Tensor:
        out = np.full(num_padded, fill, dtype=dtype)  # [B]
        out[:num_rows] = values
        return torch.from_numpy(out)

    sample_positions = end.tolist()
    for i in np.flatnonzero(end < num_prompt).tolist():  # a partial prefill chunk samples nothing
        sample_positions[i] = None
    return ModelInput(
        req_ids=req_ids,
        sample_positions=tuple(sample_positions),
        is_decode=is_decode,
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(pos),
        query_lens=padded(count, 0, np.int32),
        slot_ids=padded(slots, config.max_num_seqs, np.int32),  # padding rows use the scratch slot
        temperature=padded(batch.temperature[slots], 0.0, np.float32),
        top_k=padded(batch.top_k[slots], 0, np.int32),
        top_p=padded(batch.top_p[slots], 1.0, np.float32),
        seeds=padded(batch.seeds[slots], 0, np.int64),
        output_index=padded(np.maximum(end - num_prompt, 0), 0, np.int64),
    )
