"""Engine configuration: one frozen dataclass, validated once at construction.

Every error names the field that is wrong, so a user can act on it. Nothing deeper in the
engine reads environment variables or re-validates.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.values import is_int, is_number

logger = logging.getLogger(__name__)

DEVICES = ("cpu", "cpu-inprocess", "xla", "accelerator", "cuda")
"""`cpu`: the emulated Neuron device as a separate process (true host/device overlap).
`cpu-inprocess`: the same runtime with the device loop on a thread (fast unit tests; overlaps poorly).
`xla`: PyTorch/XLA (PJRT; needs torch_xla, see docs/backends.md). `accelerator`: torch.accelerator's
device and streams (synchronous on a machine without one); `cuda`: the same, requiring CUDA."""

DTYPES = ("float32", "float64", "bfloat16")

EXECUTOR_BACKENDS = ("mp", "ray")
"""`mp`: each rank's device process is spawned by this process (multiprocessing). `ray`: each is a Ray
actor in a placement group (the `ray` extra), on the cluster at RAY_ADDRESS or a local Ray instance."""


class ConfigError(NeuronAsyncSMError, ValueError):
    """An invalid engine configuration; the message names the field."""


def flag(default: Any, help: str, **argparse_options: Any) -> Any:
    """A field that is also an engine flag of the command line (`--max-num-seqs` for `max_num_seqs`).

    `help` is the flag's help; `argparse_options` may give `choices`, `metavar`, and `name` for a flag
    spelt otherwise. Type and default come from the field (`neuron_async_sm/args.py` builds the flags).
    """
    return field(default=default, metadata={"help": help, **argparse_options})


SPEC_METHODS = ("ngram", "draft_model")
"""Implemented drafters (docs/spec-decode.md §1)."""
MAX_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """k drafts per decode row, proposed by `method`, verified by the target in the same step."""

    method: str = "ngram"
    num_speculative_tokens: int = 1  # k
    prompt_lookup_max: int = 4  # ngram: longest suffix matched
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    # draft_model: a local Llama checkpoint directory sharing the target's vocabulary and special ids
    # (checked against the target when the engine starts: engine/core.py's check_draft_model).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"speculative_config.method: {self.method!r} is not supported; choose one of {SPEC_METHODS}"
            )
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(
                f"speculative_config.model: method 'draft_model' needs a checkpoint directory, got {self.model!r}"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"speculative_config.model: only method 'draft_model' takes a model, not {self.method!r}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "speculative_config.num_speculative_tokens: must be an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"speculative_config.{name}: must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def width(self) -> int:
        """Tokens a spec row computes and at most emits: the last accepted token's successor and k more."""
        return 1 + self.num_speculative_tokens

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """A SpeculativeConfig from JSON text, a dict or itself."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config: not a JSON object: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config: expected a JSON object, got {value!r}")
        if value.get("method", cls.method) not in SPEC_METHODS:
            cls(method=value["method"])  # raises, naming the method (before its keys are judged)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]}: not supported; known keys: {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine. Built once, validated in `__post_init__`."""

    model: str = flag("tiny-llama", "'tiny-llama' or a local Hugging Face Llama checkpoint dir")
    device: str = flag("cpu", "cpu: emulated Neuron device process", choices=DEVICES)
    dtype: str = flag("float32", "weights, activations and KV cache", choices=DTYPES)
    async_scheduling: bool = flag(True, "overlap host work with device execution")
    # Async mode: a step whose batch changed builds its input ids on the device from the previous
    # step's sampled-token future by a row map (the Relay path) instead of breaking the async flow.
    # False: the design's CompositionBreak / ShapeMismatchRebuild / ReorderRemap, counter for counter.
    async_relay: bool = flag(
        True,
        "async mode: when the batch changes, build input ids on the device from the previous step's "
        "sampled tokens instead of breaking the async flow",
    )
    # Async scheduling feeds the sampled-token future straight into the next program, so the
    # tokens must be sampled inside the program (on device). The design requires it.
    on_device_sampling: bool = True
    # Run the forward op by op (vLLM's name). False: torch.compile one graph per padded input shape
    # (every decode bucket and prefill shape), all at start-up. Not consistently faster on this
    # 2-core host for tiny-llama (0.62-1.49x by batch) and minutes to build, so eager is the default
    # (docs/benchmarks.md, "Compiled programs per bucket").
    enforce_eager: bool = flag(
        True, "run the model op by op; --no-enforce-eager compiles one program per bucket at start-up"
    )
    max_num_seqs: int = flag(8, "requests running at once")
    # Positions per request (prompt + output). None: the model's max_position_embeddings, reduced to
    # fit kv_cache_memory_gb. EngineCore resolves it once; every reader after that sees an int.
    max_model_len: int | None = flag(
        None,
        "positions per request (default: the model's max_position_embeddings, reduced to fit the KV cache budget)",
    )
    # The KV cache's memory budget in GiB. None: half the memory available when the engine starts
    # (MemAvailable), leaving the rest to the weights, activations and other processes.
    kv_cache_memory_gb: float | None = flag(
        None, "KV cache memory budget in GiB (default: half the memory available at start)"
    )
    max_num_batched_tokens: int = flag(256, "token budget")  # per step: prefill chunks + decodes
    decode_buckets: tuple[int, ...] = flag((1, 2, 4, 8), "e.g. 1,2,4,8")  # padded decode batch sizes
    # padded per-row prefill token lengths
    prefill_buckets: tuple[int, ...] = flag((16, 32, 64, 128, 256), "e.g. 16,32,64,128,256")
    seed: int = flag(0, "tiny-llama weights; seeds of unseeded requests")
    # The most top tokens a request's logprobs / prompt_logprobs may ask for (vLLM's --max-logprobs;
    # its -1, the whole vocabulary, is not offered: the top-N are computed on the device every step).
    max_logprobs: int = flag(20, "the most logprobs (top tokens per position) a request may ask for")
    # Off: such a request is refused naming its field, and a compiling device (xla) does not compile
    # the program variant that serves them at start-up (engine/warmup.py), which halves its warm-up.
    sampling_extras: bool = flag(
        True, "take requests with penalties, logit_bias, min_tokens, min_p or logprobs (off: start faster on xla)"
    )
    # unfinished programs on the device before enqueue blocks (Neuron worker default)
    runtime_queue_depth: int = flag(32, "programs in flight")
    # emulated accelerator: hold each program at least this long
    device_time_ms: float = flag(0.0, "emulated program time")
    # A device that completes nothing for this long while work is in flight is hung: killed, every
    # in-flight request ends with DeviceHungError, the engine is dead. 0 disables (waits are unbounded).
    device_timeout_s: float = flag(120.0, "hung if no progress (0: off)")
    # A device not ready this long after it was started (loading the model, warm-up) is killed and
    # start-up fails with DeviceStartupError. 0 disables (start-up may then wait forever).
    device_startup_timeout_s: float = flag(
        600.0, "fail if the device is not ready (model loaded, warmed up) within this long (0: off)"
    )
    device_threads: int = 1  # torch intra-op threads inside the emulated device process
    # The CPU the emulated device process owns (as an accelerator has its own silicon); the engine's
    # own threads keep off it. None: no pinning. Matters on a busy machine with few cores.
    device_cpu: int | None = None
    stats_log_interval_s: float = 10.0
    # Ranks the model is split over (tensor parallelism): one device process each, holding its shard
    # of the weights and of the KV cache. The model's heads, KV heads and intermediate size must divide.
    tensor_parallel_size: int = flag(1, "ranks the model is split over, one device process each")
    distributed_executor_backend: str = flag("mp", "how the ranks' device processes run", choices=EXECUTOR_BACKENDS)
    # NDJSON trace of machine transitions and materializations
    trace_path: str | None = flag(None, "write machine transitions", name="--trace", metavar="FILE.ndjson")
    # Speculative decoding (docs/spec-decode.md): a SpeculativeConfig, its dict or its JSON text
    # (normalized to a SpeculativeConfig). None: off.
    speculative_config: SpeculativeConfig | None = flag(
        None,
        'speculative decoding, as vLLM takes it: e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
        metavar="JSON",
        parse=str,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_buckets", _buckets("decode_buckets", self.decode_buckets))
        object.__setattr__(self, "prefill_buckets", _buckets("prefill_buckets", self.prefill_buckets))
        if self.device not in DEVICES:
            raise ConfigError(f"device: unknown device {self.device!r}; choose one of {', '.join(map(repr, DEVICES))}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory_gb is not None:
            _positive_number("kv_cache_memory_gb", self.kv_cache_memory_gb)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("runtime_queue_depth", self.runtime_queue_depth)
        if not is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs: must be an integer >= 0, got {self.max_logprobs!r}")
        if not isinstance(self.sampling_extras, bool):
            raise ConfigError(f"sampling_extras: must be True or False, got {self.sampling_extras!r}")
        _positive("device_threads", self.device_threads)
        if self.device_cpu is not None:
            _device_cpu(self.device_cpu, self.device)
        if not is_number(self.device_time_ms):
            raise ConfigError(f"device_time_ms: must be a number, got {self.device_time_ms!r}")
        if not self.device_time_ms >= 0:  # also rejects NaN
            raise ConfigError(f"device_time_ms: must be >= 0, got {self.device_time_ms}")
        if not is_number(self.device_timeout_s):
            raise ConfigError(f"device_timeout_s: must be a number of seconds, got {self.device_timeout_s!r}")
        if not 0 <= self.device_timeout_s < float("inf"):  # also rejects NaN
            raise ConfigError(f"device_timeout_s: must be >= 0 and finite (0 disables), got {self.device_timeout_s}")
        if not is_number(self.device_startup_timeout_s):
            raise ConfigError(
                f"device_startup_timeout_s: must be a number of seconds, got {self.device_startup_timeout_s!r}"
            )
        if not 0 <= self.device_startup_timeout_s < float("inf"):  # also rejects NaN
            raise ConfigError(
                f"device_startup_timeout_s: must be >= 0 and finite (0 disables), got {self.device_startup_timeout_s}"
            )
        if max(self.decode_buckets) < self.max_num_seqs:
            raise ConfigError(
                f"decode_buckets: largest bucket {max(self.decode_buckets)} does not cover "
                f"max_num_seqs={self.max_num_seqs}; add a bucket >= {self.max_num_seqs}"
            )
        if max(self.prefill_buckets) < self.max_num_batched_tokens:
            raise ConfigError(
                f"prefill_buckets: largest bucket {max(self.prefill_buckets)} does not cover "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager: must be True or False, got {self.enforce_eager!r}")
        if not self.enforce_eager and self.device == "xla":
            raise ConfigError("enforce_eager: False compiles with torch.compile; XLA compiles its own graphs")
        if self.async_scheduling and not self.on_device_sampling:
            raise ConfigError(
                "async_scheduling: requires on_device_sampling (the sampled-token future feeds the "
                "next program); pass --no-async-scheduling to sample on the host"
            )
        _tensor_parallel(self)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
            # n-gram drafts need every accepted token on the host: every step with a pending future
            # materializes it first (HostDraftBreak), so there is nothing for the relay to build on
            # the device (docs/spec-decode.md §6). draft_model: a relay of next_input's rows by request
            # id is not built; a composition change materializes (CompositionBreak).
            if self.async_scheduling and self.async_relay:
                logger.warning(
                    "async_relay: off with speculative_config (method %r): the relay does not build "
                    "speculative inputs, so a step whose rows change materializes the step in flight first",
                    self.speculative_config.method,
                )
            object.__setattr__(self, "async_relay", False)
            _speculation(self)

    def decode_bucket(self, num_rows: int) -> int:
        """Smallest decode bucket that holds `num_rows` rows."""
        return _bucket(self.decode_buckets, num_rows, "decode_buckets")

    def prefill_bucket(self, num_tokens: int) -> int:
        """Smallest prefill bucket that holds a row of `num_tokens` tokens."""
        return _bucket(self.prefill_buckets, num_tokens, "prefill_buckets")


def _bucket(buckets: tuple[int, ...], n: int, name: str) -> int:
    for size in buckets:
        if size >= n:
            return size
    raise ConfigError(f"{name}: no bucket holds {n}")


def _device_cpu(cpu: object, device: str) -> None:
    if device != "cpu":
        raise ConfigError(f"device_cpu: pinning needs the device process (device='cpu'), got device={device!r}")
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("device_cpu: this platform cannot pin a process to a CPU")
    cpus = os.cpu_count() or 1
    if not is_int(cpu) or not 0 <= cpu < cpus:
        raise ConfigError(f"device_cpu: must be a CPU number in [0, {cpus}), got {cpu!r}")
    if cpus < 2:
        raise ConfigError("device_cpu: the host needs a CPU besides the device's; this machine has one")


def _tensor_parallel(config: EngineConfig) -> None:
    _positive("tensor_parallel_size", config.tensor_parallel_size)
    backend = config.distributed_executor_backend
    if backend not in EXECUTOR_BACKENDS:
        raise ConfigError(
            f"distributed_executor_backend: unknown backend {backend!r}; choose one of {', '.join(EXECUTOR_BACKENDS)}"
        )
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("distributed_executor_backend: 'ray' needs Ray: pip install -e '.[ray]'")
    if config.tensor_parallel_size == 1 and backend == "mp":
        return
    if backend == "ray" and config.device != "cpu":
        raise ConfigError(
            f"distributed_executor_backend: 'ray' runs the device process (device='cpu'), got {config.device!r}"
        )
    if config.device != "cpu":
        raise ConfigError(
            f"tensor_parallel_size: {config.tensor_parallel_size} ranks need the device process "
            f"(device='cpu'), got device={config.device!r}"
        )
    if config.device_cpu is not None:
        raise ConfigError("device_cpu: pins one device process; with tensor_parallel_size > 1 leave it unset")
    if not config.enforce_eager:
        raise ConfigError(
            "enforce_eager: a tensor-parallel rank's program runs eagerly (its collectives are not compiled); "
            "drop --no-enforce-eager or use tensor_parallel_size 1"
        )


def _speculation(config: EngineConfig) -> None:
    """What speculative decoding does not run with yet, refused by name (docs/spec-decode.md §9)."""
    if not config.on_device_sampling:
        raise ConfigError("speculative_config: verification samples on the device; needs on_device_sampling")
    if not config.enforce_eager:
        raise ConfigError(
            "speculative_config: the verification program is not compiled with torch.compile (enforce_eager) for now"
        )
    width = config.speculative_config.width
    if config.max_num_batched_tokens < width:  # a spec row is scheduled whole (scheduler._spec_row)
        raise ConfigError(
            f"max_num_batched_tokens: a spec row computes 1 + num_speculative_tokens = {width} tokens in one "
            f"step, more than max_num_batched_tokens={config.max_num_batched_tokens}"
        )


def _positive(name: str, value: int) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")


def _positive_number(name: str, value: object) -> None:
    if not is_number(value) or not 0 < value < math.inf:  # also NaN
        raise ConfigError(f"{name}: must be a positive number, got {value!r}")


def _buckets(name: str, sizes: object) -> tuple[int, ...]:
    """Sorted, deduplicated bucket sizes; ConfigError unless a non-empty collection of positive integers."""
    ok = isinstance(sizes, (tuple, list, set, frozenset))
    ok = ok and bool(sizes) and all(is_int(s) and s >= 1 for s in sizes)
    if not ok:
        raise ConfigError(f"{name}: need a non-empty list of positive integer sizes, got {sizes!r}")
    return tuple(sorted(set(sizes)))  # type: ignore[arg-type]
