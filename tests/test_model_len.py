"""max_model_len derived from the model and fitted to the KV cache budget (engine/model_len.py).

The transformers side (a 256-position checkpoint generating with no max_model_len, both modes, and
through the CLI) is in test_model_hf_parity.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from neuron_async_sm import LLM, ConfigError, EngineConfig, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.cli import main
from neuron_async_sm.engine.model_len import GIB, default_kv_cache_memory_gb
from neuron_async_sm.model import TINY_LLAMA_CONFIG, kv_cache_bytes
from neuron_async_sm.model.kv_cache import KVCache

ENGINE = dict(device="cpu-inprocess", max_num_seqs=8)
# tiny-llama's KV cache per position, over its 8 + 1 scratch slots: layers * slots * (K, V) * kv_heads *
# head_dim * float32. Written out here so the engine's formula is checked against an independent one.
TINY_BYTES_PER_POSITION = 4 * 9 * 2 * 2 * 32 * 4
ONE_MIB_GB = 2**20 / GIB
ONE_MIB_FITS = 2**20 // TINY_BYTES_PER_POSITION  # 56 positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_is_what_the_cache_allocates(dtype: torch.dtype) -> None:
    cache = KVCache(TINY_LLAMA_CONFIG, max_num_seqs=3, max_model_len=17, dtype=dtype)
    allocated = cache.k.nbytes + cache.v.nbytes
    assert kv_cache_bytes(TINY_LLAMA_CONFIG, 3, 17, dtype) == allocated
    assert kv_cache_bytes(TINY_LLAMA_CONFIG, 8, 1, torch.float32) == TINY_BYTES_PER_POSITION


def test_unset_max_model_len_is_the_models_limit_everywhere_downstream(caplog) -> None:
    caplog.set_level(logging.INFO, logger="neuron_async_sm")
    assert EngineConfig().max_model_len is None
    with LLM("tiny-llama", **ENGINE) as llm:
        assert llm.config.max_model_len == TINY_LLAMA_CONFIG.max_position_embeddings == 512
        assert llm.engine.scheduler.config.max_model_len == 512
        assert llm.engine.runner.config.max_model_len == 512
        assert llm.config.kv_cache_memory_gb > 0  # the default budget, resolved to a number
    assert "max_model_len=512 (the model's max_position_embeddings)" in caplog.messages


def test_small_budget_reduces_max_model_len_with_a_warning(caplog) -> None:
    caplog.set_level(logging.INFO, logger="neuron_async_sm")
    with LLM("tiny-llama", kv_cache_memory_gb=ONE_MIB_GB, **ENGINE) as llm:
        assert llm.config.max_model_len == ONE_MIB_FITS
        # The scheduler stops the request at the reduced length, not at the model's 512.
        [out] = llm.generate([[5] * 40], SamplingParams(max_tokens=50, ignore_eos=True))
    assert (len(out.output_token_ids), out.finish_reason) == (ONE_MIB_FITS - 40, "length")
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(
        f"max_model_len={ONE_MIB_FITS}, reduced from the model's max_position_embeddings 512 to fit "
        "--kv-cache-memory-gb"
    )


def test_cli_kv_cache_memory_gb_reaches_the_engine(tmp_path: Path, caplog) -> None:
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5] * 40, "max_tokens": 50, "ignore_eos": True}) + "\n")
    argv = [
        "generate",
        "--prompts",
        str(prompts),
        "--output",
        str(out),
        "--device",
        "cpu-inprocess",
        "--no-progress",
        "--kv-cache-memory-gb",
        str(ONE_MIB_GB),
    ]
    assert main(argv) == 0
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (len(result["output_token_ids"]), result["finish_reason"]) == (ONE_MIB_FITS - 40, "length")
    assert any(f"max_model_len={ONE_MIB_FITS}, reduced" in m for m in caplog.messages)


def test_explicit_max_model_len_above_the_model_names_both_numbers() -> None:
    with pytest.raises(ConfigError) as info:
        LLM("tiny-llama", max_model_len=513, **ENGINE)
    message = str(info.value)
    assert message.startswith("max_model_len: 513 exceeds the model's max_position_embeddings (512)")
    assert "--max-model-len" in message


def test_explicit_max_model_len_over_the_budget_names_the_numbers_and_both_flags() -> None:
    with pytest.raises(ConfigError) as info:
        LLM("tiny-llama", max_model_len=100, kv_cache_memory_gb=ONE_MIB_GB, **ENGINE)
    message = str(info.value)
    assert message.startswith("max_model_len: 100 needs a KV cache of")
    assert f"at most {ONE_MIB_FITS} fits" in message and "max_num_seqs=8" in message
    assert "--max-model-len" in message and "--kv-cache-memory-gb" in message
    with LLM("tiny-llama", max_model_len=ONE_MIB_FITS, kv_cache_memory_gb=ONE_MIB_GB, **ENGINE) as llm:
        assert llm.config.max_model_len == ONE_MIB_FITS  # exactly the budget is accepted


def test_budget_too_small_for_any_request_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^kv_cache_memory_gb: .* holds a KV cache of 1 positions per slot"):
        LLM("tiny-llama", kv_cache_memory_gb=TINY_BYTES_PER_POSITION * 1.5 / GIB, **ENGINE)


def test_default_budget_is_half_of_mem_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8388608 kB\nMemFree:        1000 kB\nMemAvailable:   2097152 kB\n")
    assert default_kv_cache_memory_gb(meminfo) == 1.0
    assert 0 < default_kv_cache_memory_gb(tmp_path / "absent") < math.inf  # falls back to physical memory


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "1"])
def test_bad_kv_cache_memory_gb_names_the_field(value: object) -> None:
    with pytest.raises(ConfigError, match="^kv_cache_memory_gb: must be a positive number"):
        EngineConfig(kv_cache_memory_gb=value)  # type: ignore[arg-type]


# -- a draft model's KV cache shares the budget (speculative decoding) ------------------------------

# The one-layer draft's KV cache per position: tiny-llama's with one layer instead of four.
DRAFT_BYTES_PER_POSITION = 1 * 9 * 2 * 2 * 32 * 4


@pytest.fixture(scope="module")
def one_layer_draft(tmp_path_factory) -> dict:
    """speculative_config with a one-layer draft sharing tiny-llama's vocabulary and special ids."""
    path = write_checkpoint(
        tmp_path_factory.mktemp("draft"), dataclasses.replace(TINY_LLAMA_CONFIG, num_hidden_layers=1)
    )
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}


def test_a_draft_models_kv_cache_lowers_the_max_model_len_the_budget_holds(one_layer_draft) -> None:
    both = 2**20 // (TINY_BYTES_PER_POSITION + DRAFT_BYTES_PER_POSITION)  # 45 positions, 56 without the draft
    with LLM("tiny-llama", kv_cache_memory_gb=ONE_MIB_GB, speculative_config=one_layer_draft, **ENGINE) as llm:
        assert llm.config.max_model_len == both < ONE_MIB_FITS
        [out] = llm.generate([[5] * 40], SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0))
    assert (len(out.output_token_ids), out.finish_reason) == (both - 40, "length")


def test_a_budget_that_holds_the_target_alone_but_not_the_draft_too_is_refused_naming_both(one_layer_draft) -> None:
    fits_target = dict(max_model_len=50, kv_cache_memory_gb=ONE_MIB_GB, **ENGINE)
    LLM("tiny-llama", **fits_target).close()  # the target alone fits: the draft's cache is what overflows
    with pytest.raises(ConfigError) as info:
        LLM("tiny-llama", speculative_config=one_layer_draft, **fits_target)
    message = str(info.value)
    assert message.startswith("max_model_len: 50 needs KV caches of "), message
    assert "(the target's) + " in message and "(the draft's)" in message and "at most 45 fits" in message
    # Unset max_model_len: a budget of two positions for the target alone, one with the draft.
    tight = (2 * TINY_BYTES_PER_POSITION + DRAFT_BYTES_PER_POSITION // 2) / GIB
    with pytest.raises(ConfigError, match=r"^kv_cache_memory_gb: .* holds the KV caches of the target and the draft"):
        LLM("tiny-llama", kv_cache_memory_gb=tight, speculative_config=one_layer_draft, **ENGINE)
