"""A real Llama decoder as the device's compiled program, its HF checkpoint loader, and on-device sampling."""

from neuron_async_sm.model.config import (
    TINY_LLAMA,
    TINY_LLAMA_CONFIG,
    LlamaConfig,
    RopeScaling,
    load_model_config,
    tokenizer_path,
)
from neuron_async_sm.model.errors import ModelLoadError
from neuron_async_sm.model.kv_cache import kv_cache_bytes
from neuron_async_sm.model.program import StepProgram, build_step_program
from neuron_async_sm.model.sampler import sample_tokens
from neuron_async_sm.model.spec import ModelSpec

__all__ = [
    "TINY_LLAMA",
    "TINY_LLAMA_CONFIG",
    "LlamaConfig",
    "ModelLoadError",
    "ModelSpec",
    "RopeScaling",
    "StepProgram",
    "build_step_program",
    "kv_cache_bytes",
    "load_model_config",
    "sample_tokens",
    "tokenizer_path",
]
