"""The contract suite's programs: small, module-level and picklable, placed on the device they are built for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from neuron_async_sm.runtime import Program

HEAVY_ITERS = 20


@dataclass(frozen=True)
class ContractPrograms:
    """- ``add_one(x) = x + 1``, ``add(a, b) = a + b``
    - ``tick(x)``: a device-side counter, incremented per call, returned as int64 ``[1]``: the order calls ran in
    - ``heavy(x)``: ``HEAVY_ITERS`` rounds of ``tanh(x @ x) * 0.5``, long enough to watch the device work
    - ``widen(x)``: ``x`` as int64 (the caller asks for int32): the device's own dtype
    - ``fail(x)``: raises ValueError before touching the device
    """

    def __call__(self, device: torch.device | None = None) -> Mapping[str, Program]:
        device = device or torch.device("cpu")
        counter = torch.zeros(1, dtype=torch.int64, device=device)  # [1]

        def tick(x: torch.Tensor) -> torch.Tensor:
            del x  # an input only because every program takes one
            counter.add_(1)
            return counter.clone()  # by value: the counter itself keeps changing

        def heavy(x: torch.Tensor) -> torch.Tensor:
            y = x.to(device)
            for _ in range(HEAVY_ITERS):
                y = torch.tanh(y @ y) * 0.5
            return y

        def fail(x: torch.Tensor) -> torch.Tensor:
            raise ValueError(f"boom on a {tuple(x.shape)} input")

        return {
            "add_one": lambda x: x.to(device) + 1,
            "add": lambda a, b: a.to(device) + b.to(device),
            "tick": tick,
            "heavy": heavy,
            "widen": lambda x: x.to(device).long() + 0,
            "fail": fail,
        }


def heavy_reference(x: torch.Tensor) -> torch.Tensor:
    for _ in range(HEAVY_ITERS):
        x = torch.tanh(x @ x) * 0.5
    return x
