"""Real processes for fault tests: find the engine's device process, tell when one is gone."""

from __future__ import annotations

import time
from pathlib import Path


def device_pid(parent: int, timeout: float = 10.0) -> int:
    """The device process of the engine in process `parent`: its multiprocessing spawn child."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # exited meanwhile
            if b"spawn_main" in cmdline:
                return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"process {parent} has no device process")


def process_gone(pid: int) -> bool:
    """Exited and reaped: no /proc entry (a zombie would still have one)."""
    return not Path(f"/proc/{pid}").exists()
