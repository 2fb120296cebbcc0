"""Our EngineConfig from vLLM's configuration, and the plugin's own options. Imports nothing from vLLM.

vLLM's fields decide everything vLLM also decides (model, dtype, max_num_seqs, max_model_len, the
token budget, async scheduling, tensor parallelism, the seed); what only our worker has (which device
runtime, the relay, the trace, buckets) comes from vLLM's `additional_config` under the key
`neuron_async_sm`, e.g. `--additional-config '{"neuron_async_sm": {"trace_path": "t.ndjson"}}'`.
Plugin settings are not environment variables: vLLM warns about unknown `VLLM_*` ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from neuron_async_sm.config import ConfigError, EngineConfig, SpeculativeConfig

OPTIONS_KEY = "neuron_async_sm"  # additional_config[OPTIONS_KEY] holds PluginOptions' fields
MIN_PREFILL_BUCKET = 16

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
# vLLM's speculative methods our worker runs: n-gram drafts from the host's history (vLLM runs it
# synchronous), a draft Llama in our device program (synchronous or async, drafts on the device).
SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class PluginOptions:
    """What only our worker has; each field is EngineConfig's field of the same name."""

    device: str = "cpu"  # the emulated device process; "cpu-inprocess": a thread; "xla" where present
    async_relay: bool = True
    trace_path: str | None = None  # our NDJSON trace (tensor parallel: the output rank's)
    device_time_ms: float = 0.0
    device_timeout_s: float = 120.0
    decode_buckets: tuple[int, ...] | None = None  # None: powers of two up to max_num_seqs
    prefill_buckets: tuple[int, ...] | None = None  # None: powers of two from 16 up to the token budget

    @classmethod
    def of(cls, additional_config: object) -> PluginOptions:
        """The options in vLLM's `additional_config`; ConfigError names an unknown or mistyped key."""
        raw = additional_config.get(OPTIONS_KEY, {}) if isinstance(additional_config, Mapping) else {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"additional_config.{OPTIONS_KEY}: must be an object, got {raw!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"additional_config.{OPTIONS_KEY}.{unknown[0]}: unknown option; known: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = dict(raw)
        for name in ("decode_buckets", "prefill_buckets"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        return cls(**values)


def powers_of_two(start: int, cover: int) -> tuple[int, ...]:
    """start, 2*start, ... up to the first one >= cover."""
    sizes = [start]
    while sizes[-1] < cover:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def engine_config(vllm_config: Any, options: PluginOptions, *, rank: int) -> EngineConfig:
    """Our worker's EngineConfig for one rank of a vLLM engine (validated by EngineConfig itself)."""
    model = vllm_config.model_config
    scheduler = vllm_config.scheduler_config
    dtype = DTYPE_NAMES.get(model.dtype)
    if dtype is None:
        raise ConfigError(f"dtype: {model.dtype} is not supported; choose one of {', '.join(DTYPE_NAMES.values())}")
    max_num_seqs = scheduler.max_num_seqs
    budget = scheduler.max_num_batched_tokens
    return EngineConfig(
        model=model.model,
        device=options.device,
        dtype=dtype,
        async_scheduling=bool(scheduler.async_scheduling),
        max_num_seqs=max_num_seqs,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=budget,
        decode_buckets=options.decode_buckets or powers_of_two(1, max_num_seqs),
        prefill_buckets=options.prefill_buckets or powers_of_two(MIN_PREFILL_BUCKET, budget),
        seed=model.seed or 0,
        device_time_ms=options.device_time_ms,
        device_timeout_s=options.device_timeout_s,
        trace_path=options.trace_path if rank == 0 else None,  # the output rank's alone, as in our engine
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        speculative_config=speculative_config(vllm_config.speculative_config),
        # the relay does not build speculative inputs: our config turns it off (with a warning if asked)
        async_relay=options.async_relay and vllm_config.speculative_config is None,
    )


def speculative_config(spec: Any) -> SpeculativeConfig | None:
    """Our SpeculativeConfig from vLLM's (None: no speculation). vLLM has resolved its defaults (n-gram's
    prompt_lookup_min/max: 5 and 5 when neither is given); a method we do not run is refused by name."""
    if spec is None:
        return None
    if spec.method not in SPEC_METHODS:
        raise ConfigError(
            f"speculative_config.method: {spec.method!r} is not supported by this plugin; choose one of {SPEC_METHODS}"
        )
    if spec.method == "ngram":
        return SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=spec.num_speculative_tokens,
            prompt_lookup_max=spec.prompt_lookup_max,
            prompt_lookup_min=spec.prompt_lookup_min,
        )
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=spec.num_speculative_tokens, model=spec.model)
