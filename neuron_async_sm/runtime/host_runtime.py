"""The host side of the emulated runtime, shared by both transports."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections import deque
from collections.abc import Mapping

import torch

from neuron_async_sm.config import EngineConfig

from .api import DeviceFuture, DeviceRuntime, RuntimeStats, TensorSpec
from .devices import keep_off_cpu
from .errors import DeviceHungError, DeviceLostError, DeviceProgramError, DeviceStartupError
from .host_future import HostFuture
from .in_flight import InFlight, RuntimeState
from .messages import (
    DeviceMessage,
    Fetch,
    Fetched,
    FutureRef,
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
from .stats import StatsRecorder
from .transport import HostChannel

PUSH_MAX_BYTES = 4096
"""Outputs up to this size (a step's sampled token ids) come back with their ProgramDone."""


CLOSE_GRACE_S = 1.0
"""How long close() waits for the device to stop before forcing it down."""


class HostRuntime(DeviceRuntime):
    """``DeviceRuntime`` over a ``HostChannel`` to a ``DeviceLoop``.

    Threads: any number of callers (``enqueue``, ``to_host``, ``release``) plus
    one receiver thread that dispatches device messages and, unless
    ``device_timeout_s`` is 0, one watchdog thread. Locks, always taken in
    this order: a future's lock → ``_send_lock`` → ``_state_cv``.

    Nothing waits forever: every waiter (``to_host``, a blocked ``enqueue``)
    waits on something ``_device_gone`` releases, and it runs on EOF (the device
    died), on ``close()``, and from the watchdog when in-flight work sees no
    ``ProgramDone`` / ``Fetched`` for ``device_timeout_s`` (``DeviceHungError``).
    Two waits are unbounded on purpose: startup (``_await_ready``: building the
    programs may take as long as loading the weights does; a device that dies
    meanwhile gives EOF) and the receiver's ``recv`` on an idle device.

    - ``_send_lock`` orders everything sent to the device; sequence numbers are
      assigned under it, so message order == sequence order.
    - ``_state_cv`` guards lifecycle, in-flight bookkeeping and pending fetches.
      It is never held while sending: a sender blocked on a full pipe must not
      stop the receiver from draining the other direction (deadlock).
    """

    def __init__(self, channel: HostChannel, config: EngineConfig) -> None:
        self._channel = channel
        self._config = config
        self._programs = self._await_ready()
        self._send_lock = threading.Lock()
        self._next_seq = 0  # (send lock) sequence number == output future id
        self._next_fetch = 0  # (send lock)
        # GC'd futures wait here for the next send; deque.append takes no lock, so __del__ can never
        # deadlock on a lock its own thread already holds, nor interleave with a half-written message.
        self._deferred_releases: deque[int] = deque()
        # Lifecycle, queue slots and the watchdog (in_flight.py); its cv is this runtime's state lock.
        self._flight = InFlight(
            config.runtime_queue_depth, config.device_timeout_s, lambda: len(self._unfinished) + len(self._fetches)
        )
        self._state_cv = self._flight.cv
        self._close_started = False  # (state)
        self._unfinished: dict[int, threading.Event] = {}  # (state) seq → set when it completes
        self._fetches: dict[int, concurrent.futures.Future[WireTensor]] = {}  # (state) request → reply
        # (state) seq → its pushed output (None until its ProgramDone arrives) for every pushed
        # program whose output is neither read nor released yet.
        self._pushed: dict[int, WireTensor | None] = {}
        self._stats = StatsRecorder()
        self._receiver = threading.Thread(target=self._receive_loop, name="neuron-device-rx", daemon=True)
        self._receiver.start()
        self._flight.start_watchdog(self._forced_when_hung, self._on_hung)

    def _await_ready(self) -> frozenset[str]:
        # The factory loads the weights and warms up, which takes what it takes, but not forever: a
        # device that is not ready within device_startup_timeout_s (stopped, deadlocked, a load that
        # never returns) is killed, which ends the channel (EOF below). One that dies closes it anyway.
        limit = self._config.device_startup_timeout_s
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self._channel.kill()

        timer = threading.Timer(limit, expire) if limit > 0 else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            message: DeviceMessage = self._channel.recv()
        except (EOFError, OSError):
            reason = self._channel.describe_exit()
            self._channel.stop(0.0)
            if expired.is_set():
                raise DeviceStartupError(
                    f"device was not ready within device_startup_timeout_s={limit:g} s (loading the model "
                    f"and warming up); killed it: {reason}"
                ) from None
            raise DeviceStartupError(
                f"device exited before it was ready: {reason} (its own error, if any, is printed above)"
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
        if isinstance(message, Ready):
            return frozenset(message.programs)
        self._channel.stop(CLOSE_GRACE_S)
        if isinstance(message, StartupFailed):
            raise DeviceStartupError(message.error)
        raise DeviceStartupError(f"device sent {message!r} before it was ready")

    # ---- public API ------------------------------------------------------------------------------

    @property
    def runtime_queue_depth(self) -> int:
        return self._config.runtime_queue_depth

    @property
    def programs(self) -> frozenset[str]:
        return self._programs

    @property
    def down_reason(self) -> str | None:
        """Why the runtime stopped accepting work (closed, lost, hung); None while it runs."""
        return self._flight.down_reason

    @property
    def device_pid(self) -> int | None:
        """The device process id (fault tests kill it); None for the in-process backend."""
        return self._channel.pid

    def enqueue(
        self, program: str, inputs: Mapping[str, torch.Tensor | DeviceFuture | WireTensor], out: TensorSpec
    ) -> DeviceFuture:
        if program not in self._programs:
            raise ValueError(f"unknown program {program!r}; this device has {sorted(self._programs)}")
        # One pass over the inputs, exact type checks first (this runs on every step; isinstance on a
        # future goes through ABCMeta): host tensors are encoded now (copied: later host writes cannot
        # reach the device), an encoded WireTensor is immutable bytes and goes as is.
        wire: dict[str, ProgramInput] = {}
        fed: list[tuple[str, HostFuture]] = []
        upload_bytes = uploads = 0
        for name, value in inputs.items():
            kind = type(value)
            if kind is torch.Tensor:
                arg = WireTensor.encode(value)
            elif kind is WireTensor:
                if type(value.data) is not bytes:  # bytes are immutable: sent as is, never copied
                    raise TypeError(
                        f"input {name!r}: a WireTensor's data must be bytes, got {type(value.data).__name__}"
                    )
                arg = value
            elif isinstance(value, HostFuture):
                if value.owner is not self:
                    raise ValueError(f"input {name!r}: {value!r} belongs to another runtime")
                fed.append((name, value))
                wire[name] = FutureRef(value.future_id)  # device-to-device: the host never sees the value
                continue
            elif isinstance(value, torch.Tensor):
                arg = WireTensor.encode(value)
            else:
                raise TypeError(f"input {name!r}: expected a tensor or a DeviceFuture, got {type(value).__name__}")
            wire[name] = arg
            upload_bytes += len(arg.data)
            uploads += 1
        push = out.dtype.itemsize * math.prod(out.shape) <= PUSH_MAX_BYTES
        self._flight.acquire_slot()
        finished = threading.Event()
        sent = False
        try:
            with self._send_lock:
                for name, value in fed:
                    # Hazard: freed in-flight input. A released future's device memory is gone (or
                    # will be, by the time this program runs); checked under the send lock, which
                    # release() holds while it flags the future and sends the Release.
                    if value.released:
                        raise ValueError(f"input {name!r}: {value!r} was released")
                seq = self._next_seq
                self._next_seq += 1
                with self._state_cv:
                    # Registered under the state lock: a device loss either sees this entry and
                    # sets it, or happened first and we raise — the waiter can never hang.
                    self._flight.raise_if_down_locked()
                    self._flight.work_arrives_locked()
                    self._unfinished[seq] = finished
                    if push:
                        self._pushed[seq] = None
                    # One message instead of two: the device frees these before it runs the program.
                    releases = self._take_deferred_releases_locked() if self._deferred_releases else ()
                self._send(RunProgram(seq, program, wire, out.shape, out.dtype, push, releases))
                sent = True
        finally:
            if not sent:
                self._flight.return_slot()
        if uploads:
            self._stats.host_upload(upload_bytes, uploads)
        return HostFuture(self, seq, out, finished)

    def stats(self) -> RuntimeStats:
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    def close(self) -> None:
        self._close(CLOSE_GRACE_S)

    def kill(self) -> None:
        """``close()`` that does not wait for the device: it is forced down at once."""
        self._close(0.0)

    def _close(self, grace: float) -> None:
        with self._state_cv:
            if self._close_started:
                return
            self._close_started = True
            self._flight.go_down_locked(RuntimeState.CLOSED, "the runtime was closed")  # blocked enqueues raise
        if grace == 0:
            # Hazard: a Shutdown sent to a stopped device can block forever on a full pipe; to a
            # killed one it fails at once. A device thread is not killed: it gets the Shutdown.
            self._channel.kill()
        # A sender stuck on a full pipe holds the send lock; do not wait on it forever.
        if self._send_lock.acquire(timeout=grace):
            try:
                self._channel.send(Shutdown())
            except OSError:
                pass  # already gone
            finally:
                self._send_lock.release()
        stopped = self._channel.stop(grace)
        # Fail the waiters here as well: a device thread stuck in a program never reaches EOF.
        self._device_gone(self._flight.reason)
        if stopped:
            # It sees EOF at once (briefly joined even by kill()); an abandoned device thread never sends it.
            self._receiver.join(grace or 0.5)
        self._flight.join_watchdog(grace or 0.5)
        self._deferred_releases.clear()

    # ---- FutureOwner (called by HostFuture) ------------------------------------------------------

    def fetch(self, future_id: int) -> torch.Tensor:
        with self._state_cv:
            pushed = future_id in self._pushed
            finished = self._unfinished.get(future_id)
        if pushed:
            if finished is not None:
                # Set after the pushed value is stored, or by _device_gone: the device died, was
                # closed, or the watchdog declared it hung. Bounded by device_timeout_s (0: unbounded).
                finished.wait()
            with self._state_cv:
                value = self._pushed.pop(future_id, None)
            if value is not None:
                self._stats.host_transfer(value.nbytes)
                return value.decode()
            # Nothing pushed: the program failed, or the device is gone. Ask the device, which
            # reports the failure (or raise DeviceLostError below).
        reply: concurrent.futures.Future[WireTensor] = concurrent.futures.Future()
        with self._send_lock:
            request_id = self._next_fetch
            self._next_fetch += 1
            with self._state_cv:
                self._flight.raise_if_down_locked()
                self._flight.work_arrives_locked()
                self._fetches[request_id] = reply
            self._send(Fetch(request_id, future_id))
        # Blocks; raises what the receiver set (program failure) or _device_gone did (loss, close,
        # hang). Bounded by device_timeout_s like every waiter (0: unbounded).
        value = reply.result()
        self._stats.host_transfer(value.nbytes)
        return value.decode()

    def release(self, future: HostFuture) -> None:
        with self._send_lock:
            if not future.mark_released():
                return
            with self._state_cv:
                self._pushed.pop(future.future_id, None)
                if self._flight.state is not RuntimeState.RUNNING:
                    return  # device memory went with the device
            try:
                # Safe to send now: the device processes this after every program already sent,
                # so none of them can lose the tensor (see DeviceLoop._handle).
                self._send(Release((future.future_id,)))
            except DeviceLostError:
                pass

    def defer_release(self, future_id: int) -> None:
        self._deferred_releases.append(future_id)

    # ---- internals -------------------------------------------------------------------------------

    def _take_deferred_releases_locked(self) -> tuple[int, ...]:
        """The futures GC'd since the last send, forgotten here. Caller holds ``_send_lock`` and ``_state_cv``.

        They only ever name futures nobody can pass to a later program (this one included), so
        sending them late, or with the next RunProgram, is safe."""
        if not self._deferred_releases:
            return ()
        released: list[int] = []
        while self._deferred_releases:
            released.append(self._deferred_releases.popleft())
        for future_id in released:
            self._pushed.pop(future_id, None)
        return tuple(released)

    def _send(self, message: HostMessage) -> None:
        """Caller holds ``_send_lock``. A message other than a RunProgram (which carries them, see
        enqueue) first flushes the deferred releases as a Release of their own."""
        try:
            if self._deferred_releases and not isinstance(message, RunProgram):
                with self._state_cv:
                    released = self._take_deferred_releases_locked()
                if released:
                    self._channel.send(Release(released))
            self._channel.send(message)
        except OSError as exc:
            reason = self._channel.describe_exit()
            self._device_gone(reason)
            error = DeviceHungError if self._flight.state is RuntimeState.HUNG else DeviceLostError  # final once down
            raise error(f"device lost while sending: {reason} ({exc})") from exc

    def _receive_loop(self) -> None:
        """Receiver thread: dispatch completions and fetched values until the device is gone."""
        reason = "the device channel closed"
        keep_off_cpu(self._config.device_cpu)  # this thread is the first the device wakes
        try:
            while True:
                message = self._channel.recv()
                if isinstance(message, ProgramDone):
                    self._on_program_done(message)
                elif isinstance(message, Fetched):
                    self._on_fetched(message)
                else:
                    raise TypeError(f"unexpected device message {message!r}")
        except (EOFError, OSError):
            reason = self._channel.describe_exit()
        except BaseException as exc:  # a receiver bug must still release every waiter
            reason = f"receiver thread failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._device_gone(reason)

    def _on_program_done(self, message: ProgramDone) -> None:
        self._stats.program_done(
            message.device_time_s, message.error is not None, message.live_futures, message.idle_s, message.compilations
        )
        with self._state_cv:
            self._flight.progress_locked()
            if message.seq in self._pushed:  # else: not pushed, or already released
                self._pushed[message.seq] = message.value  # stored before `finished` is set
            finished = self._unfinished.pop(message.seq, None)  # None: close() already released it
            if finished is not None:
                finished.set()  # before the slot is freed: whoever takes the slot sees this program done
            self._flight.free_slot_locked()

    def _on_fetched(self, message: Fetched) -> None:
        with self._state_cv:
            self._flight.progress_locked()
            reply = self._fetches.pop(message.request_id, None)
        if reply is None:
            return  # close() already failed this waiter with DeviceLostError
        if message.value is not None:
            reply.set_result(message.value)
        else:
            reply.set_exception(DeviceProgramError(message.error or "fetch failed"))

    def _forced_when_hung(self) -> str:
        """What the watchdog does to a hung device (called under the state lock, before it does it)."""
        pid = self._channel.pid
        return "abandoned the device thread" if pid is None else f"killed device process {pid}"

    def _on_hung(self) -> None:
        """Watchdog thread, the device declared hung: force it down (a process is killed, a thread
        abandoned) and release every waiter with DeviceHungError, like any lost device."""
        self._channel.kill()
        self._device_gone(self._flight.reason)

    def _device_gone(self, reason: str) -> None:
        """Stop accepting work and release every waiter with DeviceLostError (idempotent)."""
        with self._state_cv:
            self._flight.go_down_locked(RuntimeState.LOST, reason)
            for finished in self._unfinished.values():
                finished.set()
            self._unfinished.clear()
            self._pushed.clear()
            fetches, self._fetches = self._fetches, {}
            errors = [(reply, self._flight.down_error_locked()) for reply in fetches.values()]  # one per waiter
        self._flight.mark_down()
        for reply, error in errors:
            reply.set_exception(error)
