"""`neuron-async-sm generate | demo | diagram`: files in, files out, every flag accepted.

Most runs call `cli.main()` in this process with `--device cpu-inprocess` (fast); one runs
`python -m neuron_async_sm generate` end to end with the default `--device cpu` (a device process).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from support.processes import generate_argv

from neuron_async_sm.cli import build_parser, main
from neuron_async_sm.worker.async_machine import PATH_STATES

REPO = Path(__file__).resolve().parents[1]
OUTPUT_FIELDS = {"request_id", "output_token_ids", "finish_reason", "error"}

REQUESTS = [
    {"request_id": "long", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 12, "ignore_eos": True},
    {"prompt_token_ids": [9, 10], "max_tokens": 3},  # no id: the CLI names it line-2
    {"request_id": "late", "prompt_token_ids": [11] * 20, "max_tokens": 4, "arrival_step": 6},
    {"request_id": "sampled", "prompt_token_ids": [12, 13, 14], "max_tokens": 5, "temperature": 0.8, "seed": 7},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run_cli(*argv: str) -> int:
    return main([str(a) for a in argv])


def generate(tmp_path: Path, rows: list, *extra: str, name: str = "out", top: tuple = ()) -> list[dict]:
    prompts = write_jsonl(tmp_path / f"{name}.in.jsonl", rows)
    out = tmp_path / f"{name}.jsonl"
    device = () if "--device" in extra else ("--device", "cpu-inprocess")
    assert run_cli(*generate_argv(prompts, out, "--no-progress", *extra, *device, top=top, process=False)) == 0
    return read_jsonl(out)


def test_generate_end_to_end_with_device_process_writes_outputs_stats_and_trace(tmp_path):
    prompts = write_jsonl(tmp_path / "in.jsonl", [*REQUESTS, "not json"])
    out, stats, trace = tmp_path / "out" / "o.jsonl", tmp_path / "s.json", tmp_path / "t.ndjson"
    proc = subprocess.run(
        generate_argv(prompts, out, "--model", "tiny-llama", "--stats", stats, "--trace", trace, "--no-progress"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr  # the malformed line failed; every other request succeeded
    assert "tokens/s" in proc.stdout and "5 requests: 4 succeeded, 1 failed" in proc.stdout

    results = read_jsonl(out)
    assert [r["request_id"] for r in results] == ["long", "line-2", "late", "sampled", "line-5"]
    for r in results:
        assert set(r) == OUTPUT_FIELDS
    assert results[0]["finish_reason"] == "length" and len(results[0]["output_token_ids"]) == 12
    assert all(r["finish_reason"] in ("length", "stop") and r["error"] is None for r in results[:4])
    assert results[4]["finish_reason"] == "error" and "malformed JSON" in results[4]["error"]

    s = json.loads(stats.read_text())
    assert s["steps"] > 0 and s["elapsed_s"] > 0 and s["tokens_per_s"] > 0
    assert s["output_tokens"] == sum(len(r["output_token_ids"]) for r in results)
    assert s["async_steps"] > 0 and s["sync_fallback_steps"] > 0
    assert set(s["state_counts"]) == set(PATH_STATES)
    assert sum(s["state_counts"].values()) == s["steps"] == s["async_steps"] + s["sync_fallback_steps"]

    events = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"step", "reinstate", "Materialize"} <= kinds
    assert sum(e["event"] == "step" for e in events) == s["steps"]


def test_sync_mode_gives_the_same_greedy_tokens_as_async_in_float64(tmp_path):
    greedy = [r for r in REQUESTS if not r.get("temperature")]
    greedy += [{"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 2 + n % 7} for n in range(1, 40, 6)]
    small = (
        "--dtype",
        "float64",
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "32",
        "--prefill-buckets",
        "16,32",
    )
    async_out = generate(tmp_path, greedy, *small, "--async-scheduling", name="async")
    sync_out = generate(tmp_path, greedy, *small, "--no-async-scheduling", name="sync")
    assert all(r["finish_reason"] in ("length", "stop") for r in async_out)
    assert sync_out == async_out


def test_arrival_step_holds_a_request_back_until_its_loop_turn(tmp_path):
    trace = tmp_path / "t.ndjson"
    results = generate(tmp_path, REQUESTS, "--trace", trace)
    assert [r["request_id"] for r in results] == ["long", "line-2", "late", "sampled"]
    first_step: dict[str, int] = {}
    for event in map(json.loads, trace.read_text().splitlines()):
        if event["event"] == "step":
            for req_id in event["req_ids"]:
                first_step.setdefault(req_id, event["step"])
    # "long" keeps a step in flight every turn, so step ids advance one per turn: the request that
    # arrives at turn 6 is first scheduled in step 6, while the others start in step 0.
    assert first_step["late"] == 6
    assert first_step["long"] == first_step["line-2"] == first_step["sampled"] == 0
    assert len(results[2]["output_token_ids"]) == 4


def _help_flags(parser_argv: list[str], capsys) -> set[str]:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*parser_argv, "--help"])
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}


def test_every_generate_flag_in_help_is_accepted(tmp_path, capsys):
    trace, stats = tmp_path / "t.ndjson", tmp_path / "s.json"
    values = {
        "--prompts": None,
        "--output": None,  # filled in by generate()
        "--model": ["tiny-llama"],
        "--device": ["cpu-inprocess"],
        "--dtype": ["float64"],
        "--async-scheduling": [],
        "--no-async-scheduling": [],  # one per run below
        "--async-relay": [],
        "--no-async-relay": [],  # one per run below
        "--enforce-eager": [],
        "--no-enforce-eager": None,  # compiles for minutes: tests/test_compiled_program.py runs compiled
        "--sampling-extras": [],
        "--no-sampling-extras": None,  # refuses penalties and logprobs: test_warmup_shapes
        "--tensor-parallel-size": ["1"],
        "--distributed-executor-backend": ["mp"],
        "--max-num-seqs": ["4"],
        "--max-model-len": ["128"],
        "--kv-cache-memory-gb": ["1"],
        "--max-num-batched-tokens": ["32"],
        "--decode-buckets": ["1,2,4,8"],
        "--prefill-buckets": ["16,32"],
        "--seed": ["3"],
        "--max-logprobs": ["5"],
        "--runtime-queue-depth": ["4"],
        "--device-time-ms": ["1"],
        "--device-timeout-s": ["60"],
        "--device-startup-timeout-s": ["300"],
        "--trace": [str(trace)],
        "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 2}'],
        "--stats": [str(stats)],
        "--no-progress": [],
    }
    assert _help_flags(["generate"], capsys) == set(values), "a new flag needs a value in this test"
    engine_args = [str(a) for flag, v in values.items() if v is not None and "async" not in flag for a in (flag, *v)]
    rows = [
        {"request_id": "fills", "prompt_token_ids": [7] * 120, "max_tokens": 50},  # 120 + 8 = max_model_len
        *({"prompt_token_ids": [3 + i] * (5 + 9 * i), "max_tokens": 6} for i in range(5)),  # > max_num_seqs
    ]
    for mode, relay in (("--async-scheduling", "--no-async-relay"), ("--no-async-scheduling", "--async-relay")):
        results = generate(tmp_path, rows, *engine_args, mode, relay, name=mode.strip("-"), top=("--verbose",))
        assert all(r["finish_reason"] in ("length", "stop") for r in results)
        assert len(results[0]["output_token_ids"]) <= 8  # --max-model-len 128 reached the engine
        assert json.loads(stats.read_text())["async_scheduling"] is (mode == "--async-scheduling")
        assert trace.stat().st_size > 0


def test_demo_writes_one_line_per_request_and_prints_tokens_per_second(tmp_path, capsys):
    out = tmp_path / "demo.jsonl"
    assert run_cli("demo", "--num-requests", "4", "--output", out, "--device", "cpu-inprocess", "--no-progress") == 0
    results = read_jsonl(out)
    assert len(results) == 4 and all(set(r) == OUTPUT_FIELDS for r in results)
    assert all(r["finish_reason"] in ("length", "stop") and r["output_token_ids"] for r in results)
    assert re.search(r"[\d.]+ tokens/s", capsys.readouterr().out)


def test_diagram_writes_dot_source(tmp_path, capsys):
    assert run_cli("diagram", "--output", tmp_path / "d" / "sm") == 0
    dot = (tmp_path / "d" / "sm.dot").read_text()
    assert dot.lstrip().startswith("digraph") and all(state in dot for state in PATH_STATES)
    assert "sm.dot" in capsys.readouterr().out
