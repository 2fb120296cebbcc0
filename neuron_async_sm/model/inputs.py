"""The step program's inputs, declared once: their names, dtypes and what a padding row holds.

The worker builds them (`worker/model_input.py`), the program takes them (`StepProgram.__call__`,
`forward_logits` the first four), warm-up and compilation call the program on padding alone
(`padding_inputs`), and the tests' oracle packs them (`tests/support/reference.py`).
B = padded rows, L = padded tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class StepInput:
    """One input of the step program."""

    name: str
    dtype: torch.dtype
    pad: float  # what a padding row holds (slot_ids: ignored, padding rows use the scratch slot)
    per_token: bool = False  # [B, L] in a prefill, [B] in a decode; otherwise [B] always


STEP_INPUTS: tuple[StepInput, ...] = (
    StepInput("input_ids", torch.int32, 0, per_token=True),
    StepInput("positions", torch.int32, 0, per_token=True),
    StepInput("query_lens", torch.int32, 0),  # real tokens of the row; 0: a padding row
    StepInput("slot_ids", torch.int32, 0),  # the row's KV slot; a padding row: the scratch slot
    StepInput("temperature", torch.float32, 0.0),  # 0: greedy
    StepInput("top_k", torch.int32, 0),  # 0: off
    StepInput("top_p", torch.float32, 1.0),  # 1.0: off
    StepInput("seeds", torch.int64, 0),
    StepInput("output_index", torch.int64, 0),  # index, in the request's output, of the token sampled
)
INPUTS = {spec.name: spec for spec in STEP_INPUTS}
STEP_INPUT_NAMES = tuple(INPUTS)
FORWARD_INPUT_NAMES = STEP_INPUT_NAMES[:4]  # the logits-only forward's (no sampling)


class SamplingInputs(NamedTuple):
    """The step's sampling parameters, the last five of STEP_INPUTS, `[B]` each: what the sampler and
    verification take (`sampling._asdict()` as their keywords), and what a deferred step's forward
    leaves to its sampling program (model_sample)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    output_index: torch.Tensor

    @classmethod
    def take(cls, inputs: dict[str, torch.Tensor]) -> SamplingInputs:
        """Removes the five from a program's keyword `inputs`; ValueError naming any that is missing."""
        if missing := [name for name in cls._fields if name not in inputs]:
            raise ValueError(f"step inputs: {missing} missing")
        return cls(*(inputs.pop(name) for name in cls._fields))

    def to(self, device: torch.device) -> SamplingInputs:
        return SamplingInputs(*(value.to(device) for value in self))


SAMPLING_INPUT_NAMES: tuple[str, ...] = SamplingInputs._fields
assert SAMPLING_INPUT_NAMES == STEP_INPUT_NAMES[4:], "SamplingInputs are the step inputs after the forward's"


def padding_inputs(shape: tuple[int, ...], scratch_slot: int) -> dict[str, torch.Tensor]:
    """Every step input for an all-padding call whose input_ids have `shape` ([B] or [B, L]): it
    computes nothing and writes only the scratch KV slot."""
    rows = shape[0]
    inputs = {}
    for spec in STEP_INPUTS:
        fill = scratch_slot if spec.name == "slot_ids" else spec.pad
        inputs[spec.name] = torch.full(shape if spec.per_token else (rows,), fill, dtype=spec.dtype)
    return inputs
