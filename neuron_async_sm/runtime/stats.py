"""Thread-safe accumulation of ``RuntimeStats``."""

from __future__ import annotations

import sys
import threading
from collections import deque

from .api import RuntimeStats


def graph_compilations() -> int:
    """Graphs torch.compile built in this process so far (recompilations included); 0 if it never ran.

    Reads torch._dynamo's counters only where something imported it: an eager process pays nothing.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


RECENT_TIMES_KEPT = 1024
"""Per-program device times (and idle times) kept for the medians."""


class StatsRecorder:
    """Counters fed by the receiver thread (program completions) and by callers
    of ``enqueue`` / ``to_host`` (transfers); ``snapshot`` freezes them."""

    def __init__(self, recent_times_kept: int = RECENT_TIMES_KEPT) -> None:
        self._lock = threading.Lock()
        self._recent_times_kept = recent_times_kept
        self._live = 0  # a gauge, not a counter: reset() keeps it
        self._compiled = 0  # the device's running total of compilations since its programs were built
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._completed = 0
            self._failed = 0
            self._device_time_s = 0.0
            self._recent: deque[float] = deque(maxlen=self._recent_times_kept)
            self._idle_s = 0.0
            self._recent_idle: deque[float] = deque(maxlen=self._recent_times_kept)
            self._transfers = 0
            self._transfer_bytes = 0
            self._uploads = 0
            self._upload_bytes = 0
            self._compiled_base = self._compiled

    def program_done(
        self, device_time_s: float, failed: bool, live_futures: int, idle_s: float = 0.0, compilations: int = 0
    ) -> None:
        with self._lock:
            self._compiled = max(self._compiled, compilations)  # a running total; messages arrive in order
            self._idle_s += idle_s
            self._recent_idle.append(idle_s)
            self._live = live_futures
            if failed:
                self._failed += 1
            else:
                self._completed += 1
            self._device_time_s += device_time_s
            self._recent.append(device_time_s)

    def host_transfer(self, nbytes: int) -> None:
        with self._lock:
            self._transfers += 1
            self._transfer_bytes += nbytes

    def host_upload(self, nbytes: int, count: int = 1) -> None:
        """`count` host tensors of `nbytes` in all were sent as program inputs (one call per program)."""
        with self._lock:
            self._uploads += count
            self._upload_bytes += nbytes

    def snapshot(self) -> RuntimeStats:
        with self._lock:
            return RuntimeStats(
                programs_completed=self._completed,
                programs_failed=self._failed,
                device_time_s=self._device_time_s,
                recent_device_times_s=list(self._recent),
                host_transfers=self._transfers,
                host_transfer_bytes=self._transfer_bytes,
                host_uploads=self._uploads,
                host_upload_bytes=self._upload_bytes,
                device_futures_live=self._live,
                device_idle_s=self._idle_s,
                recent_device_idle_s=list(self._recent_idle),
                compilations=self._compiled - self._compiled_base,
            )
