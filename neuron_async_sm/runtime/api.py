"""The device-runtime protocol the worker is written against.

Neuron's async runtime has no streams, only futures: a compiled program is
enqueued with inputs that may themselves be device futures, and it returns an
output future at once. Programs run in enqueue order, each after its inputs
resolve. Reading a future to the host blocks until it is ready and re-raises
the program's failure.

The worker sees only the two abstract classes below, so a torch-neuronx or a
CUDA-stream backend can be added without touching it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import torch

Program = Callable[..., torch.Tensor]
"""A compiled program: called with keyword tensor inputs, returns one tensor.

A host input arrives as a host (CPU) tensor, a copy the caller can no longer
change; a future input arrives as the device tensor an earlier program
produced. The program moves host inputs to its device itself, so it can check
them on the host first: on a real device, reading a device value back (a
check, ``bool()``, ``.item()``) blocks until the device caught up.

The returned tensor becomes device memory owned by the output future; it must
not alias state the program mutates later (e.g. return a slice of the KV cache
by value, not by view), or a later read would see the mutation.
"""

ProgramFactory = Callable[[torch.device], Mapping[str, Program]]
"""Builds the device's programs (load weights, allocate the KV cache, ...) on the given device.

Called once, where the device is: inside the emulated device process (with
``cpu``), or in this process for a real device (``xla:0``, ``cuda:0``, ...),
whose weights and state must then be allocated on that device. Must be
picklable (a module-level frozen dataclass with ``__call__``): the process
backend ships it to the device process.
"""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a device tensor; the device checks each output against it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise ValueError(f"TensorSpec.shape must be non-negative ints, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"TensorSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class WarmupCall:
    """One call a compiling backend runs at start-up, so that serving never compiles.

    The inputs have the shapes and dtypes of a real call; the call runs for real (it may write device
    state such as a scratch KV slot). An input that is itself a ``WarmupCall`` is that call's output
    future, run first and fed device to device, as serving feeds one step's output to the next: a
    device may compile a fed future apart from an uploaded tensor. Backends that do not compile skip it.
    """

    label: str  # what the call stands for, in the warm-up log ("decode bucket 4")
    program: str
    inputs: Mapping[str, torch.Tensor | WarmupCall]
    out: TensorSpec


@dataclass(frozen=True)
class RuntimeStats:
    """A snapshot of what the device did since construction or ``reset_stats``."""

    programs_completed: int  # programs that finished successfully on the device
    programs_failed: int  # programs that raised (or failed on the device), or had a failed input
    device_time_s: float  # sum of per-program device time, measured inside the device
    recent_device_times_s: list[float]  # last N per-program device times, oldest first
    host_transfers: int  # device→host transfers (a cached or failed ``to_host`` does not count)
    host_transfer_bytes: int
    host_uploads: int  # host tensors sent as program inputs (a future fed device-to-device does not count)
    host_upload_bytes: int
    device_futures_live: int  # futures held in device memory after the last completed program (leak check)
    device_idle_s: float = 0.0  # time the device waited for work (nothing queued), summed over programs
    recent_device_idle_s: list[float] = field(default_factory=list)  # per program, aligned with recent_device_times_s
    compilations: int = 0  # programs compiled since warm-up ended (or reset_stats); 0 where nothing compiles


class DeviceFuture(ABC):
    """Handle to a tensor that lives (or will live) in device memory.

    Produced by ``DeviceRuntime.enqueue``; may be passed back as an input to a
    later ``enqueue`` without crossing to the host. ``spec`` is what the device
    really holds, so what ``to_host`` returns: its dtype may differ from the
    ``out`` the caller asked for (see ``DeviceRuntime.enqueue``).
    """

    @property
    @abstractmethod
    def spec(self) -> TensorSpec: ...

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @abstractmethod
    def to_host(self) -> torch.Tensor:
        """Block until the program finished, then return its output on the host.

        Thread-safe. The transfer happens at most once per future; every caller
        receives the same cached tensor, which must be treated as read-only.
        Raises ``DeviceProgramError`` if the program failed and
        ``DeviceLostError`` if the device is gone.
        """

    @abstractmethod
    def done(self) -> bool:
        """Non-blocking: True once ``to_host`` would not wait for the device."""

    @abstractmethod
    def index_select(self, index: torch.Tensor) -> torch.Tensor:
        """Host-side gather along dim 0. Forces the future: blocks and transfers."""

    @abstractmethod
    def release(self) -> None:
        """Free the device memory (idempotent). Also happens on garbage collection."""


class DeviceRuntime(ABC):
    """An in-order device that runs named programs on futures.

    ``enqueue`` returns at once; programs run strictly in enqueue order. At most
    ``runtime_queue_depth`` programs are unfinished at a time: past that, ``enqueue``
    blocks until one finishes (it never drops work).
    """

    @property
    @abstractmethod
    def runtime_queue_depth(self) -> int: ...

    @property
    def compiles_per_shape(self) -> bool:
        """True where each input shape is its own compiled program (XLA, Neuron): a caller then keeps
        the set of shapes it enqueues small and known at start-up (the warm-up's)."""
        return False

    @abstractmethod
    def enqueue(self, program: str, inputs: Mapping[str, torch.Tensor | DeviceFuture], out: TensorSpec) -> DeviceFuture:
        """Enqueue ``program(**inputs)`` and return the future of its output.

        Host tensors are copied at enqueue time; a ``DeviceFuture`` input is
        consumed on the device. A ``WireTensor`` (``WireTensor.encode(tensor)``:
        a host tensor as immutable bytes) is a host input too, sent as is: a
        caller that passes the same unchanging tensor on every call encodes it
        once. Raises ``DeviceLostError`` once the runtime is dead or closed.

        ``out`` is what the caller expects. The output's shape must equal it;
        its dtype may be another one of the same kind (an integer width a
        device prefers: XLA may give int64 where the emulator gives int32), and
        the future's ``spec`` then says so. Callers compare ``future.dtype``,
        never assume ``out.dtype``. Other mismatches fail the program.
        """

    @abstractmethod
    def stats(self) -> RuntimeStats: ...

    @abstractmethod
    def reset_stats(self) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Stop the device (idempotent, never hangs); waiters get ``DeviceLostError``."""

    def kill(self) -> None:
        """``close()`` without waiting for the device to finish anything: teardown after Ctrl-C or a
        hang, when the device may be stopped. A backend that cannot force its device simply closes."""
        self.close()

    def __enter__(self) -> DeviceRuntime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
