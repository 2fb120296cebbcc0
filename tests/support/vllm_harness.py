"""Running vLLM cases for tests/under_vllm: each in its own process group, under a hard timeout.

vLLM's start-up RPCs have no timeout (a worker that dies early leaves the engine waiting forever), so
every case is a subprocess (tests/under_vllm/run_case.py) killed with its whole process group when late.
The environment is the plugin lane's: our plugin named in VLLM_PLUGINS (never VLLM_TARGET_DEVICE=cpu,
which disables every out-of-tree plugin), the Hugging Face hub offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_CASE = REPO / "tests" / "under_vllm" / "run_case.py"
OUR_PLATFORM = "neuron_async_sm.vllm_plugin.platform.NeuronAsyncSMPlatform"


def _have_vllm() -> bool:
    """vLLM is installed (a real package: a stray `vllm` folder on the path would be a namespace one)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


HAVE_VLLM = _have_vllm()
# The lane sets it: there a missing vLLM is a broken environment, not a reason to skip.
if os.environ.get("NEURON_ASYNC_SM_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise RuntimeError("NEURON_ASYNC_SM_REQUIRE_VLLM=1 but vllm is not importable in this environment")

needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here; run .ci/vllm-lane (its own environment)"),
]


def vllm_env(pythonpath_first: Path | None = None, **overrides: str | None) -> dict[str, str]:
    """The lane's environment; a None override removes the variable. `pythonpath_first`: a folder put
    before this checkout (a mutant package, support/mutants.py)."""
    env = dict(os.environ)
    env.pop("VLLM_TARGET_DEVICE", None)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_PLUGINS="neuron_async_sm",
        TOKENIZERS_PARALLELISM="false",
        # this checkout first: the entry point resolves our package through sys.path
        PYTHONPATH=os.pathsep.join(
            [
                *([str(pythonpath_first)] if pythonpath_first else []),
                str(REPO),
                str(REPO / "tests"),
                env.get("PYTHONPATH", ""),
            ]
        ),
    )
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@dataclass(frozen=True)
class CaseResult:
    data: dict
    seconds: float
    log: str


def run_case(
    tmp_path: Path,
    case: str,
    args: dict,
    *,
    timeout_s: float = 300,
    pythonpath_first: Path | None = None,
    may_fail: bool = False,
    **env: str | None,
) -> CaseResult:
    """Run one case; its log is printed on failure and kept next to its output. `may_fail`: a case that
    exits non-zero (not a timeout) returns what it wrote, if anything, instead of failing the test."""
    out = tmp_path / f"{case}-{time.monotonic_ns()}.json"
    log_path = out.with_suffix(".log")
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(RUN_CASE), case, json.dumps(args), str(out)],
            cwd=tmp_path,
            env=vllm_env(pythonpath_first, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the engine core and workers die with it
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers (a worker that outlived the engine)
            except ProcessLookupError:
                pass
    seconds = time.monotonic() - started
    text = log_path.read_text(errors="replace")
    if rc != 0 and not (may_fail and rc is not None):
        tail = "\n".join(text.splitlines()[-60:])
        what = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited {rc}"
        pytest.fail(f"vLLM case {case!r} {what}:\n{tail}")
    print(f"vLLM case {case}: {seconds:.1f} s")
    return CaseResult(json.loads(out.read_text()) if out.exists() else {}, seconds, text)
