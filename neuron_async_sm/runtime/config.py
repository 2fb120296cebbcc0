"""Runtime configuration: a plain value derived from an `EngineConfig`, which validated it."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from neuron_async_sm.config import EngineConfig


class DeviceKind(enum.Enum):
    """Where the emulated device runs; the value is the ``device=`` string (one of `config.DEVICES`)."""

    PROCESS = "cpu"  # a spawned process: the host and the device overlap like a real accelerator
    THREAD = "cpu-inprocess"  # a thread in this process: same semantics, shares the GIL, fast to start
    XLA = "xla"  # PyTorch/XLA through PJRT (CPU client here; PJRT_DEVICE=NEURON on Trainium): xla_runtime.py
    ACCELERATOR = "accelerator"  # torch.accelerator's device and streams (CPU: synchronous): accelerator_runtime.py
    CUDA = "cuda"  # the accelerator backend, refusing to start unless that device is CUDA


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything that shapes a runtime besides its programs. Not validated here: build it with `of()`
    from an `EngineConfig`, the one place that validates (its errors name the field)."""

    device: DeviceKind
    queue_depth: int = 32  # unfinished programs allowed before enqueue blocks
    device_time_ms: float = 0.0  # each successful program holds the device at least this long
    num_threads: int = 1  # torch intra-op threads of the device process (PROCESS only)
    device_cpu: int | None = None  # the CPU the device process runs on; host threads keep off it (PROCESS only)
    close_grace_s: float = 1.0  # how long close() waits for the device before forcing it down
    # No ProgramDone / Fetched for this long while work is in flight: the device is hung (killed,
    # DeviceHungError). 0 disables the watchdog: a hung device then blocks its waiters forever.
    device_timeout_s: float = 120.0
    # Not Ready this long after start: the device is killed, DeviceStartupError. 0: wait forever.
    device_startup_timeout_s: float = 600.0
    recent_times_kept: int = 1024  # per-program device times kept for medians

    @classmethod
    def of(cls, config: EngineConfig) -> RuntimeConfig:
        """The runtime's share of a validated engine configuration."""
        return cls(
            device=DeviceKind(config.device),
            queue_depth=config.runtime_queue_depth,
            device_time_ms=config.device_time_ms,
            num_threads=config.device_threads,
            device_cpu=config.device_cpu,
            device_timeout_s=config.device_timeout_s,
            device_startup_timeout_s=config.device_startup_timeout_s,
        )


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
