"""`neuron-async-sm generate --device xla` gives `--device cpu`'s greedy tokens on a local HF checkpoint.

The CLI's `generate` end to end, sync and async, on tiny-llama's weights written as a checkpoint by
`bench/checkpoint.py`; each run's `--stats` file must show no compilation after warm-up. The `cpu`
reference is a real CLI process. The `xla` runs call the CLI's `main()` in this process: a fresh
XLA process compiles every program of the warm-up again (~30 programs, 8-15 min on this loaded
2-core machine; torch_xla's persistent cache does not help on the PJRT CPU client, which cannot
deserialize executables), while here, with test_engine_backends.py's shapes and after it, every
program is already in this process's compile cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_backends import DECODE_BUCKETS, SHAPES

from neuron_async_sm import cli
from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.model import TINY_LLAMA_CONFIG

ENGINE_FLAGS = [
    "--dtype",
    SHAPES["dtype"],  # float64: greedy ties between devices are negligible
    "--max-num-seqs",
    str(SHAPES["max_num_seqs"]),
    "--max-model-len",
    str(SHAPES["max_model_len"]),
    "--max-num-batched-tokens",
    str(SHAPES["max_num_batched_tokens"]),  # the longer prompts are chunked
    "--decode-buckets",
    ",".join(map(str, DECODE_BUCKETS)),
    "--prefill-buckets",
    ",".join(map(str, SHAPES["prefill_buckets"])),
    "--no-sampling-extras",  # as SHAPES: no penalties or logprobs, their warm-up skipped
    "--no-progress",
]
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
REQUIRE_XLA = os.environ.get("NEURON_ASYNC_SM_REQUIRE_XLA", "") == "1"  # the XLA lane: a missing torch_xla fails
PROCESS_TIMEOUT_S = 300  # the cpu reference: ~10 s


def prompts(path: Path) -> Path:
    """Greedy requests that join and finish at different steps (batch changes: relays and breaks)."""
    lines = []
    for i in range(7):
        prompt = [(17 * i + 5 * k) % TINY_LLAMA_CONFIG.vocab_size for k in range(3 + 4 * i)]
        request = {
            "request_id": f"r{i}",
            "prompt_token_ids": prompt,
            "max_tokens": 6 + 3 * (i % 4),
            "ignore_eos": True,
            "arrival_step": 2 * i,
        }
        lines.append(json.dumps(request))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def generate(tmp_path: Path, checkpoint: Path, requests: Path, device: str, mode: str) -> tuple[dict, dict]:
    out, stats = tmp_path / f"{device}-{mode}.jsonl", tmp_path / f"{device}-{mode}.stats.json"
    argv = [
        "generate",
        "--prompts",
        str(requests),
        "--output",
        str(out),
        "--model",
        str(checkpoint),
        "--device",
        device,
        f"--{mode}",
        "--stats",
        str(stats),
        *ENGINE_FLAGS,
    ]
    if device == "xla":
        assert cli.main(argv) == 0, argv
    else:
        done = subprocess.run(
            [sys.executable, "-m", "neuron_async_sm", *argv], capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S
        )
        assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout}\n{done.stderr[-4000:]}"
    results = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert all(r["finish_reason"] == "length" for r in results), results
    return {r["request_id"]: r["output_token_ids"] for r in results}, json.loads(stats.read_text(encoding="utf-8"))


def test_generate_on_xla_gives_the_cpu_tokens_in_both_modes_and_never_compiles_after_warmup(tmp_path):
    if not HAS_XLA:
        if REQUIRE_XLA:
            pytest.fail("NEURON_ASYNC_SM_REQUIRE_XLA=1 but torch_xla is not importable (run .ci/xla-lane)")
        pytest.skip("torch_xla is not installed")
    checkpoint = write_checkpoint(tmp_path / "tiny-llama", TINY_LLAMA_CONFIG, seed=0)
    requests = prompts(tmp_path / "prompts.jsonl")
    reference, cpu_stats = generate(tmp_path, checkpoint, requests, "cpu", "no-async-scheduling")
    assert "compilations" not in cpu_stats  # the emulator compiles nothing
    for mode in ("no-async-scheduling", "async-scheduling"):
        tokens, stats = generate(tmp_path, checkpoint, requests, "xla", mode)
        assert tokens == reference, f"--device xla --{mode} differs from --device cpu"
        assert stats["compilations"] == 0, f"--{mode}: compiled while serving: {stats}"
        if mode == "async-scheduling":
            assert stats["async_steps"] > 0 and stats["sync_fallback_steps"] > 0, stats  # both kinds of step ran
