"""Run a benchmark script's `--one` mode in a fresh process importing one source tree (the A/B scripts here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_in_tree(script: str, tree: Path, args: list[str], *, timeout_s: float, nice: bool = False) -> dict:
    """`python SCRIPT --one ARGS` with `tree` first on PYTHONPATH; returns its `RESULT {json}` line.

    Fails when the child imported `neuron_async_sm` from anywhere but `tree` (its report's "tree")."""
    cmd = [sys.executable, str(Path(script).resolve()), "--one", *args]
    if nice and os.geteuid() == 0:
        cmd = ["nice", "-n", "-10", *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{tree}: no result\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    report = json.loads(lines[0][len("RESULT ") :])
    assert report["tree"].startswith(str(tree)), f"imported {report['tree']}, not from {tree}"
    return report
