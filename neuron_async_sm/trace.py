"""NDJSON trace of machine transitions and materializations, for checking runs against the TLA+ spec.

Off by default: with no path, `Tracer.NONE` is used and every call is a no-op.
"""

from __future__ import annotations

import json
import threading
from typing import IO


class Tracer:
    """Writes one JSON object per line. Thread-safe; callers log inside the critical section they record."""

    NONE: Tracer

    def __init__(self, path: str | None) -> None:
        self.enabled = path is not None
        self._file: IO[str] | None = open(path, "w", encoding="utf-8", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._seq = 0

    def event(self, event: str, **fields: object) -> None:
        if self._file is None:
            return
        with self._lock:
            record = {"seq": self._seq, "event": event, "thread": threading.current_thread().name, **fields}
            self._seq += 1
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


Tracer.NONE = Tracer(None)
