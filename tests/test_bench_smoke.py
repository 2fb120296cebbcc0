"""`neuron-async-sm bench` on a tiny workload: the JSON report has every field, finite and positive.

Timings on a shared machine vary run to run: nothing here compares a time against a threshold.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import pytest
import torch
import tree_ab  # tools/ (pytest's pythonpath)
from safetensors.torch import load_file

from neuron_async_sm.bench.checkpoint import write_checkpoint, write_noisy_copy
from neuron_async_sm.bench.metrics import compare, percentile
from neuron_async_sm.bench.sweep import ideal_speedup
from neuron_async_sm.bench.workloads import WORKLOADS, build_workload
from neuron_async_sm.cli import build_parser, main
from neuron_async_sm.config import SpeculativeConfig
from neuron_async_sm.model import load_model_config
from neuron_async_sm.model.drafter import check_draft_model

PER_MODE = (
    "tokens_per_s",
    "steps_per_s",
    "step_ms",
    "busy_s",
    "host_ms_per_step",
    "device_ms_per_step",
    "wait_ms_per_step",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
)


def test_bench_writes_a_complete_report(tmp_path: Path, capsys) -> None:
    """With a draft model, so one invocation covers the four engines (sync and async, without and with
    speculation) and the spec figures: acceptance in [0, 1], at least one token per target step and per
    spec row, SpecSteady counted, async against sync with speculation."""
    target = write_checkpoint(tmp_path / "target", layer_scale=0.02)
    draft = write_noisy_copy(target, tmp_path / "draft", 0.0, num_layers=1)
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    out = tmp_path / "bench.json"
    argv = ["bench", "--workload", "steady", "--model", str(target), "--num-requests", "2", "--output-tokens", "8"]
    argv += ["--repetitions", "2", "--warmup", "0", "--speculative-config", json.dumps(speculative)]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    for mode in ("sync", "async"):
        for field in PER_MODE:
            value = report[mode][field]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (mode, field, value)
        assert report[mode]["output_tokens"] == 2 * 8
        assert report[mode]["device_idle_ms_per_step"] >= 0
        assert math.isfinite(report[mode]["device_overhead_ms_per_step"])
    for field in ("speedup", "ideal_speedup", "C_ms", "D_ms", "D_over_C"):
        assert math.isfinite(report[field]) and report[field] > 0, field
    assert 1.0 <= report["ideal_speedup"] <= 2.0  # (C + D) / max(C, D), whatever the timings
    assert math.isfinite(report["overlap_efficiency"])  # may be negative on a noisy machine
    assert 0.0 <= report["async_step_fraction"] <= 1.0
    assert sum(report["state_counts"].values()) == report["async"]["steps_total"] == 2 * report["async"]["steps"]
    assert report["sync"]["serial_s"] >= report["sync"]["ideal_s"] > 0
    assert report["sync"]["busy_s"] >= report["sync"]["ideal_with_transport_s"] > 0
    assert 1.0 <= report["ideal_speedup_with_transport"] <= 2.0 and math.isfinite(report["O_ms"])
    assert all(math.isnan(r["other_cpu"]) or r["other_cpu"] >= 0.0 for r in report["runs"])  # NaN: no /proc
    # Each repetition ran every engine once, in an order rotated by one engine per repetition.
    names = ["sync", "async", "sync_spec", "async_spec"]
    assert [r["mode"] for r in report["runs"]] == names + names[1:] + names[:1]
    assert report["speculative_config"]["num_speculative_tokens"] == 2
    spec = report["speculation"]
    for mode in ("sync", "async"):
        assert spec[mode]["output_tokens"] == 2 * 8 and spec[mode]["num_draft_tokens"] > 0, mode
        assert 0.0 <= spec["acceptance_rate"][mode] <= 1.0, spec["acceptance_rate"]
        assert 1.0 <= spec["tokens_per_spec_row"][mode] <= 1 + 2, spec["tokens_per_spec_row"]
        assert 1.0 <= spec["tokens_per_step"][mode]["none"] <= spec["tokens_per_step"][mode]["spec"], mode
        ratio = spec["spec_over_none"][mode]
        assert len(ratio["per_repetition"]) == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"], ratio
    assert spec["state_counts"]["SpecSteady"] > 0 and 0.0 < spec["spec_steady_fraction"] <= 1.0
    assert spec["decode_steps"] == spec["async"]["steps_total"] - 2  # each run's one prefill step
    assert 1.0 <= spec["ideal_speedup"] <= 2.0 and math.isfinite(spec["speedup"]) and spec["D_ms"] > 0
    printed = capsys.readouterr().out
    assert "async spec" in printed and "spec/none tokens/s" in printed and "SpecSteady:" in printed, printed


def test_overlap_figures_follow_their_definitions() -> None:
    # C = 1 ms, D = 2 ms per step, 10 steps: T_sync = 30 ms, T_ideal = 20 ms; async took 22 ms.
    sync = {
        "busy_s": 0.030,
        "serial_s": 0.030,
        "ideal_s": 0.020,
        "ideal_with_transport_s": 0.020,
        "host_ms_per_step": 1.0,
        "device_ms_per_step": 2.0,
        "sync_overhead_ms_per_step": 0.0,
    }
    result = compare([sync], [{"busy_s": 0.022}])
    assert result["speedup"] == pytest.approx(30 / 22)
    assert result["ideal_speedup"] == pytest.approx(1.5) == pytest.approx(ideal_speedup(2.0))
    assert result["overlap_efficiency"] == pytest.approx(8 / 10)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_and_fit_the_engine(name: str) -> None:
    first, again = build_workload(name), build_workload(name)
    assert first == again
    assert all(len(r.prompt_token_ids) + r.sampling_params.max_tokens < 512 for r in first.requests)
    assert len({r.request_id for r in first.tagged("x")}) == first.num_requests


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from neuron_async_sm.bench.plots import write_plots

    point = {"D_over_C": 1.0, "speedup": 1.8, "ideal_speedup": 1.95}
    rows = [{"batch": b, "sync_host_us": 100.0 * b, "async_host_us": 90.0 * b} for b in (1, 2)]
    report = {
        "sweep": {"model": "micro-llama", "batch": 2, "points": [point]},
        "host_cost_batch": {"rows": rows},
        "vs_transformers": {
            "new_tokens": 4,
            "transformers_threads": [1],
            "rows": [{"batch": 1, "ours_tokens_per_s": 10.0, "transformers_1t_tokens_per_s": 5.0, "ratio": 2.0}],
        },
    }
    paths = write_plots(report, tmp_path)
    assert [p.name for p in paths] == [
        "bench_speedup_vs_dc.png",
        "bench_host_cost_batch.png",
        "bench_vs_transformers.png",
    ]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_sweep_and_host_cost_run_end_to_end() -> None:
    from neuron_async_sm.bench.host_cost import host_cost_vs_batch, host_cost_vs_waiting
    from neuron_async_sm.bench.sweep import run_sweep

    sweep = run_sweep((0.25, 4.0), batch=4, output_tokens=4, repetitions=1)
    points = sweep["points"]
    assert [p["requested_ratio"] for p in points] == [None, 0.25, 4.0]
    assert points[0]["kind"] == "real compute" and points[0]["device_time_ms"] == points[0]["host_extra_ms"] == 0
    for p in points:
        assert p["kind"] in ("real compute", "device hold", "host spin")
        assert (p["device_time_ms"] > 0) == (p["kind"] == "device hold")
        assert (p["host_extra_ms"] > 0) == (p["kind"] == "host spin")
        for field in ("D_over_C", "speedup", "ideal_speedup", "C_ms", "D_ms"):
            assert math.isfinite(p[field]) and p[field] > 0, (p["kind"], field)
        # Each pair's own figures (tests/test_bench_sweep_pairs.py checks them against known timings).
        (pair,) = p["pairs"]
        assert pair["counted"] and p["pairs_counted"] == 1 and p["pairs_at_target"] in (0, 1)
        assert pair["speedup"] == p["speedup"] and pair["overlap_efficiency"] == p["overlap_efficiency"]
        assert (pair["C_ms"], pair["D_ms"]) == (p["C_ms"], p["D_ms"])
    batch = host_cost_vs_batch((1, 2), output_tokens=4, repetitions=1)
    assert [r["batch"] for r in batch["rows"]] == [1, 2]
    waiting = host_cost_vs_waiting((0, 50), running=2, steps=4)
    assert [r["waiting"] for r in waiting["rows"]] == [0, 50]
    for row in batch["rows"] + waiting["rows"]:
        assert all(math.isfinite(row[f"{mode}_host_us"]) and row[f"{mode}_host_us"] > 0 for mode in ("sync", "async"))
    # docs/bench/tree_ab.py reads these sections of a report (tests/test_tree_ab.py runs it on the comparison).
    ab = tree_ab.figures({"sweep": sweep, "host_cost_batch": batch, "machine": {"load_avg_end": [0.0]}})
    real, low, high = points
    assert (ab["sweep_real_speedup"], ab["sweep_dc0.25_overlap_efficiency"], ab["sweep_dc4_D_over_C"]) == (
        real["speedup"],
        low["overlap_efficiency"],
        high["D_over_C"],
    )
    for mode in ("sync", "async"):
        fit = batch["linear_fit"][mode]
        assert (ab[f"host_{mode}_fixed_us"], ab[f"host_{mode}_us_per_request"]) == (
            fit["intercept_us"],
            fit["slope_us_per_request"],
        )
        assert ab[f"host_{mode}_C1_us"] == batch["rows"][0][f"{mode}_host_us"]


@pytest.mark.parametrize(
    ("flag", "module"), [("--vs-transformers", "transformers"), ("--all", "transformers"), ("--plots", "matplotlib")]
)
def test_a_section_without_its_dev_extra_fails_before_any_run(flag, module, monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec() answers None
    argv = [
        "bench",
        "--workload",
        "steady",
        "--num-requests",
        "1",
        flag,
        *([str(tmp_path)] if flag == "--plots" else []),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"needs {module}" in err and "pip install -e '.[dev]'" in err and "Traceback" not in err, err


def test_a_bad_speculative_config_exits_2_naming_the_key(capsys) -> None:
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    assert main(["bench", "--speculative-config", bad, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "speculative_config.draft_tensor_parallel_size: not supported" in err and "Traceback" not in err, err


def test_spec_checkpoints_writes_a_target_and_drafts_of_its_first_layer(tmp_path: Path, capsys) -> None:
    """`bench spec-checkpoints DIR`: the high draft is the target's first layer exactly, the low one
    that layer with noise; each printed command parses and its draft passes the engine's check."""
    assert main(["bench", "spec-checkpoints", str(tmp_path)]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    target = load_model_config(str(tmp_path / "target"))
    weights = load_file(str(tmp_path / "target" / "model.safetensors"))
    for setting, exact in (("high", True), ("low", False)):
        argv = shlex.split(lines[setting])
        assert argv[:2] == ["neuron-async-sm", "bench"], lines
        args = build_parser().parse_args(argv[1:])
        spec = SpeculativeConfig.parse(args.speculative_config)
        draft = check_draft_model(spec, target, tensor_parallel_size=1)
        assert draft.num_hidden_layers == 1 < target.num_hidden_layers
        drafted = load_file(str(Path(spec.model) / "model.safetensors"))
        assert drafted.keys() == {n for n in weights if ".layers." not in n or ".layers.0." in n}
        same = all(torch.equal(drafted[n], weights[n]) for n in drafted)
        assert same == exact, setting
