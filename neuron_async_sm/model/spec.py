"""ModelSpec: the picklable recipe the device process builds its StepProgram from.

Derived from a validated EngineConfig (or written by a test): it is not validated again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_async_sm.config import DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how big a KV cache to allocate. Plain fields only, so it pickles across processes."""

    model: str  # "tiny-llama" or a local HF checkpoint directory
    dtype: str  # "float32" | "float64" | "bfloat16": weights, activations and KV cache
    max_num_seqs: int  # number of real KV slots; slot index max_num_seqs is the padding scratch slot
    max_model_len: int  # positions per slot
    seed: int = 0  # seed for tiny-llama's random weights; unused for checkpoints
    # Padded input_ids shapes to compile the forward for at build (torch.compile, one graph each):
    # `(rows,)` decode, `(rows, length)` prefill. Empty: the forward runs eagerly (enforce_eager).
    compile_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]
