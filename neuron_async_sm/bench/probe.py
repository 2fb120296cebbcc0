"""Per-step timing of one engine: host time C on the critical path, waits, and device time D.

The engine is measured as it is, not rebuilt for the benchmark: `StepProbe` is the engine's step
observer (`Tracer.observe`, neuron_async_sm/trace.py) and times the spans the engine names.

- Waits: time the engine's main thread spends blocked: "fetch" (a host copy: the sync step's tokens,
  or the remap's gather), "materialize" (an async break materializing the pending output: in fetch,
  or on the output's lock while the output thread fetches) and "result" (in async mode, the output
  thread's Future). Waits of other threads are off the critical path and ignored.
- Phases: "schedule" (`scheduler.schedule`), "execute" (the runner's prepare + enqueue) and "output"
  (the runner's `sample_tokens` and `scheduler.update_from_output`), each minus the waits inside it.
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
from contextlib import nullcontext
from dataclasses import dataclass, field

from neuron_async_sm.engine.core import EngineCore
from neuron_async_sm.trace import StepObserver

PHASES = StepObserver.PHASES
_IGNORED = nullcontext()


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


class _Span:
    """Times one named span of the main thread; spans nest (a fetch inside a materialize counts once)."""

    __slots__ = ("_probe", "_name", "is_wait", "_spin_s")

    def __init__(self, probe: StepProbe, name: str, spin_s: float = 0.0) -> None:
        self._probe, self._name, self.is_wait, self._spin_s = probe, name, name in StepObserver.WAITS, spin_s

    def __enter__(self) -> None:
        probe = self._probe
        probe._open.append((time.perf_counter(), probe._wait))
        if self._spin_s:  # emulated host work (the D/C sweep): pure Python, holding the GIL
            deadline = time.perf_counter() + self._spin_s
            while time.perf_counter() < deadline:
                pass

    def __exit__(self, *exc: object) -> None:
        probe = self._probe
        start, wait = probe._open.pop()
        elapsed = time.perf_counter() - start
        if self.is_wait:
            probe._wait = wait + elapsed  # waits nested inside count once
        else:
            probe._phase[self._name] += elapsed - (probe._wait - wait)


class StepProbe(StepObserver):
    """Timers on one engine. `turn()` runs one loop turn and records it; `device_times()` collects D.

    `host_extra_ms`: every `scheduler.schedule` also spins this long (the D/C sweep only, below the
    ratio the real program allows: its own time is a floor on D, so D/C < floor/C needs a larger C).
    It spins rather than sleeps, holding the GIL like the host's real work, so the async output
    thread competes with it as it would with real host work.
    """

    def __init__(self, host_extra_ms: float = 0.0) -> None:
        self.engine: EngineCore | None = None
        self.log = TurnLog()
        self._thread_id = threading.get_ident()  # the engine's main thread
        self._wait = 0.0
        self._open: list[tuple[float, float]] = []  # (start, waits so far) of each open span
        self._phase = dict.fromkeys(PHASES, 0.0)
        self._spans = {name: _Span(self, name) for name in (*PHASES, *StepObserver.WAITS)}
        self._spans["schedule"] = _Span(self, "schedule", host_extra_ms / 1e3)
        self._device_times: list[float] = []
        self._idle_times: list[float] = []  # per program: how long the device waited for it
        self._programs_seen = 0
        self._gc_started = 0.0

    def attach(self, engine: EngineCore) -> None:
        """Observe `engine` (built on this thread, before its first step)."""
        self.engine = engine
        engine.tracer.observe(self)
        gc.callbacks.append(self._on_gc)  # any thread's collection stops every thread holding the GIL

    def span(self, name: str) -> _Span | nullcontext:
        span = self._spans[name]
        if span.is_wait and threading.get_ident() != self._thread_id:
            return _IGNORED  # the async output thread: off the critical path (phases run on the main thread only)
        return span

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.log.gc_s[info["generation"]] += time.perf_counter() - self._gc_started
            self.log.gc_count[info["generation"]] += 1

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def turn(self, step: Callable[[], list]) -> list:
        """Run one loop turn (`LLM.step`) and record it."""
        assert self.engine is not None, "attach() the probe to an engine first"
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
        assert self.engine is not None
        stats = self.engine.runtime.stats()
        new = stats.programs_completed + stats.programs_failed - self._programs_seen
        recent, idle = stats.recent_device_times_s, stats.recent_device_idle_s
        if new > len(recent):
            raise RuntimeError(f"device times lost: {new} programs since the last read, {len(recent)} kept")
        if new:
            self._device_times.extend(recent[len(recent) - new :])
            self._idle_times.extend(idle[len(idle) - new :])
        self._programs_seen += new
