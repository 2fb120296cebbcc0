"""Messages between the host runtime and the device loop, and the tensor wire format.

Host → device: ``RunProgram``, ``Fetch``, ``Release``, ``Shutdown``.
Device → host: ``Ready`` | ``StartupFailed`` (exactly one, first), then
``ProgramDone`` per program and ``Fetched`` per fetch, in processing order.
A small output (``RunProgram.push_output``: sampled token ids) rides along
with its ``ProgramDone``, so reading it needs no ``Fetch`` round trip: as a
real device writes a small result straight into host-visible memory.

Tensors cross as raw bytes (``WireTensor``), never as torch tensors: torch
registers a shared-memory reduction for tensors with multiprocessing's pickler,
which costs a file descriptor and an mmap per message — far slower than
copying a few dozen bytes (see ``bench.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WireTensor:
    """A tensor as plain bytes; works for every dtype, bfloat16 included."""

    data: bytes  # the contiguous storage, C order
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @staticmethod
    def encode(tensor: torch.Tensor) -> WireTensor:
        try:
            # Fast path (~1 µs instead of ~3.5 µs, on every program input): numpy's tobytes() copies
            # in C order whatever the strides. numpy() refuses bfloat16, autograd and non-CPU tensors.
            data = tensor.numpy().tobytes()
        except (TypeError, RuntimeError):
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return WireTensor(data, tuple(tensor.shape), tensor.dtype)

    def decode(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        # bytearray: torch.frombuffer on immutable bytes yields a tensor that must never be written.
        return torch.frombuffer(bytearray(self.data), dtype=self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class FutureRef:
    """A program input that is the output of an earlier program (fed device-to-device)."""

    future_id: int


ProgramInput = WireTensor | FutureRef


# ---- host → device -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunProgram:
    """Run ``program`` on ``inputs``; store the result as future ``seq``."""

    seq: int  # program sequence number == id of its output future
    program: str
    inputs: dict[str, ProgramInput]
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    push_output: bool = False  # send the output with ProgramDone (small outputs: no Fetch round trip)
    releases: tuple[int, ...] = ()  # futures to free first: a piggybacked Release (one message, not two)


@dataclass(frozen=True)
class Fetch:
    """Send the value (or failure) of future ``future_id`` back to the host."""

    request_id: int
    future_id: int


@dataclass(frozen=True)
class Release:
    """Free the device memory of these futures."""

    future_ids: tuple[int, ...]


@dataclass(frozen=True)
class Shutdown:
    """Stop the device loop, dropping any work queued behind this message."""


HostMessage = RunProgram | Fetch | Release | Shutdown


# ---- device → host -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The factory ran; these programs can be enqueued."""

    programs: tuple[str, ...]


@dataclass(frozen=True)
class StartupFailed:
    """The factory raised; the device loop has exited."""

    error: str  # device-side traceback


@dataclass(frozen=True)
class ProgramDone:
    """Program ``seq`` finished (successfully unless ``error`` is set)."""

    seq: int
    device_time_s: float  # wall time of the program inside the device, including the device_time_ms hold
    error: str | None
    live_futures: int  # futures held in device memory once this program stored its output
    value: WireTensor | None = None  # the output, when RunProgram.push_output asked for it and it ran
    idle_s: float = 0.0  # time the device sat waiting for work since its previous ProgramDone
    compilations: int = 0  # graphs the device compiled since its programs were built (a running total)


@dataclass(frozen=True)
class Fetched:
    """Reply to ``Fetch``: exactly one of ``value`` and ``error`` is set."""

    request_id: int
    value: WireTensor | None
    error: str | None


DeviceMessage = Ready | StartupFailed | ProgramDone | Fetched
