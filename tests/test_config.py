"""A bad engine configuration fails at construction, with a message that names what to change.

Through `EngineConfig`, through `LLM(...)`, and through the CLI (exit code 2, one `error:` line).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.processes import generate_argv

from neuron_async_sm import LLM, ConfigError, EngineConfig
from neuron_async_sm.cli import main
from neuron_async_sm.model import ModelLoadError

REPO = Path(__file__).resolve().parents[1]

BAD_CONFIGS = [
    # (EngineConfig fields, the field the message must name, a fragment saying what to do)
    (dict(max_num_seqs=16), "decode_buckets", "add a bucket >= 16"),
    (dict(decode_buckets=(1, 2), max_num_seqs=4), "decode_buckets", "max_num_seqs=4"),
    (dict(decode_buckets=()), "decode_buckets", "positive integer"),
    (dict(decode_buckets=(0, 8)), "decode_buckets", "positive integer"),
    (dict(decode_buckets=(1.5, 8)), "decode_buckets", "positive integer"),
    (dict(decode_buckets=8), "decode_buckets", "list"),
    (dict(prefill_buckets=(16, 32)), "prefill_buckets", "max_num_batched_tokens=256"),
    (dict(device="tpu"), "device", "cpu-inprocess"),
    (dict(dtype="float16"), "dtype", "bfloat16"),
    (dict(async_scheduling=True, on_device_sampling=False), "async_scheduling", "--no-async-scheduling"),
    (dict(max_num_seqs=0), "max_num_seqs", "positive integer"),
    (dict(max_model_len=-1), "max_model_len", "positive integer"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens", "positive integer"),
    (dict(runtime_queue_depth=0), "runtime_queue_depth", "positive integer"),
    (dict(device_threads=0), "device_threads", "positive integer"),
    (dict(device_time_ms=-1.0), "device_time_ms", ">= 0"),
    (dict(device_time_ms="1"), "device_time_ms", "number"),
    (dict(sampling_extras="no"), "sampling_extras", "True or False"),
    (dict(enforce_eager=False, speculative_config={"method": "ngram"}), "speculative_config", "enforce_eager"),
]


@pytest.mark.parametrize(
    ("fields", "field", "hint"), BAD_CONFIGS, ids=[f"{c[1]}-{i}" for i, c in enumerate(BAD_CONFIGS)]
)
def test_bad_engine_config_names_the_field(fields, field, hint):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**fields)
    message = str(info.value)
    assert message.startswith(f"{field}:") and hint in message


def test_speculation_is_taken_on_xla():
    config = EngineConfig(device="xla", speculative_config={"method": "ngram"})
    assert config.speculative_config is not None and config.speculative_config.method == "ngram"


def test_valid_config_sorts_and_deduplicates_buckets():
    config = EngineConfig(decode_buckets=[8, 1, 4, 4], prefill_buckets=(256, 16))
    assert config.decode_buckets == (1, 4, 8) and config.prefill_buckets == (16, 256)
    assert EngineConfig(async_scheduling=False, on_device_sampling=False).on_device_sampling is False


def test_llm_rejects_a_bad_config_before_starting_a_device():
    with pytest.raises(ConfigError, match="^decode_buckets:"):
        LLM("tiny-llama", device="cpu-inprocess", max_num_seqs=9)
    with pytest.raises(ConfigError, match="^async_scheduling:"):
        LLM("tiny-llama", device="cpu-inprocess", on_device_sampling=False)


def test_llm_rejects_a_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="never downloaded") as info:
        LLM(str(missing), device="cpu-inprocess")
    assert str(missing) in str(info.value)


def test_llm_rejects_a_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        LLM(str(tmp_path), device="cpu-inprocess")


def write_config_only_checkpoint(model_dir: Path) -> Path:
    """A Llama config.json with no weights next to it."""
    model_dir.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "eos_token_id": 2,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_llm_rejects_a_directory_without_a_checkpoint(tmp_path):
    model_dir = write_config_only_checkpoint(tmp_path / "config-only")
    # Checked on the host before the device starts: a ModelLoadError, not a device traceback.
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model_dir), device="cpu-inprocess")
    message = str(info.value)
    assert "has no checkpoint" in message and str(model_dir) in message and "model.safetensors" in message


def test_llm_rejects_max_model_len_beyond_the_model(tmp_path):
    with pytest.raises(ConfigError, match="max_model_len: 8192 exceeds the model's max_position_embeddings"):
        LLM("tiny-llama", device="cpu-inprocess", max_model_len=8192)


def cli_error(capsys, *argv: object) -> str:
    """Run the CLI, expect exit code 2 and a single `error: ...` line on stderr; return that line."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse rejects before main() returns
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert lines and "error: " in lines[-1]
    return lines[-1]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2}) + "\n")
    return path


def test_cli_bad_engine_flags_exit_2_with_one_error_line(tmp_path, prompts, capsys):
    base = generate_argv(prompts, tmp_path / "o.jsonl", "--device", "cpu-inprocess", process=False)
    line = cli_error(capsys, *base, "--max-num-seqs", "16")
    assert line.startswith("error: decode_buckets:") and "add a bucket >= 16" in line
    line = cli_error(capsys, *base, "--max-num-batched-tokens", "512")
    assert line.startswith("error: prefill_buckets:")
    line = cli_error(capsys, *base, "--max-num-seqs", "0")
    assert line.startswith("error: max_num_seqs:")
    line = cli_error(capsys, *base, "--device-time-ms", "-5")
    assert line.startswith("error: device_time_ms:")
    line = cli_error(capsys, *base, "--decode-buckets", "1,x")
    assert "--decode-buckets" in line
    line = cli_error(capsys, *base, "--device", "tpu")
    assert "--device" in line and "cpu-inprocess" in line
    line = cli_error(capsys, *base, "--dtype", "float16")
    assert "--dtype" in line and "bfloat16" in line
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_bad_model_exits_2_with_one_error_line(tmp_path, prompts, capsys):
    base = generate_argv(prompts, tmp_path / "o.jsonl", "--device", "cpu-inprocess", process=False)
    line = cli_error(capsys, *base, "--model", tmp_path / "missing")
    assert line.startswith("error: model ") and "never downloaded" in line
    line = cli_error(capsys, *base, "--model", tmp_path)
    assert "has no config.json" in line
    model_dir = write_config_only_checkpoint(tmp_path / "config-only")
    line = cli_error(capsys, *base, "--model", model_dir)
    assert line.startswith("error: ") and "has no checkpoint" in line and "model.safetensors" in line


def test_cli_unreadable_prompts_file_exits_2_with_one_error_line(tmp_path, capsys):
    line = cli_error(capsys, *generate_argv(tmp_path / "none.jsonl", tmp_path / "o.jsonl", process=False))
    assert line.startswith("error: ") and "none.jsonl" in line
    line = cli_error(capsys, *generate_argv(tmp_path, tmp_path / "o.jsonl", process=False))
    assert line.startswith("error: ") and str(tmp_path) in line


def test_cli_config_error_end_to_end_prints_no_traceback(tmp_path, prompts):
    model_dir = write_config_only_checkpoint(tmp_path / "config-only")
    proc = subprocess.run(
        generate_argv(prompts, tmp_path / "o.jsonl", "--model", model_dir, "--no-progress"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "has no checkpoint" in proc.stderr
