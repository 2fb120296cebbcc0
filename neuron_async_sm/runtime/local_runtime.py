"""The host side of a real device driven from this process (XLA, torch.accelerator).

A real device needs no device loop or message channel: a program is called on the enqueueing thread,
which only *issues* its work (XLA: traces and dispatches a graph; a stream: queues kernels), and the
device runs it later, in issue order. What such a backend adds is small and lives in ``DeviceOps``.
``LocalRuntime`` keeps everything else the worker relies on: one order of programs, failures that
follow the data, the bounded queue, call-once host copies (``HostFuture``) and the stats.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from neuron_async_sm.config import EngineConfig

from .api import DeviceFuture, DeviceRuntime, Program, ProgramFactory, RuntimeStats, TensorSpec, WarmupCall
from .device_loop import FailedValue
from .errors import DeviceProgramError, DeviceStartupError
from .host_future import HostFuture
from .in_flight import InFlight, RuntimeState
from .messages import WireTensor
from .stats import StatsRecorder, graph_compilations

logger = logging.getLogger("neuron_async_sm")

Ready = Callable[[str | None], None]
"""Completion callback: None when the program's output exists, else the device's error text."""


class DeviceOps(ABC):
    """What one kind of real device contributes to ``LocalRuntime``."""

    device: torch.device  # where programs' tensors live; the program factory is called with it
    compiles: bool = False  # each input shape is its own compiled program (see compilations())

    @abstractmethod
    def launch(self, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, object]:
        """Run ``call`` so that its work is queued on the device; return its output and a completion token.

        Must return without waiting for the device (except where the device is the host).
        """

    @abstractmethod
    def when_ready(self, token: object, ready: Ready) -> None:
        """Call ``ready`` (from any thread, possibly this one) once the launch behind ``token`` finished."""

    @abstractmethod
    def to_host(self, out: torch.Tensor, token: object) -> torch.Tensor:
        """Blocking copy of an output (finished or still running; ``token`` from its launch) to the host."""

    def compilations(self) -> int:
        """Programs compiled so far in this process (a counter): here torch.compile's graphs."""
        return graph_compilations()

    def settle(self) -> None:
        """Make the state the program factory left on the device (weights, KV cache) device memory,
        before the first program runs. Default: nothing to do (an eager device computed it already)."""
        return None

    def close(self) -> None:
        """Stop helper threads (idempotent). Work already on the device finishes on its own."""
        return None


@dataclass(frozen=True)
class _Stored:
    """Device memory of one successful program."""

    value: torch.Tensor  # the output, on the device
    token: object  # its launch's completion token (what to_host waits on)


@dataclass(frozen=True)
class WarmupRecord:
    """What one warm-up call cost."""

    label: str
    seconds: float  # launch + compile + run + host copy
    compilations: int  # programs this call compiled (0: its shape was already cached)


class _InputFailed(Exception):
    def __init__(self, name: str, failure: FailedValue) -> None:
        super().__init__(name)
        self.name = name
        self.failure = failure


def _same_kind(produced: torch.dtype, expected: torch.dtype) -> bool:
    """An integer width the device prefers is acceptable (the future then reports it); nothing else is."""
    if produced == expected:
        return True
    ints = not produced.is_floating_point and not produced.is_complex and produced != torch.bool
    return ints and not expected.is_floating_point and not expected.is_complex and expected != torch.bool


class LocalRuntime(DeviceRuntime):
    """``DeviceRuntime`` over a device this process drives directly (see ``DeviceOps``).

    Locks, in this order: ``_launch_lock`` → ``_state_cv``. ``_launch_lock`` makes enqueue order the
    device's order (a program is issued whole before the next one starts). ``_state_cv`` (the
    ``InFlight``'s lock) guards the lifecycle, the slot count and the completion events; completion
    callbacks (device threads) take only it, and never wait while holding it.

    Nothing waits forever: unless ``device_timeout_s`` is 0, the watchdog (``InFlight``) declares the
    device hung when a program is in flight and nothing completed for that long; every waiter then
    gets ``DeviceHungError``. A thread stuck inside a program that never returns (a synchronous device)
    cannot be freed; it is left to the device, and everything else goes on failing fast.
    """

    def __init__(
        self, ops: DeviceOps, programs: ProgramFactory, config: EngineConfig, warmup: Sequence[WarmupCall] = ()
    ) -> None:
        if config.device_time_ms or config.device_cpu is not None:
            raise ValueError("device_time_ms and device_cpu shape the emulated device only")
        self._ops = ops
        self._config = config
        try:
            self._programs: dict[str, Program] = dict(programs(ops.device))
        except Exception:
            ops.close()
            raise DeviceStartupError(f"program factory {programs!r} failed:\n{traceback.format_exc()}") from None
        ops.settle()  # before warm-up: the first program's graph must be the one serving runs (xla_runtime.py)
        self._launch_lock = threading.Lock()
        self._next_seq = 0  # (launch lock) sequence number == output future id
        # Device memory: future id -> output tensor, or the failure that took its place. Entries go on
        # release; dict.pop needs no lock, so a GC'd future's __del__ can free its entry from any thread.
        self._memory: dict[int, _Stored | FailedValue] = {}
        # Lifecycle, queue slots and the watchdog (in_flight.py); its cv is this runtime's state lock.
        self._flight = InFlight(config.runtime_queue_depth, config.device_timeout_s, lambda: len(self._unfinished))
        self._state_cv = self._flight.cv
        self._unfinished: dict[int, threading.Event] = {}  # (state) seq -> set when its output exists
        self._launched_at: dict[int, float] = {}  # (state) seq -> when launch returned
        self._last_done = time.perf_counter()  # (state) when the device last finished a program
        self._stats = StatsRecorder()
        self._compilations_base = ops.compilations()
        self.warmup_report: tuple[WarmupRecord, ...] = self._warm_up(warmup)
        self.reset_stats()  # stats, the compilation count included, start after warm-up
        # After warm-up: compiling a program blocks its launch for seconds, which is not a hang.
        self._flight.start_watchdog(self._forced_when_hung, self._on_hung)

    # ---- public API ------------------------------------------------------------------------------

    @property
    def runtime_queue_depth(self) -> int:
        return self._config.runtime_queue_depth

    @property
    def compiles_per_shape(self) -> bool:
        return self._ops.compiles

    @property
    def down_reason(self) -> str | None:
        """Why the runtime stopped accepting work (closed, lost, hung); None while it runs."""
        return self._flight.down_reason

    @property
    def device(self) -> torch.device:
        return self._ops.device

    @property
    def programs(self) -> frozenset[str]:
        return frozenset(self._programs)

    def enqueue(self, program: str, inputs: Mapping[str, torch.Tensor | DeviceFuture], out: TensorSpec) -> DeviceFuture:
        if program not in self._programs:
            raise ValueError(f"unknown program {program!r}; this device has {sorted(self._programs)}")
        host_inputs = {name: self._copy_input(name, value) for name, value in inputs.items()}
        self._flight.acquire_slot()
        finished = threading.Event()
        seq: int | None = None
        try:
            with self._launch_lock:
                for name, value in inputs.items():
                    # Hazard: freed in-flight input. Checked under the launch lock, which release() holds.
                    if isinstance(value, HostFuture) and value.released:
                        raise ValueError(f"input {name!r}: {value!r} was released")
                seq = self._next_seq
                with self._state_cv:
                    self._flight.raise_if_down_locked()
                    # In flight from here, before it is issued: a program that hangs while being
                    # issued (a synchronous device) is work the watchdog sees.
                    self._flight.work_arrives_locked()
                    self._unfinished[seq] = finished
                self._next_seq += 1
                spec, token, launched = self._launch(seq, program, inputs, host_inputs, out)
                with self._state_cv:
                    self._launched_at[seq] = time.perf_counter()
        except BaseException:
            with self._state_cv:
                if seq is not None:
                    self._unfinished.pop(seq, None)
                self._flight.free_slot_locked()
            raise
        for value in host_inputs.values():
            if value is not None:
                self._stats.host_upload(value.nbytes)
        if not launched:  # failed at launch: nothing reached the device
            self._complete(seq, self._memory[seq].message)  # type: ignore[union-attr]
        else:
            self._ops.when_ready(token, lambda error: self._complete(seq, error))
        return HostFuture(self, seq, spec, finished)

    def stats(self) -> RuntimeStats:
        return replace(self._stats.snapshot(), compilations=self._ops.compilations() - self._compilations_base)

    def reset_stats(self) -> None:
        self._stats.reset()
        self._compilations_base = self._ops.compilations()

    def close(self) -> None:
        with self._state_cv:
            self._flight.go_down_locked(RuntimeState.CLOSED, "the runtime was closed")  # blocked enqueues raise
        self._release_waiters()
        self._flight.join_watchdog(0.5)
        self._ops.close()
        self._memory.clear()

    # ---- FutureOwner (called by HostFuture) ------------------------------------------------------

    def fetch(self, future_id: int) -> torch.Tensor:
        with self._state_cv:
            self._flight.raise_if_down_locked()
            finished = self._unfinished.get(future_id)
        if finished is not None:
            # Set when the program finished, on close, or by the watchdog (a hung device): bounded by
            # device_timeout_s (0: unbounded). The copy below then never waits on a hung device.
            finished.wait()
            with self._state_cv:
                self._flight.raise_if_down_locked()
        value = self._memory.get(future_id)
        if value is None:
            raise DeviceProgramError(f"future #{future_id} is not in device memory (released?)")
        if isinstance(value, FailedValue):
            raise DeviceProgramError(value.message)
        try:
            host = self._ops.to_host(value.value, value.token)  # the program ran: a copy, no wait on the device
        except Exception as exc:
            raise DeviceProgramError(f"program #{future_id} failed on the device: {type(exc).__name__}: {exc}") from exc
        with self._state_cv:
            self._flight.raise_if_down_locked()  # closed meanwhile: the value is no longer the device's to give
        self._stats.host_transfer(host.nbytes)
        return host

    def release(self, future: HostFuture) -> None:
        with self._launch_lock:
            if future.mark_released():
                # Safe now: every program that read this tensor was issued already and holds it itself.
                self._memory.pop(future.future_id, None)

    def defer_release(self, future_id: int) -> None:
        self._memory.pop(future_id, None)

    # ---- internals -------------------------------------------------------------------------------

    def _copy_input(self, name: str, value: torch.Tensor | DeviceFuture | WireTensor) -> torch.Tensor | None:
        if isinstance(value, HostFuture):
            if value.owner is not self:
                raise ValueError(f"input {name!r}: {value!r} belongs to another runtime")
            return None  # device-to-device: passed as is
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)  # copied now: later host writes cannot reach the device
        if type(value) is WireTensor:
            return value.decode()  # an encoded host tensor: its bytes are immutable, decode() copies them
        raise TypeError(f"input {name!r}: expected a tensor or a DeviceFuture, got {type(value).__name__}")

    def _launch(
        self,
        seq: int,
        program: str,
        inputs: Mapping[str, torch.Tensor | DeviceFuture],
        host_inputs: Mapping[str, torch.Tensor | None],
        out: TensorSpec,
    ) -> tuple[TensorSpec, object, bool]:
        """Issue one program (caller holds the launch lock). Returns the future's spec, the completion
        token and whether it was launched (False: it failed before reaching the device)."""
        label = f"program {program!r} (#{seq})"
        try:
            args = {name: self._resolve(name, inputs[name], host) for name, host in host_inputs.items()}

            def call() -> torch.Tensor:
                with torch.no_grad():
                    return self._programs[program](**args)

            value, token = self._ops.launch(call)
            spec = self._check_output(value, out)
        except _InputFailed as failed:
            root = failed.failure.root_cause
            self._memory[seq] = FailedValue(f"{label} not run: input {failed.name!r} depends on {root}", root)
            return out, None, False
        except Exception as exc:
            error = f"{label} failed: {type(exc).__name__}: {exc}"
            self._memory[seq] = FailedValue(error, error)
            return out, None, False
        self._memory[seq] = _Stored(value, token)
        return spec, token, True

    def _resolve(self, name: str, value: torch.Tensor | DeviceFuture, host: torch.Tensor | None) -> torch.Tensor:
        if host is not None:
            return host
        assert isinstance(value, HostFuture)
        stored = self._memory.get(value.future_id)
        if stored is None:
            raise RuntimeError(f"input {name!r}: future #{value.future_id} is not in device memory")
        if isinstance(stored, FailedValue):
            raise _InputFailed(name, stored)
        return stored.value

    def _check_output(self, value: object, out: TensorSpec) -> TensorSpec:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"returned {type(value).__name__}, expected a tensor")
        if value.device.type != self._ops.device.type:
            raise TypeError(f"returned a tensor on {value.device}, expected one on {self._ops.device}")
        if tuple(value.shape) != out.shape or not _same_kind(value.dtype, out.dtype):
            raise TypeError(f"returned {value.dtype}{list(value.shape)}, expected {out.dtype}{list(out.shape)}")
        return TensorSpec(out.shape, value.dtype)  # the dtype the device really holds

    def _complete(self, seq: int, error: str | None) -> None:
        """Completion callback; runs on a device thread or inline. Takes only the state lock."""
        now = time.perf_counter()
        if error is not None and not isinstance(self._memory.get(seq), FailedValue):
            message = f"program #{seq} failed on the device: {error}"
            self._memory[seq] = FailedValue(message, message)
        with self._state_cv:
            launched = self._launched_at.pop(seq, now)
            # The device was idle from its last completion until this program arrived; busy after that.
            idle = max(0.0, launched - self._last_done)
            device_time = now - max(launched, self._last_done)
            self._last_done = now
            self._flight.progress_locked()
            finished = self._unfinished.pop(seq, None)
            if finished is not None:
                finished.set()  # before the slot is freed: whoever takes the slot sees this program done
            self._flight.free_slot_locked()
        self._stats.program_done(device_time, error is not None, len(self._memory), idle)

    def _forced_when_hung(self) -> str:
        """What the watchdog does to a hung device (under the state lock): a device this process drives
        cannot be killed; its waiters are released and what it still runs is left to it."""
        return "abandoned the device (its waiters were released; a program still running is left to it)"

    def _on_hung(self) -> None:
        """Watchdog thread, the device declared hung: every waiter gets DeviceHungError."""
        self._release_waiters()

    def _release_waiters(self) -> None:
        """The runtime is down: waiters on unfinished programs wake up and find it down."""
        with self._state_cv:
            for finished in self._unfinished.values():
                finished.set()
            self._unfinished.clear()
        self._flight.mark_down()

    def _warm_up(self, calls: Sequence[WarmupCall]) -> tuple[WarmupRecord, ...]:
        """Run every warm-up call once, in order, logging what each cost; a failure fails start-up."""
        records = []
        started = time.perf_counter()
        for call in tqdm(calls, desc=f"compiling for {self._ops.device}", unit="program", disable=None):
            before, t0 = self._ops.compilations(), time.perf_counter()
            futures: list[DeviceFuture] = []
            self._enqueue_warmup(call, futures)
            try:
                for future in futures:
                    future.to_host()
            except DeviceProgramError as exc:
                self.close()
                raise DeviceStartupError(f"warm-up call {call.label!r} failed: {exc}") from exc
            finally:
                for future in futures:
                    future.release()
            record = WarmupRecord(call.label, time.perf_counter() - t0, self._ops.compilations() - before)
            logger.info("warm-up %s: %.2f s, %d compiled", record.label, record.seconds, record.compilations)
            records.append(record)
        if calls:
            total = sum(r.compilations for r in records)
            logger.info("warm-up: %d calls, %d compiled, %.1f s", len(calls), total, time.perf_counter() - started)
        return tuple(records)

    def _enqueue_warmup(self, call: WarmupCall, futures: list[DeviceFuture]) -> DeviceFuture:
        """Enqueue ``call`` after the calls its inputs name (their futures fed as is); collects every future."""
        inputs = {
            name: self._enqueue_warmup(value, futures) if isinstance(value, WarmupCall) else value
            for name, value in call.inputs.items()
        }
        futures.append(self.enqueue(call.program, inputs, call.out))
        return futures[-1]
