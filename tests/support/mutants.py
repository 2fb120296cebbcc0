"""Source-level mutants, as mutation-testing tools build them: a copy of the package with one exact
textual change, run in its own process. No hook in the engine, no method replaced at run time.

A test builds one with `mutant_package`, then starts the real CLI against it with `mutant_env` (the
copy first on PYTHONPATH; the device process, spawned from it, imports the same copy).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import neuron_async_sm

PACKAGE = Path(neuron_async_sm.__file__).resolve().parent


def mutant_package(root: Path, module: str, original: str, mutated: str) -> Path:
    """Copy the package under `root` with `original` replaced by `mutated` in `module` (a path inside the
    package, e.g. ``"worker/async_output.py"``); `original` must occur exactly once. Returns `root`."""
    copy = root / PACKAGE.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / module
    source = path.read_text(encoding="utf-8")
    assert source.count(original) == 1, f"{module}: the mutated text occurs {source.count(original)} times, not once"
    path.write_text(source.replace(original, mutated), encoding="utf-8")
    return root


def mutant_env(root: Path) -> dict[str, str]:
    """This process's environment with the mutant package at `root` first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
