"""The device kinds, and keeping host threads off the device's CPU.

A runtime takes its settings from `EngineConfig` (the one place that validates them), by their field names.
"""

from __future__ import annotations

import enum
import os


class DeviceKind(enum.Enum):
    """Where the emulated device runs; the value is the ``device=`` string (one of `config.DEVICES`)."""

    PROCESS = "cpu"  # a spawned process: the host and the device overlap like a real accelerator
    THREAD = "cpu-inprocess"  # a thread in this process: same semantics, shares the GIL, fast to start
    XLA = "xla"  # PyTorch/XLA through PJRT (CPU client here; PJRT_DEVICE=NEURON on Trainium): xla_runtime.py
    ACCELERATOR = "accelerator"  # torch.accelerator's device and streams (CPU: synchronous): accelerator_runtime.py
    CUDA = "cuda"  # the accelerator backend, refusing to start unless that device is CUDA


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
