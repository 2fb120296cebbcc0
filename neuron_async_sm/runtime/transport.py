"""The two transports between the host runtime and the device loop.

``ProcessChannel`` runs the device loop in a spawned process and talks over a
``multiprocessing`` pipe; ``ThreadChannel`` runs it on a thread and talks over
two ``queue.Queue``. Everything else (the loop, the host runtime) is shared.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import struct
import sys
import threading
import traceback
from abc import ABC, abstractmethod

import torch

from .api import ProgramFactory
from .device_loop import DeviceLoop
from .errors import DeviceStartupError
from .messages import DeviceMessage, HostMessage, StartupFailed, decode, encode


class HostChannel(ABC):
    """The host's end of a transport. ``send`` is called under the runtime's send lock;
    ``recv`` only from its single receiver thread."""

    @abstractmethod
    def send(self, message: HostMessage) -> None:
        """Raises OSError (e.g. BrokenPipeError) when the device is gone."""

    @abstractmethod
    def recv(self) -> DeviceMessage:
        """Block for the next message; raises EOFError (or OSError) when the device is gone."""

    @abstractmethod
    def stop(self, grace_s: float) -> bool:
        """Wait up to ``grace_s`` for the device to exit after Shutdown, then force it (idempotent).

        Returns whether the device is down (False: a device thread stuck in a program was abandoned).
        """

    @abstractmethod
    def describe_exit(self) -> str:
        """Why the device went away, for DeviceLostError messages."""

    @abstractmethod
    def kill(self) -> None:
        """Force a hung device down now, leaving the channel open (the receiver then sees EOF).

        A device that cannot be forced down is abandoned; the runtime releases its waiters all the same.
        """

    @property
    def pid(self) -> int | None:
        """The device process id, or None when the device is not a process."""
        return None


# ---- process backend -----------------------------------------------------------------------------

_FRAME_HEADER = struct.Struct("!i")  # multiprocessing.Connection's frame: the length, then the bytes
_MAX_FRAME = 0x7FFFFFFF  # longer messages take send_bytes's other framing


class _PipeDeviceEnd:
    """The device's end of the pipe (a ``device_loop.DeviceChannel``)."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn

    def recv(self, block: bool) -> HostMessage | None:
        if not block and not self._conn.poll():
            return None
        return decode(self._conn.recv_bytes())  # type: ignore[return-value]

    def send(self, message: DeviceMessage) -> None:
        self._conn.send_bytes(encode(message))


def _device_process_main(
    conn: multiprocessing.connection.Connection,
    factory: ProgramFactory,
    device_time_ms: float,
    device_threads: int,
    device_cpu: int | None,
) -> None:
    """Entry point of the device process."""
    # Ctrl-C reaches the whole process group; the host decides when the device stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(device_threads)
    code = 0
    try:
        if device_cpu is not None:
            try:
                os.sched_setaffinity(0, {device_cpu})  # the emulated device owns this core, as hardware would
            except OSError as exc:
                _PipeDeviceEnd(conn).send(StartupFailed(f"device_cpu={device_cpu}: cannot pin the device: {exc}"))
                return
        DeviceLoop(device_time_ms).serve(_PipeDeviceEnd(conn), factory)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # Exit without interpreter teardown (~0.4 s with torch loaded): device memory dies with the
        # process and nothing else needs flushing, so close() and loss detection stay prompt.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ProcessChannel(HostChannel):
    """Device loop in a spawned process (``device="cpu"``): host and device truly overlap."""

    def __init__(
        self, factory: ProgramFactory, device_time_ms: float, device_threads: int, device_cpu: int | None = None
    ) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # A spawned child still importing the user's script (the flag multiprocessing itself checks
            # before refusing to start a process): the script's module-level code started an engine.
            raise DeviceStartupError(
                "the device is a spawned process, which re-runs your script's module-level code: put the code "
                'that creates the LLM under `if __name__ == "__main__":` (see the README\'s Python example)'
            )
        ctx = multiprocessing.get_context("spawn")
        # Hazard: two threads reaping the same child (close() in stop, the receiver in describe_exit)
        # make one waitpid fail with ECHILD; Process then reports a dead child as alive and
        # close() would signal a pid that may have been reused.
        self._reap_lock = threading.Lock()
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_device_process_main,
            args=(child_conn, factory, device_time_ms, device_threads, device_cpu),
            name="neuron-device",
            daemon=True,  # never outlive the host, even if close() is never called
        )
        try:
            self._process.start()
        except Exception as exc:
            self._conn.close()
            raise DeviceStartupError(
                f"could not start the device process for {factory!r} (the factory must be picklable, "
                f"e.g. a module-level frozen dataclass): {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            # Drop the host's copy of the child's end: once the child dies, the pipe has no writer
            # left and recv() raises EOFError instead of hanging forever.
            child_conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # Messages are bytes of our own (messages.encode: marshal or a plain pickle), not Connection.send's
    # ForkingPickler, which copies its reducer table on every call. They hold no tensors (WireTensor
    # is bytes), so multiprocessing's tensor reductions are never needed.
    def send(self, message: HostMessage) -> None:
        data = encode(message)
        if len(data) > _MAX_FRAME:
            self._conn.send_bytes(data)
            return
        # Connection.send_bytes's frame (a 4-byte big-endian length, then the bytes) written straight
        # to the pipe: one os.write as it makes for a small message, without its checks and copies.
        fd = self._conn.fileno()  # raises OSError once the channel is closed
        frame = memoryview(_FRAME_HEADER.pack(len(data)) + data)
        while frame:
            frame = frame[os.write(fd, frame) :]

    def recv(self) -> DeviceMessage:
        return decode(self._conn.recv_bytes())  # type: ignore[return-value]

    def stop(self, grace_s: float) -> bool:
        with self._reap_lock:
            self._process.join(grace_s)
            if self._process.is_alive():
                self._process.terminate()
                # Hazard: a stopped (SIGSTOPped) child holds SIGTERM pending until it is continued;
                # without SIGCONT the join below waits out its whole second before the SIGKILL.
                self._signal(signal.SIGCONT)
                self._process.join(1.0)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(1.0)
            stopped = not self._process.is_alive()
        self._conn.close()
        return stopped

    def kill(self) -> None:
        with self._reap_lock:
            if self._process.is_alive():
                self._process.kill()  # SIGKILL is delivered even to a stopped process
                self._process.join(1.0)

    def _signal(self, signum: signal.Signals) -> None:
        """Caller holds the reap lock and saw the child alive: its pid cannot have been reused."""
        try:
            os.kill(self._process.pid, signum)  # type: ignore[arg-type]
        except ProcessLookupError:
            pass  # exited in between; the join reaps it

    def describe_exit(self) -> str:
        with self._reap_lock:
            self._process.join(2.0)  # reap it so the exit code is known (EOF can precede the exit)
        code = self._process.exitcode
        if code is None:
            return f"lost the channel to device process {self._process.pid}"
        if code < 0:
            return f"device process {self._process.pid} was killed by signal {-code}"
        return f"device process {self._process.pid} exited with code {code}"


# ---- thread backend ------------------------------------------------------------------------------


class _EndOfStream:
    """Put on the host's queue when the device thread exits: the queue's stand-in for EOF."""


class _QueueDeviceEnd:
    """The device's end of the queue pair (a ``device_loop.DeviceChannel``)."""

    def __init__(self, inbox: queue.SimpleQueue[HostMessage], outbox: queue.SimpleQueue[object]) -> None:
        self._inbox = inbox
        self._outbox = outbox

    def recv(self, block: bool) -> HostMessage | None:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None

    def send(self, message: DeviceMessage) -> None:
        self._outbox.put(message)


class ThreadChannel(HostChannel):
    """Device loop on a thread of this process (``device="cpu-inprocess"``): fast to start,
    same semantics, but the host and the device share the GIL."""

    def __init__(self, factory: ProgramFactory, device_time_ms: float) -> None:
        self._inbox: queue.SimpleQueue[HostMessage] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._main, args=(factory, device_time_ms), name="neuron-device", daemon=True
        )
        self._exit_reason = "device thread is running"
        self._thread.start()

    def _main(self, factory: ProgramFactory, device_time_ms: float) -> None:
        try:
            DeviceLoop(device_time_ms).serve(_QueueDeviceEnd(self._inbox, self._outbox), factory)
            self._exit_reason = "device thread exited"
        except BaseException as exc:  # a crash reaches the host as end-of-stream plus this reason
            self._exit_reason = f"device thread crashed: {type(exc).__name__}: {exc}"
        finally:
            self._outbox.put(_EndOfStream())

    def send(self, message: HostMessage) -> None:
        if not self._thread.is_alive():
            raise BrokenPipeError(self._exit_reason)
        self._inbox.put(message)

    def recv(self) -> DeviceMessage:
        message = self._outbox.get()
        if isinstance(message, _EndOfStream):
            self._outbox.put(message)  # stay at end-of-stream for any later recv
            raise EOFError(self._exit_reason)
        return message  # type: ignore[return-value]

    def stop(self, grace_s: float) -> bool:
        # A thread cannot be killed: one stuck in a program is abandoned (it is a daemon).
        self._thread.join(grace_s)
        return not self._thread.is_alive()

    def describe_exit(self) -> str:
        return self._exit_reason

    def kill(self) -> None:
        pass  # a thread cannot be killed: a hung one is abandoned (a daemon); the runtime fails its waiters
