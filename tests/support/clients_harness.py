"""The clients people point at an OpenAI-compatible server (lm-eval, guidellm), run as their own CLIs
against a real `neuron-async-sm serve`, for tests/clients (the clients lane, .ci/clients-lane).

Each tool runs as a subprocess in its own process group under a hard timeout (killed with its whole
group when late), with the Hugging Face hub and datasets offline: everything they load is local.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = {"lm_eval": "lm-eval", "guidellm": "guidellm"}  # module -> the package that brings it
HAVE = {module: importlib.util.find_spec(module) is not None for module in TOOLS}
# The lane sets it: there a missing tool is a broken environment, not a reason to skip.
if os.environ.get("NEURON_ASYNC_SM_REQUIRE_CLIENTS") == "1" and not all(HAVE.values()):
    missing = [TOOLS[m] for m, ok in HAVE.items() if not ok]
    raise RuntimeError(f"NEURON_ASYNC_SM_REQUIRE_CLIENTS=1 but {missing} are not importable in this environment")

TOOL_TIMEOUT_S = 300.0
REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
TASKS = REPO / "tests" / "clients" / "tasks"  # our own lm-eval tasks: a yaml each, their data beside it


def needs(module: str) -> list[pytest.MarkDecorator]:
    """A test module's marks: the `clients` lane, skipped with the reason where `module` is absent."""
    reason = f"{TOOLS[module]} is not installed here; run .ci/clients-lane (its own environment)"
    return [pytest.mark.clients, pytest.mark.skipif(not HAVE[module], reason=reason)]


def run_tool(argv: list[str], workdir: Path, cwd: Path, timeout_s: float = TOOL_TIMEOUT_S) -> None:
    """Run a client's CLI (this interpreter's venv) in `cwd`, its output in `workdir`/<tool>.log; fails the
    test on a non-zero exit or past `timeout_s`."""
    log = workdir / f"{argv[0]}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["HF_HOME"] = str(workdir / "hf-home")  # the datasets cache of this run only: nothing stale is reused
    executable = Path(sys.executable).parent / argv[0]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(executable), *argv[1:]], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{argv[0]} did not finish within {timeout_s} s:\n{log.read_text()[-4000:]}") from None
    assert code == 0, f"{argv[0]} exited {code}:\n{log.read_text()[-4000:]}"


def lm_eval_samples(url: str, model: str, task: str, workdir: Path, *model_args: str) -> list[dict]:
    """`lm_eval --model local-completions` with its defaults (tokenized requests, batch 1, the server's
    /tokenize as its tokenizer) on one task of tests/clients/tasks; its logged samples, in doc order.
    `model_args`: more `key=value` model arguments. Run from the repository: the tasks name their
    data files relative to it."""
    out = workdir / "lm-eval-out"
    args = ",".join([f"model={model}", f"base_url={url}/v1/completions", *model_args])
    argv = ["lm_eval", "--model", "local-completions", "--model_args", args, "--tasks", task]
    argv += ["--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    run_tool(argv, workdir, REPO)
    [samples] = out.glob(f"*/samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])


def guidellm_benchmark(
    url: str, model: str, tokenizer: str, request_format: str, workdir: Path, requests: int, **data: int
) -> dict:
    """A short `guidellm run`: `requests` requests one at a time, synthetic prompts of `data`'s sizes
    (`prompt_tokens`, `output_tokens`) made with the local `tokenizer`; its one benchmark as written in
    its JSON report."""
    report = workdir / "guidellm.json"
    synthetic = ",".join(f"{k}={v}" for k, v in data.items())
    argv = [
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model},request_format={request_format}",
        "--profile",
        "kind=synchronous",
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--data",
        f"kind=synthetic_text,{synthetic}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    run_tool(argv, workdir, workdir)
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    return benchmark
