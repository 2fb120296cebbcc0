"""The engine flags are EngineConfig's `flag` fields: same names, same defaults, and back again."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from neuron_async_sm.args import add_engine_args, engine_config, engine_fields
from neuron_async_sm.bench.serve_command import engine_argv
from neuron_async_sm.cli import build_parser
from neuron_async_sm.config import ConfigError, EngineConfig

SUBCOMMANDS = (["generate", "--prompts", "in.jsonl", "--output", "out.jsonl"], ["demo"], ["serve"])


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_flag_field_is_a_flag_and_every_engine_flag_is_a_field():
    flags = {
        a.dest: a.option_strings for a in _engine_parser()._actions if a.dest not in ("help", "stats", "no_progress")
    }
    fields = {f.name for f in engine_fields()}
    assert set(flags) == fields
    assert flags["max_num_seqs"] == ["--max-num-seqs"] and flags["trace_path"] == ["--trace"]
    assert flags["async_relay"] == ["--async-relay", "--no-async-relay"]  # a bool is --x / --no-x
    assert {"on_device_sampling", "device_threads", "device_cpu"}.isdisjoint(fields)  # no help: not a flag


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda argv: argv[0])
def test_no_flags_build_the_default_engine_config(argv):
    assert engine_config(build_parser().parse_args(argv)) == EngineConfig()


def test_flags_reach_the_engine_config_by_field_name():
    args = _engine_parser().parse_args(
        [
            "--model", "m", "--device", "cpu-inprocess", "--dtype", "float64", "--no-async-scheduling",
            "--no-async-relay", "--max-num-seqs", "16", "--max-model-len", "64", "--kv-cache-memory-gb", "0.5",
            "--max-num-batched-tokens", "32", "--decode-buckets", "16,1", "--prefill-buckets", "32,16",
            "--seed", "3", "--runtime-queue-depth", "4", "--device-time-ms", "1.5", "--device-timeout-s", "60",
            "--device-startup-timeout-s", "300", "--tensor-parallel-size", "2", "--trace", "t.ndjson",
        ]
    )  # fmt: skip
    expected = dict(
        model="m", device="cpu-inprocess", dtype="float64", async_scheduling=False, async_relay=False,
        max_num_seqs=16, max_model_len=64, kv_cache_memory_gb=0.5, max_num_batched_tokens=32,
        decode_buckets=(1, 16), prefill_buckets=(16, 32), seed=3, runtime_queue_depth=4, device_time_ms=1.5,
        device_timeout_s=60.0, device_startup_timeout_s=300.0, tensor_parallel_size=2, trace_path="t.ndjson",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="device='cpu'"):  # two ranks need the device process: validated
        engine_config(args)
    args.device = "cpu"
    assert engine_config(args) == EngineConfig(**{**expected, "device": "cpu"})


def test_bench_serve_forwards_every_engine_flag_but_the_mode_and_the_files():
    argv = ["--max-num-seqs", "4", "--no-enforce-eager", "--decode-buckets", "1,4", "--seed", "9"]
    args = build_parser().parse_args(["bench", "serve", *argv])
    forwarded = build_parser().parse_args(["serve", *engine_argv(args)])
    config = engine_config(forwarded)
    assert config == dataclasses.replace(
        EngineConfig(), max_num_seqs=4, enforce_eager=False, decode_buckets=(1, 4), seed=9
    )
