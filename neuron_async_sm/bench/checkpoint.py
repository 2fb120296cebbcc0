"""Hugging Face checkpoints for the benchmark, written from our own seeded random weights.

`tiny-llama` is built in memory; saved with `write_checkpoint(dir, TINY_LLAMA_CONFIG)` it becomes a
directory that both our loader and `transformers.LlamaForCausalLM.from_pretrained` read, with the same
weights on both sides. `MICRO_LLAMA_CONFIG` is a one-layer model whose program is a fraction of a
millisecond, so `--device-time-ms` alone sets the device time of the D/C sweep. `SPEC_TARGET_CONFIG`
is the speculative-decoding benchmark's target, large enough that its compute, not the fixed cost of
a pass, sets a step's time (`write_spec_checkpoints`: it and its drafts; `bench spec-checkpoints`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from neuron_async_sm.model import TINY_LLAMA_CONFIG, LlamaConfig, load_model_config
from neuron_async_sm.model.loader import random_state_dict

MICRO_LLAMA_CONFIG = replace(
    TINY_LLAMA_CONFIG,
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)

# ~25 M parameters (8 layers of hidden 512): its compute, not a pass's fixed cost, sets a step's time.
SPEC_TARGET_CONFIG = replace(
    TINY_LLAMA_CONFIG,
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
)
SPEC_LAYER_SCALE = 0.01  # the target's layers add little to the residual stream: its first layer alone predicts it
SPEC_DRAFT_NOISE = {"high": 0.0, "low": 0.15}  # noise of each draft (its first layer), in weight std
SPEC_K = 4  # drafts per row in the commands `bench spec-checkpoints` prints


def hf_config(config: LlamaConfig) -> dict:
    """config.json for a LlamaForCausalLM with this architecture (float32 weights)."""
    if config.rope_scaling is not None:
        raise ValueError("hf_config: rope scaling is not written by the benchmark")
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }


def write_checkpoint(
    directory: str | Path, config: LlamaConfig | dict = TINY_LLAMA_CONFIG, seed: int = 0, layer_scale: float = 1.0
) -> Path:
    """config.json + model.safetensors holding the random weights `tiny-llama` builds from `seed`.

    `config`: a LlamaConfig (written as `hf_config` spells it), or a raw config.json dict, any fields
    as Hugging Face spells them (rope scaling, legacy keys); the weights then follow the config as
    our loader reads it back. `layer_scale` multiplies every layer's o_proj and down_proj: below 1
    the layers add less to the residual stream, so the next token depends mostly on the current one
    (near a bigram model, whose greedy output soon repeats a cycle: n-gram drafts are then accepted),
    while attention over the context still moves the logits.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    raw = hf_config(config) if isinstance(config, LlamaConfig) else config
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    model = config if isinstance(config, LlamaConfig) else load_model_config(str(path))
    weights = random_state_dict(model, seed)
    if layer_scale != 1.0:
        for name in weights:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * layer_scale
    save_file(weights, str(path / "model.safetensors"))
    return path


def write_noisy_copy(
    source: str | Path, directory: str | Path, noise: float, seed: int = 0, num_layers: int | None = None
) -> Path:
    """A draft checkpoint for speculative decoding: `source`'s config and weights, each weight plus
    Gaussian noise of `noise` times that weight's standard deviation (seeded); with `num_layers`, only
    the first that many layers (a cheaper draft). Same vocabulary and special ids as `source`; the
    smaller `noise` (and the less the dropped layers add), the more often its greedy tokens agree."""
    source, path = Path(source), Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generator = torch.Generator().manual_seed(seed)
    noisy = {}
    for name, weight in sorted(load_file(str(source / "model.safetensors")).items()):
        parts = name.split(".")
        if num_layers is not None and "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
            continue
        scale = noise * float(weight.double().std()) if weight.numel() > 1 else 0.0
        noisy[name] = weight + scale * torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
    save_file(noisy, str(path / "model.safetensors"))
    return path


def write_spec_checkpoints(directory: str | Path) -> dict[str, Path]:
    """The speculative-decoding benchmark's checkpoints under `directory`: "target" (SPEC_TARGET_CONFIG,
    its layers scaled by SPEC_LAYER_SCALE) and one draft per acceptance setting, "draft-high" and
    "draft-low": the target's first layer alone (one of its eight), plus SPEC_DRAFT_NOISE."""
    path = Path(directory)
    target = write_checkpoint(path / "target", SPEC_TARGET_CONFIG, layer_scale=SPEC_LAYER_SCALE)
    drafts = {
        f"draft-{setting}": write_noisy_copy(target, path / f"draft-{setting}", noise, num_layers=1)
        for setting, noise in SPEC_DRAFT_NOISE.items()
    }
    return {"target": target, **drafts}
