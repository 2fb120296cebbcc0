"""The emulated device: device memory, the programs, and the in-order execution loop.

Both backends run this same loop; they differ only in the channel that
carries messages (a pipe to a spawned process, or a pair of queues to a
thread).
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from .api import Program, ProgramFactory
from .messages import (
    DeviceMessage,
    Fetch,
    Fetched,
    HostMessage,
    ProgramDone,
    ProgramInput,
    Ready,
    Release,
    RunProgram,
    Shutdown,
    StartupFailed,
    WireTensor,
)
from .stats import graph_compilations


class DeviceChannel(Protocol):
    """The device's end of a transport."""

    def recv(self, block: bool) -> HostMessage | None:
        """Next message; None only when ``block`` is False and nothing is waiting.

        Raises EOFError (or OSError) when the host is gone.
        """

    def send(self, message: DeviceMessage) -> None: ...


@dataclass(frozen=True)
class FailedValue:
    """What device memory holds for the output of a failed program."""

    message: str  # this program's failure
    root_cause: str  # the first failure in the chain of inputs (== message for a direct failure)


class _InputFailed(Exception):
    """An input future's program failed, so this program cannot run."""

    def __init__(self, name: str, failure: FailedValue) -> None:
        super().__init__(name)
        self.name = name
        self.failure = failure


class DeviceLoop:
    """Executes host messages strictly in arrival order.

    Device memory is ``future id → tensor | FailedValue``. In-order processing
    is the whole synchronization story: a ``RunProgram`` finds every input
    future already computed (its producer arrived earlier), a ``Fetch`` sees
    the finished value, and a ``Release`` can only free memory that every
    program enqueued before it has already consumed.
    """

    def __init__(self, device_time_ms: float) -> None:
        self._hold_s = device_time_ms / 1000.0
        self._programs: dict[str, Program] = {}
        self._memory: dict[int, torch.Tensor | FailedValue] = {}
        self._idle_s = 0.0  # blocked waiting for a message since the last ProgramDone
        self._compiled_at_start = 0  # graph_compilations() once the programs were built (compiled ones too)

    def serve(self, channel: DeviceChannel, factory: ProgramFactory) -> None:
        """Build the programs, report readiness, then process messages until Shutdown or EOF."""
        try:
            self._programs = dict(factory(torch.device("cpu")))
            self._compiled_at_start = graph_compilations()
        except Exception:
            channel.send(StartupFailed(f"program factory {factory!r} failed:\n{traceback.format_exc()}"))
            return
        channel.send(Ready(tuple(sorted(self._programs))))
        pending: deque[HostMessage] = deque()
        try:
            while True:
                if pending:
                    message = pending.popleft()
                else:
                    waited = time.perf_counter()
                    message = channel.recv(block=True)
                    # Idle device: the host had nothing queued. In async steady state this stays
                    # near zero, which is what "the host is hidden behind the device" means.
                    self._idle_s += time.perf_counter() - waited
                # Read ahead what is already queued so a Shutdown behind queued programs stops
                # the device now, not after the backlog (close() must not wait for it). Only
                # Shutdown skips the line; everything else keeps its place in `pending`.
                while (ahead := channel.recv(block=False)) is not None:
                    if isinstance(ahead, Shutdown):
                        return
                    pending.append(ahead)
                if isinstance(message, Shutdown):
                    return
                reply = self._handle(message)
                if reply is not None:
                    channel.send(reply)
        except (EOFError, OSError):
            return  # the host is gone; nobody is left to serve

    def _handle(self, message: HostMessage) -> DeviceMessage | None:
        if isinstance(message, RunProgram):
            self._release(message.releases)  # a Release sent with the program, handled as if just before it
            return self._run(message)
        if isinstance(message, Fetch):
            return self._fetch(message)
        if isinstance(message, Release):
            self._release(message.future_ids)
            return None
        raise TypeError(f"device loop got an unknown message {message!r}")

    def _release(self, future_ids: tuple[int, ...]) -> None:
        for future_id in future_ids:
            # Freeing here is safe: every program enqueued before this Release has already
            # run (in-order processing), so no queued program can still need this tensor.
            self._memory.pop(future_id, None)

    def _run(self, message: RunProgram) -> ProgramDone:
        label = f"program {message.program!r} (#{message.seq})"
        start = time.perf_counter()
        try:
            inputs = {name: self._resolve(name, arg) for name, arg in message.inputs.items()}
            program = self._programs[message.program]
            start = time.perf_counter()  # device time counts execution, not input decoding
            with torch.no_grad():
                out = program(**inputs)
            _check_output(out, message)
            # Emulated accelerator speed: hold the device until device_time_ms has elapsed.
            remaining = start + self._hold_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        except _InputFailed as failed:
            root = failed.failure.root_cause
            failure = FailedValue(f"{label} not run: input {failed.name!r} depends on {root}", root)
        except Exception as exc:
            error = f"{label} failed: {type(exc).__name__}: {exc}"
            failure = FailedValue(error, error)
        else:
            self._memory[message.seq] = out
            elapsed = time.perf_counter() - start
            value = WireTensor.encode(out) if message.push_output else None
            live, idle = len(self._memory), self._take_idle()
            return ProgramDone(message.seq, elapsed, None, live, value, idle, self._compiled())
        self._memory[message.seq] = failure
        elapsed = time.perf_counter() - start
        live, idle = len(self._memory), self._take_idle()
        return ProgramDone(message.seq, elapsed, failure.message, live, None, idle, self._compiled())

    def _compiled(self) -> int:
        return graph_compilations() - self._compiled_at_start

    def _take_idle(self) -> float:
        idle, self._idle_s = self._idle_s, 0.0
        return idle

    def _resolve(self, name: str, arg: ProgramInput) -> torch.Tensor:
        if isinstance(arg, WireTensor):
            return arg.decode()
        value = self._memory.get(arg.future_id)
        if value is None:
            # The host refuses released futures as inputs, so reaching this is a runtime bug.
            raise RuntimeError(f"input {name!r}: future #{arg.future_id} is not in device memory")
        if isinstance(value, FailedValue):
            raise _InputFailed(name, value)
        return value

    def _fetch(self, message: Fetch) -> Fetched:
        value = self._memory.get(message.future_id)
        if value is None:
            error = f"future #{message.future_id} is not in device memory (released?)"
            return Fetched(message.request_id, None, error)
        if isinstance(value, FailedValue):
            return Fetched(message.request_id, None, value.message)
        return Fetched(message.request_id, WireTensor.encode(value), None)


def _check_output(out: object, message: RunProgram) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"returned {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != message.out_shape or out.dtype != message.out_dtype:
        raise TypeError(f"returned {out.dtype}{list(out.shape)}, expected {message.out_dtype}{list(message.out_shape)}")
