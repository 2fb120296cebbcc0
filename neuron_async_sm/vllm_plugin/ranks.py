"""Which tensor-parallel rank failed, seen from one of vLLM's worker processes.

Under vLLM's mp executor each rank is its own worker process with its own device process, and vLLM
reads only the output rank's replies: a failure on another rank is only logged there, while the
output rank sees its symptom (a collective whose peer went away). The ranks run on one host and
swap their device process ids once they have started, so a rank that fails can look whose device
process is gone and name that rank, as our own executor does (engine/executor.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from neuron_async_sm.engine.executor import BLAME_WAIT_S, RankFailedError


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # the state follows the command's ")"


@dataclass(frozen=True)
class PeerDevices:
    """Every rank's device process id (None: unknown), indexed by rank; `rank` is this one."""

    rank: int
    pids: tuple[int | None, ...] = ()

    def blame(self, exc: BaseException) -> BaseException:
        """`exc`, raised on this rank, as the error of the rank that failed (unchanged with one rank).

        A rank whose device process is gone is the cause; this rank's failed collective its symptom.
        """
        if len(self.pids) < 2 or isinstance(exc, RankFailedError):
            return exc
        deadline = time.monotonic() + BLAME_WAIT_S  # the peer's death and our symptom race
        while True:
            gone = [rank for rank, pid in enumerate(self.pids) if pid is not None and process_gone(pid)]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if gone:
            failed = gone[0]
            message = f"tensor-parallel rank {failed} failed: its device process {self.pids[failed]} is gone"
        else:
            failed, message = self.rank, f"tensor-parallel rank {self.rank} failed: {type(exc).__name__}: {exc}"
        error = RankFailedError(message, failed)
        error.__cause__ = exc
        return error
