"""The warm-up calls of the engine's programs: one per input shape serving can produce.

A compiling device (XLA, Neuron) builds one program per input shape. Every shape the worker can
enqueue follows from the config alone (`padded_input_shape`): `[decode bucket]` for an all-decode
step, `[rows, prefill bucket]` for any other, rows in 1..max_num_seqs. Each call here is all padding
(query_lens 0, the scratch slot), so running it writes only the scratch KV slot.
"""

from __future__ import annotations

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.runtime import TensorSpec, WarmupCall
from neuron_async_sm.worker.model_input import INPUT_IDS_DTYPE, SAMPLED_DTYPE, ModelInput, logits_dtype
from neuron_async_sm.worker.model_runner import LOGITS_PROGRAM, STEP_PROGRAM


def warmup_shapes(config: EngineConfig) -> list[tuple[int, ...]]:
    """Every padded input_ids shape a step can have under `config`."""
    widest = config.prefill_bucket(config.max_num_batched_tokens)  # no row is ever scheduled more tokens
    shapes: list[tuple[int, ...]] = [(bucket,) for bucket in config.decode_buckets]
    for length in (b for b in config.prefill_buckets if b <= widest):
        shapes.extend((rows, length) for rows in range(1, config.max_num_seqs + 1))
    return shapes


def padding_input(config: EngineConfig, shape: tuple[int, ...]) -> ModelInput:
    """An all-padding ModelInput whose input_ids have `shape`."""
    rows = shape[0]

    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)  # [rows]

    return ModelInput(
        req_ids=(),
        sample_positions=(),
        is_decode=len(shape) == 1,
        input_ids=torch.zeros(shape, dtype=INPUT_IDS_DTYPE),
        positions=torch.zeros(shape, dtype=torch.int32),
        query_lens=full(0, torch.int32),
        slot_ids=full(config.max_num_seqs, torch.int32),  # the scratch slot
        temperature=full(0.0, torch.float32),
        top_k=full(0, torch.int32),
        top_p=full(1.0, torch.float32),
        seeds=full(0, torch.int64),
        output_index=full(0, torch.int64),
    )


def warmup_calls(config: EngineConfig, vocab_size: int) -> list[WarmupCall]:
    """One call per shape, of the program this config runs (on-device sampling or host-sampled logits)."""
    calls = []
    for shape in warmup_shapes(config):
        model_input = padding_input(config, shape)
        label = f"decode bucket {shape[0]}" if len(shape) == 1 else f"prefill {shape[0]} x {shape[1]}"
        if config.on_device_sampling:
            out = TensorSpec((shape[0],), SAMPLED_DTYPE)
            feed = "input_ids" if len(shape) == 1 else None  # Steady: the sampled tokens are the next input
            calls.append(WarmupCall(label, STEP_PROGRAM, model_input.program_inputs(), out, feed))
        else:
            out = TensorSpec((shape[0], vocab_size), logits_dtype(config.dtype))
            calls.append(WarmupCall(label, LOGITS_PROGRAM, model_input.forward_inputs(), out))
    return calls
