"""What every bench report shares: the machine it ran on, a progress bar, strict JSON."""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Callable

import torch

from neuron_async_sm.bench.runner import load_average


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nice": os.nice(0),  # the figures in docs/benchmarks.md ran at -10 on a shared machine
        "load_avg_start": load_average(),
    }


def progress_bar(enabled: bool, total: int, desc: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """(advance-by-one callback, close); a tqdm bar on stderr, or nothing."""
    if not enabled:
        return (lambda _line: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)

    def advance(line: str) -> None:
        bar.update(1)
        bar.set_postfix_str(line)

    return advance, bar.close


def finite(value: object) -> object:
    """NaN / inf as null: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
