"""load_model_config and checkpoint loading: supported layouts and the errors a user sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from neuron_async_sm.bench.checkpoint import write_checkpoint as write_hf_checkpoint
from neuron_async_sm.model import (
    TINY_LLAMA,
    TINY_LLAMA_CONFIG,
    ModelLoadError,
    ModelSpec,
    build_step_program,
    load_model_config,
    tokenizer_path,
)
from neuron_async_sm.model.loader import random_state_dict

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def write_checkpoint(path: Path, **overrides) -> Path:
    """config.json (CONFIG with `overrides`) + model.safetensors with random weights of the right names and shapes."""
    return write_hf_checkpoint(path, {**CONFIG, **overrides})


def build(path: Path) -> None:
    build_step_program(ModelSpec(str(path), "float32", max_num_seqs=1, max_model_len=16))


def rewrite_tensors(path: Path, edit) -> None:
    state = random_state_dict(load_model_config(str(path)), seed=0)
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def test_tiny_llama_config_is_built_in() -> None:
    config = load_model_config(TINY_LLAMA)
    assert config is TINY_LLAMA_CONFIG
    assert (config.num_key_value_heads, config.num_attention_heads, config.eos_token_ids) == (2, 4, (2,))
    assert tokenizer_path(TINY_LLAMA) is None


def test_config_defaults_and_eos_lists(tmp_path: Path) -> None:
    fields = {k: v for k, v in CONFIG.items() if k not in ("num_key_value_heads", "eos_token_id")}
    write_checkpoint(tmp_path, **fields)
    (tmp_path / "config.json").write_text(json.dumps({**fields, "eos_token_id": [2, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = load_model_config(str(tmp_path))
    assert config.head_dim == 8 and config.num_key_value_heads == 4
    assert config.eos_token_ids == (2, 7, 9)


def test_rope_scaling_layouts(tmp_path: Path) -> None:
    llama3 = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    write_checkpoint(tmp_path / "old", rope_scaling=llama3, rope_theta=500000.0)
    write_checkpoint(tmp_path / "new", rope_parameters={**llama3, "rope_theta": 500000.0}, rope_theta=None)
    write_checkpoint(tmp_path / "default", rope_scaling={"rope_type": "default"})
    old, new = load_model_config(str(tmp_path / "old")), load_model_config(str(tmp_path / "new"))
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling.factor == 8.0
    assert load_model_config(str(tmp_path / "default")).rope_scaling is None
    (tmp_path / "yarn").mkdir()
    (tmp_path / "yarn" / "config.json").write_text(json.dumps({**CONFIG, "rope_scaling": {"type": "yarn"}}))
    with pytest.raises(ModelLoadError, match="rope_scaling type 'yarn'"):
        load_model_config(str(tmp_path / "yarn"))


def test_tokenizer_path_found_next_to_config(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    assert tokenizer_path(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_path(str(tmp_path)) == str(tmp_path / "tokenizer.json")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nowhere"):
        build(tmp_path / "nowhere")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        build(tmp_path)


def test_directory_without_checkpoint_names_files_looked_for(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as error:
        build(tmp_path)
    assert str(tmp_path) in str(error.value)
    assert "model.safetensors" in str(error.value) and "pytorch_model.bin" in str(error.value)


def test_wrong_architecture_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="MistralForCausalLM"):
        build(tmp_path)


def test_unsupported_activation_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "hidden_act": "gelu"}))
    with pytest.raises(ModelLoadError, match="gelu"):
        build(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    rewrite_tensors(tmp_path, lambda state: state.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        build(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    extra = {"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}
    rewrite_tensors(tmp_path, lambda state: state.update(extra))
    with pytest.raises(ModelLoadError, match=r"unexpected .*q_norm"):
        build(tmp_path)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    rewrite_tensors(tmp_path, lambda state: state.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \(31,\)"):
        build(tmp_path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors"):
        build(tmp_path)


def test_handwritten_checkpoint_loads(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tie_word_embeddings=True)
    build(tmp_path)
