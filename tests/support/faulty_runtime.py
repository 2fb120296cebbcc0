"""Fault injection as a wrapper runtime: the runtime protocol carries no test hook.

``FaultyRuntime`` wraps any ``DeviceRuntime`` built over ``FaultyPrograms`` (the real programs, plus
for each one a twin that raises). ``inject_failure(after=n)`` makes the program enqueued ``n``
programs from now run as its twin, so it fails *on the device*, as a device failure does on that
backend (inside the emulated device process, at launch on XLA or a stream): its dependants fail
with its root cause, every read raises it, ``programs_failed`` counts it. Nothing else changes.

An engine takes it through its runtime seam: ``LLM(..., runtime_factory=faulty_runtime)``; the
engine's ``runtime`` is then the ``FaultyRuntime``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.runtime import (
    DeviceFuture,
    DeviceRuntime,
    Program,
    ProgramFactory,
    RuntimeStats,
    TensorSpec,
    WarmupCall,
    create_runtime,
)

FAILING_TWIN = "!injected-failure"
"""Suffix of the twin that fails in place of a program (``step`` -> ``step!injected-failure``)."""


class InjectedFailure(RuntimeError):
    """What a failing twin raises on the device."""


class _Failing:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        raise InjectedFailure(f"injected failure in place of {self.name!r}")


@dataclass(frozen=True)
class FaultyPrograms:
    """Picklable program factory: ``inner``'s programs and a failing twin of each."""

    inner: ProgramFactory

    def __call__(self, device: torch.device) -> Mapping[str, Program]:
        programs = dict(self.inner(device))
        return {**programs, **{name + FAILING_TWIN: _Failing(name) for name in programs}}


class FaultyRuntime(DeviceRuntime):
    """``inner`` with ``inject_failure``; everything else is ``inner``'s (stats, futures, close, ...)."""

    def __init__(self, inner: DeviceRuntime) -> None:
        self.inner = inner
        self._lock = threading.Lock()  # held across inner.enqueue: the count is the device's order
        self._enqueued = 0  # (lock) programs enqueued through this wrapper
        self._armed: set[int] = set()  # (lock) which of them fail

    def inject_failure(self, after: int = 0) -> None:
        """Make the program enqueued ``after`` programs from now fail (0: the next one)."""
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"inject_failure: after must be an int >= 0, got {after!r}")
        with self._lock:
            self._armed.add(self._enqueued + after)

    def enqueue(self, program: str, inputs: Mapping[str, torch.Tensor | DeviceFuture], out: TensorSpec) -> DeviceFuture:
        with self._lock:
            fail = self._enqueued in self._armed
            future = self.inner.enqueue(program + FAILING_TWIN if fail else program, inputs, out)
            self._armed.discard(self._enqueued)
            self._enqueued += 1
            return future

    @property
    def runtime_queue_depth(self) -> int:
        return self.inner.runtime_queue_depth

    @property
    def compiles_per_shape(self) -> bool:
        return self.inner.compiles_per_shape

    def stats(self) -> RuntimeStats:
        return self.inner.stats()

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def close(self) -> None:
        self.inner.close()

    def kill(self) -> None:
        self.inner.kill()

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # backend extras: device_pid, warmup_report, ...


def faulty_runtime(config: EngineConfig, programs: ProgramFactory, warmup: Sequence[WarmupCall] = ()) -> FaultyRuntime:
    """A ``RuntimeFactory`` (called like ``create_runtime``): the backend ``config.device`` with fault injection."""
    return FaultyRuntime(create_runtime(config, FaultyPrograms(programs), warmup))
