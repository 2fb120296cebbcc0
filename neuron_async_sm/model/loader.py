"""Weights: tiny-llama's seeded random init, or a local HF checkpoint (safetensors, sharded, or .bin)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from neuron_async_sm.model.config import TINY_LLAMA, LlamaConfig, model_directory
from neuron_async_sm.model.errors import ModelLoadError
from neuron_async_sm.model.llama import LayerWeights, LlamaWeights

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
PYTORCH_BIN_INDEX = "pytorch_model.bin.index.json"
CHECKPOINT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH_BIN, PYTORCH_BIN_INDEX)

# Non-weight buffers some older checkpoints carry; recomputed here, so dropped silently.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def load_weights(name_or_path: str, config: LlamaConfig, dtype: torch.dtype, seed: int = 0) -> LlamaWeights:
    """tiny-llama -> seeded random weights; otherwise the checkpoint in the local directory."""
    if name_or_path == TINY_LLAMA:
        return assemble_weights(random_state_dict(config, seed), config, dtype, where=TINY_LLAMA)
    model_dir = model_directory(name_or_path)
    return assemble_weights(read_state_dict(model_dir), config, dtype, where=str(model_dir))


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor a LlamaForCausalLM checkpoint must hold."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    layer_shapes = [(h,), (q, h), (kv, h), (kv, h), (h, q), (h,), (i, h), (i, h), (h, i)]
    per_layer = dict(zip(_LAYER_TENSORS, layer_shapes, strict=True))
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_state_dict(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights in HF layout (float32). Norm weights are 1, everything else normal.

    Std 0.02 everywhere except: embeddings at 1.0 (so the token identity survives next to the layer
    outputs) and q/k at a larger std so attention is not uniform averaging. Without this a random model
    greedy-decodes into short repetition loops that hide scheduling bugs.
    """
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():  # dict order is fixed, so the draw order is too
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
            continue
        std = 1.0 if name == "model.embed_tokens.weight" else _init_std(name, shape)
        state[name] = torch.randn(shape, generator=generator) * std
    return state


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    fan_in = shape[-1]
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 2.0 / fan_in**0.5
    if name == "lm_head.weight":
        return 4.0 / fan_in**0.5
    return 1.0 / fan_in**0.5


def checkpoint_path(model_dir: Path) -> Path:
    """The checkpoint file (or shard index) in `model_dir`. Prefers safetensors over .bin.

    Cheap: the host calls it before starting the device, so a missing checkpoint is a clear error.
    """
    for name in (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH_BIN_INDEX, PYTORCH_BIN):
        if (model_dir / name).is_file():
            return model_dir / name
    raise ModelLoadError(f"model directory {model_dir} has no checkpoint: looked for {', '.join(CHECKPOINT_FILES)}")


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `model_dir`, by HF name."""
    path = checkpoint_path(model_dir)
    if path.name in (SAFETENSORS_INDEX, PYTORCH_BIN_INDEX):
        return _load_sharded(model_dir, path.name)
    return _load_file(path)


def _load_sharded(model_dir: Path, index_name: str) -> dict[str, torch.Tensor]:
    index_path = model_dir / index_name
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read weight_map from {index_path}: {e}") from e
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = model_dir / shard
        if not shard_path.is_file():
            raise ModelLoadError(f"{index_path} names shard {shard}, which is missing from {model_dir}")
        state.update(_load_file(shard_path))
    return state


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, SafetensorError, ValueError) as e:
        raise ModelLoadError(f"cannot read checkpoint file {path}: {e}") from e


def assemble_weights(
    state: dict[str, torch.Tensor], config: LlamaConfig, dtype: torch.dtype, where: str
) -> LlamaWeights:
    """Checks names and shapes against the config, casts to `dtype`, fuses q/k/v and gate/up."""
    shapes = expected_shapes(config)
    present = {name for name in state if not name.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        # Some tied checkpoints still store lm_head; the embedding wins, as in HF.
        present.discard("lm_head.weight")
    missing = sorted(shapes.keys() - present)
    unexpected = sorted(present - shapes.keys())
    if missing:
        raise ModelLoadError(f"{where}: checkpoint is missing {len(missing)} tensor(s): {_preview(missing)}")
    if unexpected:
        raise ModelLoadError(f"{where}: checkpoint has {len(unexpected)} unexpected tensor(s): {_preview(unexpected)}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise ModelLoadError(
                f"{where}: tensor {name} has shape {tuple(state[name].shape)}, config.json implies {shape}"
            )

    def get(name: str) -> torch.Tensor:
        return state[name].to(dtype).contiguous()

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        return LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            qkv_proj=torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            o_proj=get(p + "self_attn.o_proj.weight"),
            post_attention_norm=get(p + "post_attention_layernorm.weight"),
            gate_up_proj=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            down_proj=get(p + "mlp.down_proj.weight"),
        )

    embed = get("model.embed_tokens.weight")
    return LlamaWeights(
        embed_tokens=embed,
        layers=tuple(layer(i) for i in range(config.num_hidden_layers)),
        norm=get("model.norm.weight"),
        lm_head=embed if config.tie_word_embeddings else get("lm_head.weight"),
    )


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"
