"""`neuron-async-sm bench serve`: a real sync and async server, a few prompts at two rates; the report's
structure and the figures' own arithmetic (TTFT <= end-to-end, counts add up, TPOT as defined).

Timings on a shared machine vary run to run: nothing here compares a time against a threshold.
"""

from __future__ import annotations

import importlib.util
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import process_gone

from neuron_async_sm.bench.serve_command import engine_argv, external_servers
from neuron_async_sm.bench.serving import RequestRecord, arrival_offsets, mode_order, summarize
from neuron_async_sm.cli import build_parser, main

PROMPTS, INPUT_LEN, OUTPUT_LEN = 3, 8, 6
RATES = ["8", "inf"]


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the report: not strict JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_serve")
    argv = [
        "bench",
        "serve",
        "--num-prompts",
        str(PROMPTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--request-rates",
        ",".join(RATES),
        "--repetitions",
        "1",
        "--warmup-prompts",
        "1",
        "--max-num-seqs",
        "2",
        "--decode-buckets",
        "1,2",
        "--request-timeout-s",
        "30",
        "--no-progress",
        "--server-log-dir",
        str(out),
        "--json",
        str(out / "serve.json"),
    ]
    plots = importlib.util.find_spec("matplotlib") is not None  # a dev extra
    assert main(argv + (["--plots", str(out)] if plots else [])) == 0
    assert not plots or (out / "bench_serve.png").stat().st_size > 1000
    return _strict_json((out / "serve.json").read_text())


def test_each_cell_runs_on_both_servers_in_alternating_order(report: dict) -> None:
    assert report["config"]["modes"] == ["sync", "async"] and report["config"]["request_rates"] == RATES
    assert [s["exit_code"] for s in report["servers"]] == [0, 0]  # both drained on SIGTERM
    assert [(r["rate_label"], r["mode"]) for r in report["runs"]] == [
        ("8", "sync"),
        ("8", "async"),
        ("inf", "async"),
        ("inf", "sync"),
    ]
    sync_argv, async_argv = (s["argv"] for s in report["servers"])
    assert "--no-async-scheduling" in sync_argv and "--async-scheduling" in async_argv


def test_counts_add_up(report: dict) -> None:
    for run in report["runs"]:
        assert run["completed"] + run["failed"] == PROMPTS and run["failed"] == 0, run["errors"]
        assert run["output_tokens"] == run["completed"] * OUTPUT_LEN  # ignore_eos: every request decodes all
        assert run["input_tokens"] == run["completed"] * INPUT_LEN
        # one gap per pair of consecutive token chunks; a chunk may carry more than one token, never none
        assert 0 < run["itl_count"] <= run["completed"] * (OUTPUT_LEN - 1)
        assert run["request_throughput"] == pytest.approx(run["completed"] / run["duration_s"])
        assert run["output_throughput"] == pytest.approx(run["output_tokens"] / run["duration_s"])
        steps = run["server"]["steps"]  # the server's own count of this run's forward steps
        if run["mode"] == "sync":
            assert set(steps) == {"Sync"} and run["server"]["async_step_fraction"] is None  # NaN -> null
        else:
            assert "Sync" not in steps and 0.0 <= run["server"]["async_step_fraction"] <= 1.0
        # this run's steps only: each samples 1 to max_num_seqs = 2 tokens (prompts fit one prefill chunk)
        assert run["output_tokens"] / 2 <= sum(steps.values()) <= run["output_tokens"], steps
    for mode, rows in report["results"].items():
        assert [r["rate_label"] for r in rows] == RATES
        for row in rows:
            mine = [r for r in report["runs"] if r["mode"] == mode and r["rate_label"] == row["rate_label"]]
            assert row["repetitions"] == len(mine) == 1
            assert row["completed"] == sum(r["completed"] for r in mine)
            assert row["ttft_ms_p50"] == mine[0]["ttft_ms_p50"]  # the median of one run is that run


def test_latencies_are_ordered_as_their_definitions_require(report: dict) -> None:
    for run in report["runs"]:
        where = (run["mode"], run["rate_label"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            p50, p99, top, mean = (run[f"{name}_ms_{q}"] for q in ("p50", "p99", "max", "mean"))
            assert 0 < p50 <= p99 <= top and 0 < mean <= top, (where, name)
        # TTFT <= E2EL for every request, hence for every order statistic and the mean
        for q in ("p50", "p99", "max", "mean"):
            assert run[f"ttft_ms_{q}"] <= run[f"e2el_ms_{q}"], (where, q)
        # TPOT = (E2EL - TTFT) / (tokens - 1), every request the same token count: so are the means
        assert run["ttft_ms_mean"] + run["tpot_ms_mean"] * (OUTPUT_LEN - 1) == pytest.approx(run["e2el_ms_mean"])
        assert run["duration_s"] * 1e3 >= run["e2el_ms_max"]
        if run["rate_label"] != "inf":
            assert run["duration_s"] >= run["arrival_span_s"] > 0
        else:
            assert run["arrival_span_s"] == 0


@pytest.mark.parametrize("num_rates", [1, 2, 3, 4])
def test_every_rate_runs_each_mode_first_equally_often(num_rates: int) -> None:
    for rate in range(num_rates):
        firsts = [mode_order(["sync", "async"], rep, rate)[0] for rep in range(4)]
        assert firsts.count("sync") == firsts.count("async") == 2, (rate, firsts)
    assert [mode_order(["sync", "async"], 0, i)[0] for i in range(2)] == ["sync", "async"]  # ABBA within a sweep


def test_summary_follows_the_definitions() -> None:
    # sent at 0; tokens at 10, 12, 15 ms; ended at 16 ms. A second request failed.
    ok = RequestRecord(sent_s=0.0, token_times=[0.010, 0.012, 0.015], output_tokens=3, end_s=0.016)
    failed = RequestRecord(sent_s=0.0, end_s=0.5, error="HTTP 503")
    s = summarize([ok, failed], duration_s=0.5, input_len=4)
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, {"HTTP 503": 1})
    assert s["ttft_ms_p50"] == pytest.approx(10.0) and s["e2el_ms_p50"] == pytest.approx(16.0)
    assert s["tpot_ms_p50"] == pytest.approx(3.0)  # (16 - 10) / (3 - 1)
    assert s["itl_ms_mean"] == pytest.approx(2.5) and s["itl_ms_max"] == pytest.approx(3.0)
    assert s["output_throughput"] == pytest.approx(6.0) and s["request_throughput"] == pytest.approx(2.0)


def test_arrivals_are_poisson_at_the_rate_asked() -> None:
    def gaps(burstiness: float) -> list[float]:
        offsets = arrival_offsets(4000, 10.0, burstiness, seed=3)
        assert offsets == arrival_offsets(4000, 10.0, burstiness, seed=3) and offsets[0] == 0.0
        return [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert statistics.fmean(poisson) == pytest.approx(0.1, rel=0.06) == statistics.fmean(bursty)
    assert statistics.stdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    assert statistics.stdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.1)  # gamma k: CV 1/sqrt(k)
    assert arrival_offsets(5, math.inf, 1.0, seed=3) == [0.0] * 5


def test_engine_flags_reach_the_servers_and_the_mode_does_not() -> None:
    args = build_parser().parse_args(
        ["bench", "serve", "--max-num-seqs", "4", "--no-async-relay", "--decode-buckets", "1,2,4", "--async-scheduling"]
    )
    argv = engine_argv(args)
    assert argv[argv.index("--max-num-seqs") + 1] == "4" and argv[argv.index("--decode-buckets") + 1] == "1,2,4"
    assert "--no-async-relay" in argv and "--max-model-len" not in argv  # None: the server's own default
    assert not any("async-scheduling" in a or a in ("--trace", "--stats", "--no-progress") for a in argv)
    assert args.async_scheduling is True
    assert build_parser().parse_args(["bench", "serve"]).async_scheduling is None  # both modes


def test_flags_the_servers_cannot_take_are_a_usage_error(capsys) -> None:
    assert main(["bench", "serve", "--trace", "t.ndjson"]) == 2
    assert "--trace" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "module", "hint"),
    [([], "fastapi", "'.[serve]'"), ([], "openai", "pip install openai"), (["--plots", "d"], "matplotlib", "'.[dev]'")],
)
def test_a_missing_extra_is_a_usage_error_before_any_server_starts(argv, module, hint, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec() answers None
    assert main(["bench", "serve", *argv]) == 2
    assert hint in capsys.readouterr().err


def test_sigterm_stops_the_benchmark_and_its_servers(tmp_path) -> None:
    argv = [sys.executable, "-m", "neuron_async_sm", "bench", "serve", "--device", "cpu-inprocess", "--no-progress"]
    bench = subprocess.Popen([*argv, "--server-log-dir", str(tmp_path)], stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{bench.pid}/task/{bench.pid}/children")
    deadline = time.monotonic() + 60

    def servers() -> list[int]:  # children that are servers already (exec'd: Popen has returned in the bench)
        pids = [int(pid) for pid in children.read_text().split()]
        return [pid for pid in pids if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3:4] == [b"serve"]]

    while len(servers()) < 2:
        assert bench.poll() is None and time.monotonic() < deadline, "bench serve never started its two servers"
        time.sleep(0.05)
    time.sleep(0.2)  # past the bench's own bookkeeping of the second server
    started = servers()
    bench.send_signal(signal.SIGTERM)  # as a job scheduler or `timeout` would
    assert bench.wait(timeout=60) == 143
    assert all(process_gone(pid) for pid in started), "a server outlived the benchmark"


def test_several_running_servers_take_turns_each_under_its_label():
    """--base-url LABEL=URL, repeated: one report over several servers (vllm serve beside ours, say)."""
    urls = ["vllm=http://127.0.0.1:8001/", "ours=http://127.0.0.1:8002"]
    assert external_servers(urls, "server") == {"vllm": "http://127.0.0.1:8001", "ours": "http://127.0.0.1:8002"}
    assert external_servers(["http://127.0.0.1:8001?a=b"], "mine") == {"mine": "http://127.0.0.1:8001?a=b"}
    with pytest.raises(ValueError, match="two servers named 'server'"):
        external_servers(["http://127.0.0.1:1", "http://127.0.0.1:2"], "server")
