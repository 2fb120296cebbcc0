"""The lifecycle, the bounded queue of unfinished programs and the watchdog over them: one piece that
every runtime uses (``HostRuntime`` over the emulated device, ``LocalRuntime`` over XLA and streams).

Nothing waits forever: a blocked ``enqueue`` waits on ``cv`` and every way down (close, a lost
device, a declared hang) notifies all. The watchdog declares the device hung when work is in flight
and nothing completed for ``device_timeout_s``; the owner then forces its device down and releases
its own waiters (``on_hung``).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from .errors import DeviceHungError, DeviceLostError

WATCHDOG_THREAD = "neuron-device-watchdog"


class RuntimeState(enum.Enum):
    """Lifecycle of a runtime; only RUNNING accepts work."""

    RUNNING = "running"
    CLOSED = "closed"  # close() was called
    LOST = "lost"  # the device went away on its own (killed, crashed)
    HUNG = "hung"  # in-flight work saw no completion for device_timeout_s: the watchdog forced the device down


class InFlight:
    """A runtime's state lock ``cv``, its lifecycle, its queue slots and its watchdog.

    The owner guards its own bookkeeping with ``cv`` too (one lock, so a completion and a way down
    are never half seen). Methods named ``*_locked`` expect ``cv`` held; the others take it.
    ``busy`` (called under ``cv``) counts the owner's in-flight work: unfinished programs, pending reads.
    """

    def __init__(self, runtime_queue_depth: int, device_timeout_s: float, busy: Callable[[], int]) -> None:
        self.cv = threading.Condition()
        self.state = RuntimeState.RUNNING  # (cv)
        self.reason = ""  # (cv) why the runtime stopped accepting work
        self._runtime_queue_depth = runtime_queue_depth
        self._timeout_s = device_timeout_s
        self._busy = busy
        self._slots_in_use = 0  # (cv) unfinished programs, at most runtime_queue_depth
        # (cv) when the device last showed progress: a completion, or the moment work arrived while
        # nothing was in flight (an idle device's silence is not a hang).
        self._last_progress = time.monotonic()
        self._down = threading.Event()  # set once the runtime is down: the watchdog exits
        self._watchdog: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def down_reason(self) -> str | None:
        """Why the runtime stopped accepting work (closed, lost, hung); None while it runs."""
        with self.cv:
            return None if self.state is RuntimeState.RUNNING else self.reason

    def go_down_locked(self, state: RuntimeState, reason: str) -> None:
        """Stop accepting work (the first way down wins) and wake every blocked enqueue."""
        if self.state is RuntimeState.RUNNING:
            self.state, self.reason = state, reason
        self.cv.notify_all()

    def mark_down(self) -> None:
        """After the owner released its waiters: the watchdog exits."""
        self._down.set()

    def raise_if_down_locked(self) -> None:
        if self.state is not RuntimeState.RUNNING:
            raise self.down_error_locked()

    def down_error_locked(self) -> DeviceLostError:
        """The runtime is down: what every waiter and every later call gets (a new instance each)."""
        error = DeviceHungError if self.state is RuntimeState.HUNG else DeviceLostError
        return error(f"device runtime is {self.state.value}: {self.reason}")

    # ---- the bounded queue -----------------------------------------------------------------------

    def acquire_slot(self) -> None:
        with self.cv:
            # Bounded in-flight queue: block (never drop) until a program finishes. Every way down
            # notifies all (a full queue is in-flight work, so a hang is among them): cannot hang.
            while self.state is RuntimeState.RUNNING and self._slots_in_use >= self._runtime_queue_depth:
                self.cv.wait()
            self.raise_if_down_locked()
            self._slots_in_use += 1

    def return_slot(self) -> None:
        """A slot taken by an enqueue that then failed before its program reached the device."""
        with self.cv:
            self.free_slot_locked()

    def free_slot_locked(self) -> None:
        self._slots_in_use -= 1
        self.cv.notify()  # one slot freed: wake one blocked enqueue

    # ---- progress and the watchdog ---------------------------------------------------------------

    def work_arrives_locked(self) -> None:
        """About to register a program or a read."""
        if not self._busy():
            # Hazard: a false hang. An idle device completes nothing; its silence only counts from
            # the moment it has work, not from its last completion (maybe minutes ago).
            self._last_progress = time.monotonic()

    def progress_locked(self) -> None:
        """The device completed something."""
        self._last_progress = time.monotonic()

    def start_watchdog(self, forced: Callable[[], str], on_hung: Callable[[], None]) -> None:
        """Unless ``device_timeout_s`` is 0: a thread that declares the device hung (state HUNG, a reason
        ending with ``forced()``, called under ``cv``: what is done to the device), then calls ``on_hung()``
        (without ``cv``), which forces the device down and releases the owner's waiters."""
        if self._timeout_s > 0:
            watch = threading.Thread(target=self._watch, args=(forced, on_hung), name=WATCHDOG_THREAD, daemon=True)
            self._watchdog = watch
            watch.start()

    def join_watchdog(self, timeout_s: float) -> None:
        if self._watchdog is not None and self._watchdog.is_alive():
            self._watchdog.join(timeout_s)  # woken by mark_down; it may be forcing the device right now

    def _watch(self, forced: Callable[[], str], on_hung: Callable[[], None]) -> None:
        timeout = self._timeout_s
        while True:
            with self.cv:
                if self.state is not RuntimeState.RUNNING:
                    return
                in_flight = self._busy()
                silent_s = time.monotonic() - self._last_progress
                if in_flight and silent_s >= timeout:
                    # Set first: the EOF that forcing the device causes must not say LOST.
                    self.state = RuntimeState.HUNG
                    self.reason = (
                        f"no program completed for {silent_s:.1f} s with {in_flight} in flight "
                        f"(device_timeout_s={timeout:g}); {forced()}"
                    )
                    self.cv.notify_all()  # blocked enqueues wake up and raise DeviceHungError
                    break
                sleep_s = timeout - silent_s if in_flight else timeout
            # Hazard: a lost wake-up. Never sleeps on cv: its notify() wakes one waiter, and a wake-up
            # the watchdog took would leave an enqueue blocked beside a free slot.
            if self._down.wait(sleep_s):
                return
        on_hung()
