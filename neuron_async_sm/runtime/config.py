"""Runtime configuration, validated once at construction."""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass


class DeviceKind(enum.Enum):
    """Where the emulated device runs; the value is the ``device=`` string."""

    PROCESS = "cpu"  # a spawned process: the host and the device overlap like a real accelerator
    THREAD = "cpu-inprocess"  # a thread in this process: same semantics, shares the GIL, fast to start
    XLA = "xla"  # PyTorch/XLA through PJRT (CPU client here; PJRT_DEVICE=NEURON on Trainium): xla_runtime.py
    ACCELERATOR = "accelerator"  # torch.accelerator's device and streams (CPU: synchronous): accelerator_runtime.py
    CUDA = "cuda"  # the accelerator backend, refusing to start unless that device is CUDA

    @staticmethod
    def parse(device: str) -> DeviceKind:
        for kind in DeviceKind:
            if kind.value == device:
                return kind
        valid = ", ".join(repr(k.value) for k in DeviceKind)
        raise ValueError(f"unknown device {device!r}; valid choices: {valid}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything that shapes a runtime besides its programs."""

    device: DeviceKind
    queue_depth: int = 32  # unfinished programs allowed before enqueue blocks
    device_time_ms: float = 0.0  # each successful program holds the device at least this long
    num_threads: int = 1  # torch intra-op threads of the device process (PROCESS only)
    device_cpu: int | None = None  # the CPU the device process runs on; host threads keep off it (PROCESS only)
    close_grace_s: float = 1.0  # how long close() waits for the device before forcing it down
    # No ProgramDone / Fetched for this long while work is in flight: the device is hung (killed,
    # DeviceHungError). 0 disables the watchdog: a hung device then blocks its waiters forever.
    device_timeout_s: float = 120.0
    recent_times_kept: int = 1024  # per-program device times kept for medians

    def __post_init__(self) -> None:
        if not isinstance(self.device, DeviceKind):
            raise ValueError(f"RuntimeConfig.device must be a DeviceKind, got {self.device!r}")
        if self.queue_depth < 1:
            raise ValueError(f"RuntimeConfig.queue_depth must be >= 1, got {self.queue_depth}")
        if self.device_time_ms < 0:
            raise ValueError(f"RuntimeConfig.device_time_ms must be >= 0, got {self.device_time_ms}")
        if self.num_threads < 1:
            raise ValueError(f"RuntimeConfig.num_threads must be >= 1, got {self.num_threads}")
        if self.device_cpu is not None and self.device is not DeviceKind.PROCESS:
            raise ValueError("RuntimeConfig.device_cpu needs the process backend (device='cpu')")
        if self.close_grace_s < 0:
            raise ValueError(f"RuntimeConfig.close_grace_s must be >= 0, got {self.close_grace_s}")
        if not 0 <= self.device_timeout_s < math.inf:  # also rejects NaN
            raise ValueError(f"RuntimeConfig.device_timeout_s must be >= 0 and finite, got {self.device_timeout_s}")
        if self.recent_times_kept < 1:
            raise ValueError(f"RuntimeConfig.recent_times_kept must be >= 1, got {self.recent_times_kept}")


def keep_off_cpu(cpu: int | None) -> None:
    """Run the calling thread, and the threads it starts later, on every allowed CPU but `cpu`.

    Hazard: a stalled device. A host thread woken by the device is placed on the waker's CPU when
    no CPU is idle, and preempts the device there until it blocks again: host and device then
    take turns on one core instead of overlapping. Linux only; a no-op where affinity is unsupported.
    """
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    allowed = os.sched_getaffinity(0) - {cpu}
    if allowed:
        os.sched_setaffinity(0, allowed)
