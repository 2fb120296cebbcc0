"""The CLI as a script sees it: exit codes, durable output, real signals, a real device process.

Every test runs `python -m neuron_async_sm generate` as a separate process (the user's path), and
faults are real: a SIGKILLed device process, SIGINT/SIGTERM to the CLI, an output path that cannot
be created.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import device_pid, generate_argv, process_gone
from support.serve_harness import in_context

REPO = Path(__file__).resolve().parents[1]
LONG = {"max_tokens": 400, "ignore_eos": True}  # long enough that a fault lands mid-run


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def start_cli(tmp_path: Path, rows: list, *extra: str) -> tuple[subprocess.Popen, Path]:
    prompts = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out" / "results.jsonl"
    argv = generate_argv(prompts, out, "--no-progress", "--max-model-len", "512", *extra)
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until `path` holds at least n complete lines (the run is under way and some requests finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the CLI ended early: {proc.communicate()}"
        if path.exists() and path.read_text(encoding="utf-8").count("\n") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {n} lines")


def requests(n: int, **params) -> list[dict]:
    return [{"request_id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7], **params} for i in range(n)]


def test_a_bad_line_among_good_ones_exits_1_and_every_good_request_completes(tmp_path):
    last = {"request_id": "last", "prompt_token_ids": [9, 9], "max_tokens": 4}
    rows = [*requests(3, max_tokens=5), '{"prompt_token_ids": [1, 2], "max_tokens": -3}', last]
    proc, out = start_cli(tmp_path, rows, "--device", "cpu")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    results = read_jsonl(out)
    assert [r["request_id"] for r in results] == ["r0", "r1", "r2", "line-4", "last"]
    assert [r["finish_reason"] for r in results] == ["length", "length", "length", "error", "length"]
    assert "max_tokens" in results[3]["error"]
    assert "5 requests: 4 succeeded, 1 failed" in stdout
    assert "1 failed with invalid request; first: max_tokens" in stderr
    assert not out.with_name(out.name + ".partial").exists(), "a finished run leaves no partial file"


def test_all_good_lines_exit_0(tmp_path):
    proc, out = start_cli(tmp_path, requests(2, max_tokens=3), "--device", "cpu-inprocess")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "2 requests: 2 succeeded, 0 failed" in stdout and "tokens/s" in stdout


@pytest.mark.parametrize("async_scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_a_killed_device_exits_1_with_every_in_flight_request_errored(tmp_path, async_scheduling):
    rows = [*requests(2, max_tokens=4), *({**r, **LONG} for r in requests(6)[2:])]
    proc, out = start_cli(tmp_path, rows, "--device", "cpu", async_scheduling)
    wait_for_lines(out.with_name(out.name + ".partial"), 2, proc)  # the two short ones finished
    os.kill(device_pid(proc.pid), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    results = {r["request_id"]: r for r in read_jsonl(out)}
    assert [results[f"r{i}"]["finish_reason"] for i in range(2)] == ["length", "length"]
    for i in range(2, 6):
        assert results[f"r{i}"]["finish_reason"] == "error", results[f"r{i}"]
        assert "DeviceLostError" in results[f"r{i}"]["error"] and "signal 9" in results[f"r{i}"]["error"]
    assert "6 requests: 2 succeeded, 4 failed" in stdout
    assert "4 failed with DeviceLostError" in stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_keeps_the_finished_requests_and_aborts_the_rest(tmp_path, sig):
    rows = [*requests(2, max_tokens=4), *({**r, **LONG} for r in requests(5)[2:])]
    proc, out = start_cli(tmp_path, rows, "--device", "cpu")
    partial = out.with_name(out.name + ".partial")
    wait_for_lines(partial, 2, proc)
    started = time.monotonic()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - started < 10, "shutdown after a signal must be prompt"
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr and f"interrupted by {sig.name}" in stderr
    results = read_jsonl(out)
    assert [r["request_id"] for r in results] == [f"r{i}" for i in range(5)]
    assert [r["finish_reason"] for r in results[:2]] == ["length", "length"]
    assert all(len(r["output_token_ids"]) == 4 for r in results[:2])
    assert [r["finish_reason"] for r in results[2:]] == ["abort"] * 3
    assert "5 requests: 2 succeeded, 0 failed, 3 aborted" in stdout
    assert not partial.exists()


def test_an_unwritable_output_path_fails_before_the_device_starts(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output's directory should be")
    prompts = write_jsonl(tmp_path / "in.jsonl", requests(1, max_tokens=3))
    trace = tmp_path / "trace.ndjson"
    proc = subprocess.run(
        generate_argv(prompts, blocker / "out.jsonl", "--trace", trace, "--no-progress"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write {blocker}" in proc.stderr and "Traceback" not in proc.stderr
    assert not trace.exists(), "the engine (which opens the trace) must not have started"


def test_text_field_when_the_model_has_a_tokenizer(tmp_path):
    from test_model_loader import write_checkpoint
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    model = write_checkpoint(tmp_path / "model")
    vocab = {f"w{i}": i for i in range(64)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))
    rows = [{"request_id": "t", "prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True}]
    proc, out = start_cli(tmp_path, rows, "--device", "cpu-inprocess", "--model", str(model), "--max-model-len", "64")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    [result] = read_jsonl(out)
    assert len(result["output_token_ids"]) == 4
    # decoded after the prompt, as vLLM's LLM writes it: " w..." (alone it would read "w...")
    assert result["text"] == in_context(tokenizer, tokenizer.encode("w5 w6 w7").ids, result["output_token_ids"])
    assert result["text"].startswith(" w")


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from neuron_async_sm import LLM\nLLM('tiny-llama').close()\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr and "picklable" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("async_scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_a_stopped_device_ends_the_run_with_device_hung_error_and_leaves_no_process(tmp_path, async_scheduling):
    rows = [*requests(2, max_tokens=4), *({**r, **LONG} for r in requests(5)[2:])]
    proc, out = start_cli(tmp_path, rows, "--device", "cpu", "--device-timeout-s", "3", async_scheduling)
    wait_for_lines(out.with_name(out.name + ".partial"), 2, proc)
    device = device_pid(proc.pid)
    os.kill(device, signal.SIGSTOP)
    stopped = time.monotonic()
    stdout, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - stopped < 3 + 5, "DeviceHungError must come within --device-timeout-s + 5 s"
    assert proc.returncode == 1, stderr
    results = {r["request_id"]: r for r in read_jsonl(out)}
    assert [results[f"r{i}"]["finish_reason"] for i in range(2)] == ["length", "length"]
    assert all("DeviceHungError" in (results[f"r{i}"]["error"] or "") for i in range(2, 5)), results
    assert process_gone(device), "the hung device process was left behind"


def test_ctrl_c_during_a_device_hang_exits_within_seconds(tmp_path):
    rows = [*requests(1, max_tokens=4), *({**r, **LONG} for r in requests(3)[1:])]
    proc, out = start_cli(tmp_path, rows, "--device", "cpu", "--device-timeout-s", "0")  # no watchdog
    wait_for_lines(out.with_name(out.name + ".partial"), 1, proc)
    device = device_pid(proc.pid)
    os.kill(device, signal.SIGSTOP)
    time.sleep(1.0)  # the engine now waits on a device that will never answer
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - interrupted < 5.0, (
        stderr
    )  # bounded teardown (it was 60 s and more); slack for a loaded CI
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert [r["finish_reason"] for r in read_jsonl(out)] == ["length", "abort", "abort"]
    assert process_gone(device)


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 16 KiB tmpfs (root only): a disk that fills up mid-run."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_names_the_file_and_exits_1(tiny_filesystem):
    out = tiny_filesystem / "demo.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_async_sm",
            "demo",
            "--num-requests",
            "32",
            "--output",
            str(out),
            "--device",
            "cpu-inprocess",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"cannot write {tiny_filesystem}" in proc.stderr and "No space left" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    partial = out.with_name(out.name + ".partial")
    assert not out.exists() or out.read_text().endswith("\n"), "never a half-written final file"
    assert partial.exists(), "what finished before the disk filled up is kept"


def test_diagram_without_dot_writes_the_source_and_says_how_to_render_it(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no `dot` on this PATH
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_async_sm", "diagram", "--output", str(tmp_path / "sm")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sm.dot").exists() and not (tmp_path / "sm.svg").exists()
    assert "apt-get install graphviz" in proc.stderr and "dot -Tsvg" in proc.stderr
