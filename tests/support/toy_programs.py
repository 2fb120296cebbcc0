"""Toy programs for tests of the runtime and of code built on it (no model needed).

``ToyPrograms`` is picklable, so it runs on both backends. Programs that must
wait for the test (``gated``) poll for a file: unlike a multiprocessing
primitive, a path can be chosen per test and sent as an ordinary input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from neuron_async_sm.runtime import Program

GATE_TIMEOUT_S = 30.0  # a gated program gives up (and fails) after this, so a broken test cannot hang forever


class Gate:
    """A file-backed switch: ``gated`` programs given ``gate.tensor`` wait until ``open()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensor = torch.tensor(list(str(path).encode()), dtype=torch.uint8)  # [len(path)]

    def open(self) -> None:
        self.path.touch()


def _wait_for_gate(gate: torch.Tensor) -> None:
    path = Path(bytes(gate.tolist()).decode())
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {path} was never opened")
        time.sleep(0.001)


@dataclass(frozen=True)
class ToyPrograms:
    """Programs over small tensors; ``fail_to_build`` makes the factory itself raise.

    - ``add_one(x) = x + 1``, ``add(a, b) = a + b``
    - ``gated(x, gate) = x + 0`` once the ``Gate`` is open
    - ``sleep(x, seconds) = x + 0`` after sleeping ``seconds``
    - ``stamp(x, seconds) = [n]`` (int64) after sleeping: the n-th stamp to finish on this device
    - ``fail(x)`` raises ValueError; ``crash(x)`` raises SystemExit (kills the device loop)
    """

    fail_to_build: str = ""

    def __call__(self, device: torch.device | None = None) -> Mapping[str, Program]:
        if self.fail_to_build:
            raise FileNotFoundError(self.fail_to_build)
        stamps = [0]

        def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            _wait_for_gate(gate)
            return x + 0

        def sleep(x: torch.Tensor, seconds: torch.Tensor) -> torch.Tensor:
            time.sleep(float(seconds))
            return x + 0

        def stamp(x: torch.Tensor, seconds: torch.Tensor) -> torch.Tensor:
            time.sleep(float(seconds))
            stamps[0] += 1
            return torch.tensor([stamps[0]], dtype=torch.int64)

        def fail(x: torch.Tensor) -> torch.Tensor:
            raise ValueError(f"boom on {x.tolist()}")

        def crash(x: torch.Tensor) -> torch.Tensor:
            raise SystemExit(3)

        return {
            "add_one": lambda x: x + 1,
            "add": lambda a, b: a + b,
            "gated": gated,
            "sleep": sleep,
            "stamp": stamp,
            "fail": fail,
            "crash": crash,
        }


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` on a daemon thread; its result or the exception it raised lands in the list.

    For tests that must observe a call blocking (join with a timeout, check ``is_alive``)
    without risking a hung test run.
    """
    box: list[object] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box
