"""ModelSpec: the picklable recipe the device process builds its StepProgram from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how big a KV cache to allocate. Plain fields only, so it pickles across processes."""

    model: str  # "tiny-llama" or a local HF checkpoint directory
    dtype: str  # "float32" | "float64" | "bfloat16": weights, activations and KV cache
    max_num_seqs: int  # number of real KV slots; slot index max_num_seqs is the padding scratch slot
    max_model_len: int  # positions per slot
    seed: int = 0  # seed for tiny-llama's random weights; unused for checkpoints

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"ModelSpec.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"ModelSpec.max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
