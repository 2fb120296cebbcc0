"""max_model_len from the model: its max_position_embeddings, reduced to fit the KV cache budget.

`resolve_model_len` runs once in `EngineCore.__init__`, after the model's config is read and before
anything else reads `EngineConfig.max_model_len`; the config it returns is the one the scheduler, the
runner, the trace header and `LLM.config` see. With a draft model (speculative decoding) the budget
holds both KV caches: the draft's has the target's slots and positions, its own layers and heads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from neuron_async_sm.config import ConfigError, EngineConfig
from neuron_async_sm.model import LlamaConfig, kv_cache_bytes
from neuron_async_sm.model.spec import TORCH_DTYPES

logger = logging.getLogger("neuron_async_sm")

GIB = 2**30
DEFAULT_KV_CACHE_MEMORY_SHARE = 0.5  # of the memory available at start; the rest: weights, activations, others
MIN_MODEL_LEN = 2  # a one-token prompt and one output token


def default_kv_cache_memory_gb(meminfo: Path = Path("/proc/meminfo")) -> float:
    """Half of the memory the kernel says is available without swapping (MemAvailable), in GiB.

    Where there is no /proc/meminfo, half of the physical memory. The device process holds the KV
    cache next to the weights, and the machine may be shared: a share of what is free, not of the total.
    """
    available = _mem_available_bytes(meminfo)
    if available is None:
        try:
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            raise ConfigError(
                "kv_cache_memory_gb: cannot read this machine's memory size; pass --kv-cache-memory-gb"
            ) from None
    return DEFAULT_KV_CACHE_MEMORY_SHARE * available / GIB


def resolve_model_len(config: EngineConfig, model: LlamaConfig, draft: LlamaConfig | None = None) -> EngineConfig:
    """`config` with `max_model_len` and `kv_cache_memory_gb` decided; ConfigError naming the numbers.

    Unset max_model_len: the model's max_position_embeddings, or the most positions whose KV cache fits
    the budget if that is fewer (a WARNING says so). Set: an error if it exceeds the model's limit or
    its KV cache does not fit the budget. `draft`: the draft model's config, whose KV cache (the same
    slots and positions) shares the budget; the errors then name both caches, and the draft's
    max_position_embeddings must hold max_model_len too.
    """
    budget_gb = config.kv_cache_memory_gb
    budget_source = "--kv-cache-memory-gb"
    if budget_gb is None:
        budget_gb = default_kv_cache_memory_gb()
        budget_source = f"--kv-cache-memory-gb (default: {DEFAULT_KV_CACHE_MEMORY_SHARE:.0%} of available memory)"
    dtype = TORCH_DTYPES[config.dtype]
    per_model = [kv_cache_bytes(m, config.max_num_seqs, 1, dtype) for m in (model, draft) if m is not None]
    per_position = sum(per_model)  # over every slot, K and V, of each cache
    fits = int(budget_gb * GIB) // per_position  # the most positions per slot the budget holds
    limit = model.max_position_embeddings
    slots = f"max_num_seqs={config.max_num_seqs} + 1 scratch slot"
    caches = "the KV cache" if draft is None else "the KV caches of the target and the draft model"
    if config.max_model_len is None:
        if fits >= limit:
            chosen = limit
            logger.info("max_model_len=%d (the model's max_position_embeddings)", chosen)
        elif fits >= MIN_MODEL_LEN:
            chosen = fits
            logger.warning(
                "max_model_len=%d, reduced from the model's max_position_embeddings %d to fit %s %.3g "
                "(%s for %s, %s); pass a larger --kv-cache-memory-gb or a smaller --max-num-seqs "
                "for more",
                chosen,
                limit,
                budget_source,
                budget_gb,
                caches,
                slots,
                config.dtype,
            )
        else:
            holds = f"a KV cache of {fits}" if draft is None else f"{caches} for {fits}"
            raise ConfigError(
                f"kv_cache_memory_gb: {budget_gb:.3g} GiB holds {holds} positions per slot "
                f"({slots}, {per_position} bytes per position{_split(per_model)}); at least {MIN_MODEL_LEN} "
                "are needed: raise --kv-cache-memory-gb or lower --max-num-seqs"
            )
    else:
        chosen = config.max_model_len
        if chosen > limit:
            raise ConfigError(
                f"max_model_len: {chosen} exceeds the model's max_position_embeddings ({limit}); "
                "lower --max-model-len or leave it unset to use the model's limit"
            )
        if chosen > fits:
            gib = [f"{chosen * n / GIB:.3g} GiB" for n in per_model]
            needs = f"a KV cache of {gib[0]}"
            if draft is not None:
                needs = f"KV caches of {gib[0]} (the target's) + {gib[1]} (the draft's)"
            raise ConfigError(
                f"max_model_len: {chosen} needs {needs} ({slots}, {config.dtype}), "
                f"more than {budget_source} {budget_gb:.3g}; lower --max-model-len (at most {fits} fits) "
                "or raise --kv-cache-memory-gb"
            )
        logger.info("max_model_len=%d (--max-model-len)", chosen)
    if draft is not None and draft.max_position_embeddings < chosen:
        raise ConfigError(
            f"speculative_config.model: the draft's max_position_embeddings ({draft.max_position_embeddings}) "
            f"is below max_model_len ({chosen})"
        )
    return dataclasses.replace(config, max_model_len=chosen, kv_cache_memory_gb=budget_gb)


def _split(per_model: list[int]) -> str:
    """`: the target's T, the draft's D` where two caches share the budget."""
    return "" if len(per_model) == 1 else f": the target's {per_model[0]}, the draft's {per_model[1]}"


def _mem_available_bytes(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # reported in kB
    return None
