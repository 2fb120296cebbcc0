"""The backends every contract test runs on: each one this machine has.

`cpu` (emulated device process) and `cpu-inprocess` always; `accelerator` always (on a machine without
one it is the synchronous CPU); `xla` when torch_xla imports. With NEURON_ASYNC_SM_REQUIRE_XLA=1 (the
XLA lane, `.ci/xla-lane`) a missing torch_xla fails the xla tests instead of skipping them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest

# torch_xla reads this when it first creates a device; CPU is the PJRT client every machine has.
os.environ.setdefault("PJRT_DEVICE", "CPU")

REQUIRE_XLA = os.environ.get("NEURON_ASYNC_SM_REQUIRE_XLA", "") == "1"
HAS_XLA = importlib.util.find_spec("torch_xla") is not None


@dataclass(frozen=True)
class Backend:
    """A backend as the tests see it: its device= name and what it documents about itself."""

    name: str
    asynchronous: bool  # enqueue returns before the program ran (False: it runs inside enqueue)
    compiles: bool  # programs are compiled per shape (warm-up matters; stats().compilations counts)


def _accelerator_is_async() -> bool:
    import torch

    return torch.accelerator.is_available()


def backends() -> list:
    params = [
        pytest.param(Backend("cpu", True, False), id="cpu"),
        pytest.param(Backend("cpu-inprocess", True, False), id="cpu-inprocess"),
        pytest.param(Backend("accelerator", _accelerator_is_async(), False), id="accelerator"),
    ]
    xla = Backend("xla", True, True)
    if HAS_XLA or REQUIRE_XLA:
        params.append(pytest.param(xla, id="xla"))
    else:
        params.append(pytest.param(xla, id="xla", marks=pytest.mark.skip(reason="torch_xla is not installed")))
    return params


@pytest.fixture(params=backends())
def backend(request) -> Backend:
    if request.param.name == "xla" and not HAS_XLA:
        pytest.fail("NEURON_ASYNC_SM_REQUIRE_XLA=1 but torch_xla is not importable (run .ci/xla-lane)")
    return request.param
