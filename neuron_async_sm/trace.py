"""NDJSON trace of machine transitions and materializations, for checking runs against the TLA+ spec.

Off by default: with no path and no subscriber every call is a no-op. Observers (the server's
metrics) `subscribe()` to the same named events instead of wrapping the objects that emit them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import IO


class Tracer:
    """Writes one JSON object per line. Thread-safe; callers log inside the critical section they record."""

    NONE: Tracer

    def __init__(self, path: str | None) -> None:
        self.enabled = path is not None
        self._file: IO[str] | None = open(path, "w", encoding="utf-8", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._seq = 0
        self._subscribers: list[Callable[[dict], None]] = []

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
