"""Llama architecture config: the built-in `tiny-llama` and parsing of a local HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_async_sm.model.errors import ModelLoadError

TINY_LLAMA = "tiny-llama"
SUPPORTED_ARCHITECTURE = "LlamaForCausalLM"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "linear" (all frequencies / factor) or "llama3"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"RopeScaling.rope_type must be 'linear' or 'llama3', got {self.rope_type!r}")
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-architecture decoder (the subset this engine executes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None  # None: plain RoPE

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not isinstance(self.eos_token_ids, tuple):
            kind = type(self.eos_token_ids).__name__
            raise ValueError(f"LlamaConfig.eos_token_ids must be a tuple, got {kind}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


# Small random-weight model built in-process (no files). GQA (4 query heads share 2 KV heads) so the
# grouped attention path is exercised; untied so lm_head is a separate tensor. Its 512 positions are
# its default max_model_len, as a checkpoint's max_position_embeddings is (the engine default before
# max_model_len was derived from the model, so every tiny-llama run keeps its KV cache size).
TINY_LLAMA_CONFIG = LlamaConfig(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def load_model_config(name_or_path: str) -> LlamaConfig:
    """`tiny-llama` -> the built-in config; otherwise parse `<dir>/config.json` (never downloads)."""
    if name_or_path == TINY_LLAMA:
        return TINY_LLAMA_CONFIG
    model_dir = model_directory(name_or_path)
    raw = _read_json(model_dir / "config.json")
    architectures = raw.get("architectures") or []
    if SUPPORTED_ARCHITECTURE not in architectures:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: architectures {architectures!r} is not supported; "
            f"only {SUPPORTED_ARCHITECTURE} is"
        )
    _reject_unsupported(raw, model_dir)
    where = model_dir / "config.json"
    hidden = _require(raw, "hidden_size", where)
    heads = _require(raw, "num_attention_heads", where)
    rope_theta, rope_scaling = _parse_rope(raw, where)
    try:
        return LlamaConfig(
            vocab_size=_require(raw, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size", where),
            num_hidden_layers=_require(raw, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_token_ids(raw, model_dir),
            rope_scaling=rope_scaling,
        )
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from e


def model_directory(name_or_path: str) -> Path:
    """The local checkpoint directory named by `name_or_path`; ModelLoadError if it is not one."""
    model_dir = Path(name_or_path)
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither {TINY_LLAMA!r} nor an existing local directory "
            "(models are never downloaded)"
        )
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"model directory {model_dir} has no config.json")
    return model_dir


def tokenizer_path(name_or_path: str) -> str | None:
    """`<dir>/tokenizer.json` if the model directory has one, else None (always None for tiny-llama)."""
    if name_or_path == TINY_LLAMA:
        return None
    path = Path(name_or_path) / "tokenizer.json"
    return str(path) if path.is_file() else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _require(raw: dict[str, Any], field: str, where: Path) -> Any:
    if raw.get(field) is None:
        raise ModelLoadError(f"{where}: required field {field!r} is missing")
    return raw[field]


def _reject_unsupported(raw: dict[str, Any], model_dir: Path) -> None:
    where = model_dir / "config.json"
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; only 'silu' is")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelLoadError(f"{where}: {flag}=true is not supported")


def _parse_rope(raw: dict[str, Any], where: Path) -> tuple[float, RopeScaling | None]:
    """Reads both layouts: transformers<5 (`rope_theta` + `rope_scaling`) and >=5 (`rope_parameters`)."""
    field = "rope_scaling" if raw.get("rope_scaling") is not None else "rope_parameters"
    params = raw.get(field) or {}
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{where}: {field}.partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return float(theta), None
    try:
        if rope_type == "linear":
            return float(theta), RopeScaling("linear", float(params["factor"]))
        if rope_type == "llama3":
            return float(theta), RopeScaling(
                "llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
                ),
            )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: {field} {params!r} is malformed: {e!r}") from e
    raise ModelLoadError(f"{where}: {field} type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _eos_token_ids(raw: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids (Llama 3 lists extra ones there)."""
    ids: list[int] = []
    sources = [raw]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(_read_json(gen_path))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in [eos] if isinstance(eos, int) else (eos or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)
