"""The engine's step events: an NDJSON trace of machine transitions and materializations (checked
against the TLA+ spec), and the in-step hooks of one `StepObserver`.

Off by default: with no path and no subscriber every call is a no-op. Observers `subscribe()` to the
same named records (the server's metrics), or `observe()` the step from inside (the bench probe's
timers, the tests' spies) instead of wrapping the objects that emit them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from neuron_async_sm.outputs import StepSnapshot

_NO_SPAN = nullcontext()


class StepObserver:
    """Named points inside one engine's step. The base ignores them all; subclass what you need.

    Called on the thread that does the work (the engine's main thread, or the async output thread
    for a write-back it materializes), synchronously: a hook may time, record, block or raise.
    """

    PHASES = ("schedule", "execute", "output")  # the main thread's host work in one loop turn
    WAITS = ("fetch", "materialize", "result")  # a thread blocked: host copy, async break, output thread

    def span(self, name: str) -> AbstractContextManager[object]:
        """Around one phase or wait named in PHASES / WAITS."""
        return _NO_SPAN

    def write_back(self, snapshot: StepSnapshot, tokens: list[int]) -> None:
        """A step's sampled tokens are about to be written into CPU state, by the snapshot's request ids."""


NO_OBSERVER = StepObserver()


class Tracer:
    """Writes one JSON object per line. Thread-safe; callers log inside the critical section they record."""

    NONE: Tracer

    def __init__(self, path: str | None) -> None:
        self.enabled = path is not None
        self._file: IO[str] | None = open(path, "w", encoding="utf-8", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._seq = 0
        self._subscribers: list[Callable[[dict], None]] = []
        self.observer: StepObserver = NO_OBSERVER

    def observe(self, observer: StepObserver) -> None:
        """Make `observer` this engine's in-step observer (one at a time; it does not enable the trace)."""
        if self is Tracer.NONE:
            raise ValueError("Tracer.NONE is shared by every engine; observe through an engine's own tracer")
        self.observer = observer

    def subscribe(self, callback: Callable[[dict], None]) -> None:
        """Call `callback(record)` for every later event, on the emitting thread.

        Callers emit inside the critical section they record (the output's lock): keep it cheap.
        """
        if self is Tracer.NONE:
            raise ValueError("Tracer.NONE is shared by every engine; subscribe to an engine's own tracer")
        with self._lock:
            self._subscribers.append(callback)
        self.enabled = True

    def event(self, event: str, **fields: object) -> None:
        if self._file is None and not self._subscribers:
            return
        with self._lock:
            record = {"seq": self._seq, "event": event, "thread": threading.current_thread().name, **fields}
            self._seq += 1
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
            for callback in self._subscribers:
                callback(record)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


Tracer.NONE = Tracer(None)
