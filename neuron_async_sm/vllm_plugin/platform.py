"""Our vLLM platform: configuration checks, and which worker class vLLM builds.

A platform has no device of its own here: the device is our runtime (the emulated Neuron device
process by default), started by the worker. vLLM sees a CPU-typed platform with gloo. Only vLLM's
platform interface is imported at module level: vLLM resolves the platform while its own config
modules are still importing (and vLLM's exceptions, which import nothing of vLLM's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.exceptions import VLLMValidationError  # imports nothing of vLLM's
from vllm.platforms.interface import Platform, PlatformEnum

from neuron_async_sm.config import ConfigError
from neuron_async_sm.sampling_params import InvalidRequestError
from neuron_async_sm.vllm_plugin import PLUGIN_NAME, WORKER_CLS
from neuron_async_sm.vllm_plugin.batch import sampling_params
from neuron_async_sm.vllm_plugin.config import DTYPE_NAMES, PluginOptions, speculative_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEFAULT_BLOCK_SIZE = 16  # vLLM's block accounting only: our KV cache is one slot per request

# vLLM sampling features our device's sampler does not implement: a request asking for one is
# rejected with a message naming it, never run with the feature silently ignored. Everything else of
# vLLM's SamplingParams is ours too (vllm_plugin/batch.py maps it).
_UNSUPPORTED_SAMPLING = (("logprob_token_ids", None),)
LOGPROBS_MODE = "raw_logprobs"  # vLLM's default, and the logprobs our device computes (model/logprobs.py)


class RefusedRequest(VLLMValidationError, ValueError):
    """A request our platform refuses: vLLM's validation error, which `vllm serve` answers with a 400
    naming the field (any other error there is a 500 without a message), and a ValueError, as vLLM's
    offline LLM raises its own validation errors."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message, parameter=parameter)


class NeuronAsyncSMPlatform(Platform):
    """vLLM's view of our device: CPU-typed, gloo, our worker class."""

    _enum = PlatformEnum.OOT
    device_name = PLUGIN_NAME
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    # The speculative method of the last configuration checked in this process (None: none), for
    # validate_request, which vLLM calls without the configuration (front end and engine alike).
    _speculation: ClassVar[str | None] = None

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return list(DTYPE_NAMES)  # float32 first: the "auto" dtype of a float32 checkpoint

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Runs for every VllmConfig, default ones without a model included (nothing to check then)."""
        if vllm_config.model_config is None:
            return
        # Imported here: vLLM imports this module while vllm.config itself is still importing.
        from vllm.config import CompilationMode, CUDAGraphMode

        PluginOptions.of(vllm_config.additional_config)  # an unknown option fails here, before any process starts
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(f"{PLUGIN_NAME}: pipeline parallelism is not supported; use tensor parallelism")
        if parallel.distributed_executor_backend not in (None, "mp", "uni"):
            raise ValueError(
                f"{PLUGIN_NAME}: distributed_executor_backend {parallel.distributed_executor_backend!r} is not "
                "supported; use 'mp' or 'uni'"
            )
        cls._speculation = check_speculation(vllm_config)
        if vllm_config.lora_config is not None:
            raise ValueError(f"{PLUGIN_NAME}: LoRA is not supported")
        if vllm_config.model_config.logprobs_mode != LOGPROBS_MODE:
            raise ValueError(
                f"{PLUGIN_NAME}: logprobs_mode {vllm_config.model_config.logprobs_mode!r} is not supported; "
                f"our device returns {LOGPROBS_MODE!r}"
            )
        cache = vllm_config.cache_config
        # Our KV cache holds a request's tokens in its own slot: a prefix cached in another request's
        # slot cannot be read, so vLLM must never count a prefix-cache hit as computed.
        cache.enable_prefix_caching = False
        if cache.block_size is None:
            cache.block_size = DEFAULT_BLOCK_SIZE
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE  # our device runs its own programs; vLLM compiles nothing
        compilation.cudagraph_mode = CUDAGraphMode.NONE

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Refuse, naming the field, what our worker cannot run or would reject (e.g. more logit_bias
        entries than our device takes): one bad request is refused here and never reaches a step."""
        for name, default in _UNSUPPORTED_SAMPLING:
            value = getattr(params, name, default)
            if value != default and not (default is None and not value):
                raise RefusedRequest(f"{PLUGIN_NAME}: sampling parameter {name}={value!r} is not supported", name)
        if cls._speculation is not None and getattr(params, "structured_outputs", None) is not None:
            # vLLM verifies a grammar's drafts with one mask row per position, which our worker does not
            # translate; our own engine takes grammars under n-gram only (docs/spec-decode.md §12).
            raise RefusedRequest(
                f"{PLUGIN_NAME}: structured_outputs is not supported with speculative_config "
                f"(method {cls._speculation!r}) under vLLM",
                "structured_outputs",
            )
        try:
            sampling_params(params, params.max_tokens or max(1, params.min_tokens))
        except InvalidRequestError as exc:
            raise RefusedRequest(f"{PLUGIN_NAME}: {exc}") from exc

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return PLUGIN_NAME

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        # What the KV cache may use is reported by the worker (determine_available_memory).
        import psutil

        return psutil.virtual_memory().total

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Called by vLLM's async output thread (mp executor) before its first output: without it the
        # thread dies and every reply after it is lost, so start-up hangs. There is no device to select.
        return None

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        return None  # we run none of vLLM's kernels (the base tries vllm._C, absent from this wheel)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):  # noqa: ANN206 (a context manager, as the base returns)
        return torch.no_grad()

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        return 0.0


def check_speculation(vllm_config: VllmConfig) -> str | None:
    """The speculative method vLLM was given (None: none), refused by name where our worker cannot run
    it: another method (our SpeculativeConfig's check), or tensor parallelism (a non-output rank
    drafts from the output rank's history, which our executor hands over and vLLM's does not)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    try:
        speculative_config(spec)
    except ConfigError as exc:
        raise ValueError(f"{PLUGIN_NAME}: {exc}") from exc
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        raise ValueError(
            f"{PLUGIN_NAME}: speculative_config with tensor_parallel_size > 1 is not supported: a non-output rank "
            "builds its spec rows from the output rank's drafts, which vLLM's executors do not hand over"
        )
    return spec.method
