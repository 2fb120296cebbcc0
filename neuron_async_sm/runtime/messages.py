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

On a byte stream (``encode`` / ``decode``), the two messages of every step
(``RunProgram``, ``ProgramDone``) are marshalled tuples of plain values, the
rest pickled: marshal writes a RunProgram in a third of pickle's time, and
the host's receiver reads a ProgramDone in half (their dataclasses and dtypes
are what pickle spends its time on).
"""

from __future__ import annotations

import marshal
import pickle
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
        flat = torch.frombuffer(bytearray(self.data), dtype=self.dtype)
        return flat if len(self.shape) == 1 else flat.reshape(self.shape)  # 1-D (sampled tokens): as read


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


# ---- byte-stream encoding (pipes and sockets; a thread channel passes the objects) ---------------

_PICKLED, _RUN_PROGRAM, _PROGRAM_DONE = b"P", b"R", b"D"
_DTYPES: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    """The torch dtype whose str() is `name` ("torch.int32")."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name.removeprefix("torch."))
        assert isinstance(dtype, torch.dtype), name
        _DTYPES[name] = dtype
    return dtype


def _ints(values: object) -> bool:
    if type(values) is not tuple:
        return False
    for v in values:
        if type(v) is not int:
            return False
    return True


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """str(dtype) ("torch.int32"), cached: the step messages name a dtype per tensor, and the async
    machine's observation names the pending future's dtype on every step."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _plain(tensor: WireTensor | None) -> tuple | None:
    return None if tensor is None else (tensor.data, tensor.shape, dtype_name(tensor.dtype))


def _plain_ok(tensor: WireTensor | FutureRef | None) -> bool:
    """Hazard: a silently corrupted message. marshal writes any buffer (a numpy int in a shape) as
    bytes without complaint: only exact plain types go its way, anything else is pickled."""
    if tensor is None or type(tensor) is FutureRef:
        return True
    return type(tensor) is WireTensor and type(tensor.data) is bytes and _ints(tensor.shape)


def _plain_inputs(inputs: dict[str, ProgramInput]) -> dict[str, object] | None:
    """A RunProgram's inputs as marshal writes them (a FutureRef as its id, a tensor as a plain
    tuple), in one pass; None if one of them is not exactly of the plain types (then it is pickled)."""
    plain: dict[str, object] = {}
    for name, arg in inputs.items():
        kind = type(arg)
        if kind is WireTensor:
            if not _plain_ok(arg) or type(name) is not str:
                return None
            plain[name] = _plain(arg)
        elif kind is FutureRef and type(name) is str and type(arg.future_id) is int:
            plain[name] = arg.future_id
        else:
            return None
    return plain


def _wire(plain: tuple | None) -> WireTensor | None:
    return None if plain is None else WireTensor(plain[0], plain[1], _dtype(plain[2]))


def encode(message: HostMessage | DeviceMessage) -> bytes:
    """One message as bytes: a tag byte, then marshal (RunProgram, ProgramDone) or pickle (the rest)."""
    kind = type(message)
    if (
        kind is RunProgram
        and type(message.seq) is int
        and type(message.program) is str
        and _ints(message.out_shape)
        and _ints(message.releases)
        and type(message.push_output) is bool
        and (inputs := _plain_inputs(message.inputs)) is not None
    ):
        fields = (message.seq, message.program, inputs, message.out_shape, dtype_name(message.out_dtype))
        return _RUN_PROGRAM + marshal.dumps((*fields, message.push_output, message.releases))
    if (
        kind is ProgramDone
        and _ints((message.seq, message.live_futures, message.compilations))
        and type(message.device_time_s) is float
        and type(message.idle_s) is float
        and (message.error is None or type(message.error) is str)
        and _plain_ok(message.value)
    ):
        fields = (message.seq, message.device_time_s, message.error, message.live_futures, _plain(message.value))
        return _PROGRAM_DONE + marshal.dumps((*fields, message.idle_s, message.compilations))
    return _PICKLED + pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> HostMessage | DeviceMessage:
    """The message `encode` wrote."""
    tag, body = data[:1], memoryview(data)[1:]
    if tag == _RUN_PROGRAM:
        seq, program, inputs, out_shape, out_dtype, push, releases = marshal.loads(body)
        args = {name: FutureRef(arg) if type(arg) is int else _wire(arg) for name, arg in inputs.items()}
        return RunProgram(seq, program, args, out_shape, _dtype(out_dtype), push, releases)  # type: ignore[arg-type]
    if tag == _PROGRAM_DONE:
        seq, device_time_s, error, live, value, idle_s, compilations = marshal.loads(body)
        return ProgramDone(seq, device_time_s, error, live, _wire(value), idle_s, compilations)
    if tag != _PICKLED:
        raise ValueError(f"not an encoded message: tag {bytes(tag)!r}")
    return pickle.loads(body)
