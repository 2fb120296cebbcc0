"""Tensor parallelism: TP=2 emits exactly TP=1's tokens (float64), sync and async, and fails cleanly.

Every TP=2 engine here is two real device processes in a gloo process group, each holding its
shard of the weights and of the KV cache; nothing is mocked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support.processes import generate_argv, process_gone
from support.workloads import assert_matches, drive, random_workload
from test_async_scenarios import PATHS, SCENARIOS, R, S, relayed, run

from neuron_async_sm import LLM, ConfigError, EngineConfig, EngineDeadError, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.engine.executor import RankPathMismatchError, check_same_path
from neuron_async_sm.model import TINY_LLAMA_CONFIG
from neuron_async_sm.worker import async_machine as sm

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(
    dtype="float64",  # the all-reduce sums partial products in another order: float64 keeps ties negligible
    max_num_seqs=8,
    max_model_len=128,
    max_num_batched_tokens=32,  # long prompts are chunked
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4, 8),
)
# GQA (4 query heads on 2 KV heads) and an untied LM head over an odd vocabulary, so the vocab shards
# are uneven (the last one padded) and each rank's KV heads serve two query heads.
CHECKPOINT_CONFIG = replace(
    TINY_LLAMA_CONFIG,
    vocab_size=331,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)
FALLBACKS = {sm.COMPOSITION_BREAK, sm.SHAPE_MISMATCH_REBUILD, sm.REORDER_REMAP}


@pytest.fixture
def reference():
    """Fresh per test: an engine draws a missing seed from how many requests it has accepted."""
    with LLM("tiny-llama", async_scheduling=False, **ENGINE) as llm:
        yield llm


def workloads(seed: int, n: int) -> list:
    rng = random.Random(seed)
    return [random_workload(rng, f"w{seed}-{i}") for i in range(n)]


@pytest.mark.parametrize(
    "mode",
    [dict(async_scheduling=False), dict(async_relay=True), dict(async_relay=False)],
    ids=["sync", "relay", "no-relay"],
)
def test_tp2_gives_tp1_tokens_on_churn(reference, mode):
    """Churn (arrivals, finishes, chunked prefills, aborts) reaches every path the mode has, on two ranks."""
    with LLM("tiny-llama", tensor_parallel_size=2, **mode, **ENGINE) as llm:
        check_churn(llm, reference, mode)


def check_churn(llm: LLM, reference: LLM, mode: dict) -> None:
    """`llm` (two ranks) emits `reference`'s tokens on churn and reaches every path its mode has."""
    assert len(llm.engine.runtimes) == 2 and len({r.device_pid for r in llm.engine.runtimes}) == 2
    for items in workloads(7, 5):
        expected = drive(reference, items, aborts=False)
        got = drive(llm, items, aborts=True)
        assert_matches(got, expected, items)
    # Only the output rank's tokens ever reach the host; the other rank's futures are fed or dropped.
    output_rank, other = (runtime.stats().host_transfers for runtime in llm.engine.runtimes)
    assert output_rank > 0 and other == 0, (output_rank, other)
    stats = llm.stats()
    if mode.get("async_scheduling", True):
        reached = {s for s, n in stats["state_counts"].items() if n > 0}
        # The non-output rank's own paths: it never reads its future, even where the output rank must.
        no_spec = set(sm.PATH_STATES) - {sm.HOST_DRAFT_BREAK, sm.SPEC_STEADY, sm.SPEC_EXIT}  # speculation's rows
        assert reached == no_spec - (FALLBACKS if mode["async_relay"] else {sm.RELAY}), stats


@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
@pytest.mark.parametrize(
    "name", ["finish and condense"]
)  # CompositionBreak and ReorderRemap: the non-output rank reads nothing
def test_scenario_counters_are_the_same_at_tp2(tmp_path, name, relay):
    requests, config, design = SCENARIOS[name]
    expected = relayed(name, design) if relay else design
    paths, outputs, stats = run(tmp_path, requests, async_relay=relay, device="cpu", tensor_parallel_size=2, **config)
    assert paths == expected
    async_steps = expected.count(S) + expected.count(R)
    assert (stats["async_steps"], stats["sync_fallback_steps"]) == (async_steps, len(expected) - async_steps)
    assert stats["state_counts"] == {s: expected.count(s) for s in PATHS}
    assert [len(o.output_token_ids) for o in outputs] == [r.sampling_params.max_tokens for r in requests]


def generate(checkpoint: Path, prompts: Path, out: Path, *flags: str) -> list[dict]:
    cmd = generate_argv(
        prompts, out, "--model", checkpoint, "--dtype", "float64", "--max-model-len", "64", "--no-progress", *flags
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def cli_tp1_tokens(tmp_path: Path) -> tuple[tuple[Path, Path], tuple[str, ...], list[dict]]:
    """A local HF checkpoint, prompts for it, small-batch flags, and TP=1's output lines (a CLI run)."""
    checkpoint = write_checkpoint(tmp_path / "ckpt", CHECKPOINT_CONFIG, seed=3)
    rng = random.Random(5)
    lines = [
        {
            "prompt_token_ids": [rng.randrange(3, CHECKPOINT_CONFIG.vocab_size) for _ in range(rng.randint(1, 40))],
            "max_tokens": rng.randint(1, 16),
            "temperature": rng.choice([0.0, 0.9]),
            "seed": i,
            "arrival_step": rng.randint(0, 6),
        }
        for i in range(6)
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    small = ("--max-num-batched-tokens", "16", "--prefill-buckets", "8,16", "--decode-buckets", "2,4,8")
    expected = generate(checkpoint, prompts, tmp_path / "tp1.jsonl", *small)
    assert all(r["finish_reason"] in ("stop", "length") and r["output_token_ids"] for r in expected), expected
    return (checkpoint, prompts), small, expected


def test_cli_tp2_gives_tp1_tokens_on_a_local_checkpoint(tmp_path):
    """`generate --tensor-parallel-size 2` as a real CLI process on an HF checkpoint, with the default
    executor and on Ray where the extra is installed (CI installs it; one TP=1 run serves both).
    Async only: sync at TP=2 is test_tp2_gives_tp1_tokens_on_churn[sync]'s, and each rank loads its
    shard of the checkpoint the same way in either mode."""
    files, small, expected = cli_tp1_tokens(tmp_path)
    runs = [("--async-scheduling",)]
    if importlib.util.find_spec("ray") is not None:
        runs.append(("--async-scheduling", "--distributed-executor-backend", "ray"))
    for flags in runs:
        got = generate(*files, tmp_path / "tp2.jsonl", *small, *flags, "--tensor-parallel-size", "2")
        assert got == expected, flags


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_killed_rank_ends_the_engine_naming_the_rank(async_scheduling):
    llm = LLM("tiny-llama", tensor_parallel_size=2, async_scheduling=async_scheduling, device_timeout_s=30)
    pid = llm.engine.runtimes[1].device_pid
    kill_rank_one(llm, f"device process {pid} was killed by signal 9")


def kill_rank_one(llm: LLM, exit_text: str) -> None:
    """SIGKILL rank 1's device mid-run: every request errors naming rank 1 (`exit_text` says how it
    died), the other rank's device goes too, the engine is dead. Closes `llm`."""
    pids = [runtime.device_pid for runtime in llm.engine.runtimes]
    try:
        for i in range(4):
            llm.add_request([5 + i, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), f"r{i}")
        for _ in range(3):
            llm.step()  # mid-run, every request in flight
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        finishes = {}
        while llm.has_unfinished_requests():
            for delta in llm.step():
                if delta.finish_reason:
                    finishes[delta.request_id] = delta
        elapsed = time.monotonic() - killed
        assert sorted(finishes) == ["r0", "r1", "r2", "r3"]
        assert {d.finish_reason for d in finishes.values()} == {"error"}
        for delta in finishes.values():
            assert delta.error.startswith("RankFailedError: tensor-parallel rank 1 failed"), delta.error
            assert exit_text in delta.error, delta.error
        assert elapsed < 10, f"the engine took {elapsed:.1f} s to notice the dead rank"
        # The dead engine took its other rank down with it, before anyone closed it.
        deadline = time.monotonic() + 5  # a Ray actor's process exits shortly after ray.kill()
        while not all(map(process_gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not process_gone(pid)] == []
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
            llm.step()
    finally:
        llm.close()


def test_tensor_parallel_size_is_validated_naming_the_field():
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: .*device='cpu'"):
        EngineConfig(tensor_parallel_size=2, device="cpu-inprocess")
    with pytest.raises(ConfigError, match="enforce_eager: a tensor-parallel rank's program runs eagerly"):
        EngineConfig(tensor_parallel_size=2, enforce_eager=False)
    with pytest.raises(ConfigError, match="distributed_executor_backend: unknown backend 'slurm'"):
        EngineConfig(distributed_executor_backend="slurm")
    # tiny-llama has 4 attention heads (2 KV heads): 3 ranks cannot split them (checked before any device starts).
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size: the model's num_attention_heads \(\d+\) does not divide by 3"
    ):
        LLM("tiny-llama", tensor_parallel_size=3)


def test_diverging_paths_name_the_ranks_and_paths():
    check_same_path(4, [sm.STEADY, sm.STEADY])
    with pytest.raises(RankPathMismatchError, match="step 4: .*rank 0 Steady, rank 1 Relay"):
        check_same_path(4, [sm.STEADY, sm.RELAY])
