"""Per-step timing of one engine: host time C on the critical path, waits, and device time D.

The engine is measured as it is, not rebuilt for the benchmark: `StepProbe` wraps a few bound methods
of one engine instance (never the classes) with timers.

- Waits: time the engine's main thread spends blocked on the device — `runtime.fetch` (a host copy:
  the sync step's tokens), an async break materializing the pending output (the runner's
  `_materialize_pending`: in fetch, or on the output's lock while the output thread fetches) and, in
  async mode, the output thread's `Future.result()`.
- Phases: `scheduler.schedule`, the executor's prepare + enqueue (`execute_model`, plus
  `execute_model_async` in async mode), and output processing (`sample_tokens` and
  `scheduler.update_from_output`), each minus the waits inside it.
- C of a loop turn is its wall time minus its waits: everything the host does on the critical path.
- Device idle: the device process also reports, per program, how long it sat waiting for work
  before that program arrived. In a fully overlapped async run it stays near zero after the first
  program: the host always had the next step queued.
- D is measured inside the device process: the runtime reports each program's execution time
  (`RuntimeStats.recent_device_times_s`), collected here in program order. Every forward step
  enqueues exactly one program, so program i is step i.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from neuron_async_sm.engine.core import EngineCore

PHASES = ("schedule", "execute", "output")


@dataclass
class TurnLog:
    """One row per loop turn that did work, in turn order."""

    wall_s: list[float] = field(default_factory=list)  # the turn's wall time
    wait_s: list[float] = field(default_factory=list)  # main thread blocked on the device
    steps: list[int] = field(default_factory=list)  # forward steps enqueued by the turn (0 or 1)
    cpu_s: list[float] = field(default_factory=list)  # CPU time of the main thread (immune to preemption)
    gc_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # time in garbage collection, per generation
    gc_count: list[int] = field(default_factory=lambda: [0, 0, 0])  # collections per generation
    phase_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})

    @property
    def host_s(self) -> list[float]:
        """C per turn: wall time minus waits."""
        return [w - b for w, b in zip(self.wall_s, self.wait_s, strict=True)]


class StepProbe:
    """Timers on one engine. `turn()` runs one loop turn and records it; `device_times()` collects D."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.log = TurnLog()
        self._thread = threading.current_thread()  # the engine's main thread
        self._wait = 0.0
        self._phase = dict.fromkeys(PHASES, 0.0)
        self._device_times: list[float] = []
        self._idle_times: list[float] = []  # per program: how long the device waited for it
        self._programs_seen = 0
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)  # any thread's collection stops every thread holding the GIL
        runtime = engine.runtime
        runtime.fetch = self._timed_wait(runtime.fetch)  # type: ignore[method-assign]
        for runner in engine.executor.runners:
            # An async break waits for the pending output: in fetch, or on the output's lock while
            # the output thread fetches it. The whole call counts as a wait (its write-back of one
            # token per row is microseconds), so a break does not show up as host time.
            runner._materialize_pending = self._timed_wait(runner._materialize_pending)  # type: ignore
        scheduler, executor = engine.scheduler, engine.executor
        scheduler.schedule = self._timed_phase("schedule", scheduler.schedule)  # type: ignore[method-assign]
        scheduler.update_from_output = self._timed_phase("output", scheduler.update_from_output)  # type: ignore
        executor.execute_model = self._timed_phase("execute", executor.execute_model)  # type: ignore
        executor.sample_tokens = self._timed_phase("output", executor.sample_tokens)  # type: ignore
        if engine.batch_queue is not None:
            execute_async = executor.execute_model_async

            def timed_execute_async(scheduled: Any) -> _TimedFuture:
                return _TimedFuture(execute_async(scheduled), self)

            # execute_model_async calls execute_model + sample_tokens (already timed): no phase here.
            executor.execute_model_async = timed_execute_async  # type: ignore[method-assign]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.log.gc_s[info["generation"]] += time.perf_counter() - self._gc_started
            self.log.gc_count[info["generation"]] += 1

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _timed_wait(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not self._thread:
                return fn(*args, **kwargs)  # the async output thread: off the critical path
            start, wait = time.perf_counter(), self._wait
            try:
                return fn(*args, **kwargs)
            finally:
                self._wait = wait + time.perf_counter() - start  # waits nested inside count once

        return timed

    def _timed_phase(self, phase: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, wait = time.perf_counter(), self._wait
            try:
                return fn(*args, **kwargs)
            finally:
                self._phase[phase] += time.perf_counter() - start - (self._wait - wait)

        return timed

    def turn(self, step: Callable[[], list]) -> list:
        """Run one loop turn (`LLM.step`) and record it."""
        steps, wait = self.engine.num_steps, self._wait
        phase = dict(self._phase)
        cpu = time.thread_time()
        start = time.perf_counter()
        deltas = step()
        wall = time.perf_counter() - start
        log = self.log
        log.cpu_s.append(time.thread_time() - cpu)
        log.wall_s.append(wall)
        log.wait_s.append(self._wait - wait)
        log.steps.append(self.engine.num_steps - steps)
        for p in PHASES:
            log.phase_s[p].append(self._phase[p] - phase[p])
        if len(log.wall_s) % 256 == 0:
            self._collect_device_times()
        return deltas

    def reset(self) -> None:
        """Start a new run: forget the turns, and the device times of earlier programs."""
        self.log = TurnLog()
        self._collect_device_times()
        self._device_times = []
        self._idle_times = []

    def device_times(self) -> list[float]:
        """D of every program since `reset()`, in program (== step) order; call when nothing is in flight."""
        self._collect_device_times()
        return list(self._device_times)

    def device_idle_times(self) -> list[float]:
        """Per program since `reset()`: how long the device sat idle before it (nothing queued)."""
        self._collect_device_times()
        return list(self._idle_times)

    def _collect_device_times(self) -> None:
        stats = self.engine.runtime.stats()
        new = stats.programs_completed + stats.programs_failed - self._programs_seen
        recent, idle = stats.recent_device_times_s, stats.recent_device_idle_s
        if new > len(recent):
            raise RuntimeError(f"device times lost: {new} programs since the last read, {len(recent)} kept")
        if new:
            self._device_times.extend(recent[len(recent) - new :])
            self._idle_times.extend(idle[len(idle) - new :])
        self._programs_seen += new


class _TimedFuture:
    """The output thread's Future, with `result()` counted as a wait of the engine's main thread."""

    def __init__(self, future: Future, probe: StepProbe) -> None:
        self._future = future
        self._probe = probe

    def result(self, timeout: float | None = None) -> Any:
        start = time.perf_counter()
        try:
            return self._future.result(timeout)
        finally:
            self._probe._wait += time.perf_counter() - start

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)
