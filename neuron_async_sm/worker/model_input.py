"""Building one step's padded program inputs from the worker's CPU state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model import sample_tokens
from neuron_async_sm.outputs import SchedulerOutput
from neuron_async_sm.worker.input_batch import CachedRequestState

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
            logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seeds=self.seeds, output_index=self.output_index,
        )  # fmt: skip


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
    rows: list[CachedRequestState],
) -> ModelInput:
    """Inputs from CPU state. Tokens that exist only in a pending future come out as POISON_TOKEN."""
    is_decode = scheduled.all_decode
    shape = padded_input_shape(config, scheduled)
    num_padded = shape[0]
    width = 1 if is_decode else shape[1]
    scratch_slot = config.max_num_seqs

    ids = [[0] * width for _ in range(num_padded)]
    pos = [[0] * width for _ in range(num_padded)]
    query_lens = [0] * num_padded
    slot_ids = [scratch_slot] * num_padded
    temperature = [0.0] * num_padded
    top_k = [0] * num_padded
    top_p = [1.0] * num_padded
    seeds = [0] * num_padded
    output_index = [0] * num_padded
    sample_positions: list[int | None] = []

    for i, state in enumerate(rows):
        start = scheduled.num_computed_tokens[state.request_id]
        n = scheduled.num_scheduled_tokens[state.request_id]
        ids[i][:n] = state.token_ids_for(start, n)
        pos[i][:n] = range(start, start + n)
        query_lens[i] = n
        slot_ids[i] = state.kv_slot
        params = state.sampling_params
        temperature[i] = float(params.temperature)
        top_k[i] = params.top_k
        top_p[i] = float(params.top_p)
        seeds[i] = state.seed
        end = start + n  # position of the token this row samples
        output_index[i] = max(end - state.num_prompt_tokens, 0)
        sample_positions.append(end if end >= state.num_prompt_tokens else None)

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    if is_decode:
        input_ids = as_tensor([r[0] for r in ids], INPUT_IDS_DTYPE)
        positions = as_tensor([r[0] for r in pos], torch.int32)
    else:
        input_ids = as_tensor(ids, INPUT_IDS_DTYPE)
        positions = as_tensor(pos, torch.int32)
    return ModelInput(
        req_ids=tuple(s.request_id for s in rows),
        sample_positions=tuple(sample_positions),
        is_decode=is_decode,
        input_ids=input_ids,
        positions=positions,
        query_lens=as_tensor(query_lens, torch.int32),
        slot_ids=as_tensor(slot_ids, torch.int32),
        temperature=as_tensor(temperature, torch.float32),
        top_k=as_tensor(top_k, torch.int32),
        top_p=as_tensor(top_p, torch.float32),
        seeds=as_tensor(seeds, torch.int64),
        output_index=as_tensor(output_index, torch.int64),
    )
