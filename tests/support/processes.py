"""Real processes: the CLI's `generate` argv, the engine's device process, telling when one is gone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

PYTHON_M = (sys.executable, "-m", "neuron_async_sm")
"""How tests start the CLI as a process: this interpreter, the package's `__main__`."""


def generate_argv(
    prompts: Path | str, output: Path | str, *flags: object, top: tuple[str, ...] = (), process: bool = True
) -> list[str]:
    """argv of ``neuron-async-sm [TOP] generate --prompts PROMPTS --output OUTPUT FLAGS...``, every item a str.

    ``process=True``: for a subprocess (``python -m neuron_async_sm ...``); False: for ``cli.main(argv)``.
    """
    argv = [*top, "generate", "--prompts", prompts, "--output", output, *flags]
    return [*(PYTHON_M if process else ()), *map(str, argv)]


def config_flags(**settings: object) -> list[str]:
    """`EngineConfig` keyword settings as `generate` flags: ``max_num_seqs=8`` -> ``--max-num-seqs 8``,
    a bool -> ``--name`` / ``--no-name``, a tuple -> comma-separated."""
    flags: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (tuple, list)):
            flags += [flag, ",".join(map(str, value))]
        else:
            flags += [flag, str(value)]
    return flags


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
