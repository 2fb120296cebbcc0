"""vLLM's worker interface over our ModelRunner: one rank, one device runtime, our machine deciding.

vLLM calls, in order: `init_device`, `load_model`, `get_kv_cache_spec`, `get_supported_kv_cache_layouts`,
`determine_available_memory`, `initialize_from_config`, `compile_or_warm_up_model`, then per step
`execute_model` and (unless the step is empty) `sample_tokens`, then, with synchronous speculation,
`take_draft_token_ids` (the drafts vLLM schedules next). With async scheduling vLLM keeps one
step in flight: `execute_model(N+1)` arrives before step N's output is read, and that output is read
through `get_output()` on the engine-core thread (uni-process executor) or on the worker's
`WorkerAsyncOutputCopy` thread (mp executor); on a non-output tensor-parallel rank, never.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds
from vllm.v1.outputs import AsyncModelRunnerOutput as VllmAsyncModelRunnerOutput
from vllm.v1.outputs import ModelRunnerOutput as VllmModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from neuron_async_sm.engine.core import StepProgramFactory, check_before_device_start, model_spec
from neuron_async_sm.engine.ranks import collective_timeout_s, free_port, start_rank
from neuron_async_sm.engine.warmup import warmup_calls
from neuron_async_sm.model import load_model_config
from neuron_async_sm.model.parallel import TensorParallelGroup
from neuron_async_sm.model.spec import TORCH_DTYPES
from neuron_async_sm.outputs import ModelRunnerOutput, SchedulerOutput, StepSnapshot
from neuron_async_sm.structured_output import GrammarBitmask
from neuron_async_sm.trace import StepObserver, Tracer
from neuron_async_sm.vllm_plugin.batch import BatchTranslator, UnsupportedStepError
from neuron_async_sm.vllm_plugin.config import PluginOptions, engine_config
from neuron_async_sm.vllm_plugin.engine_hooks import EVENTS_ATTR, GRAMMAR_TOKENS_ATTR, ORDINAL_ATTR
from neuron_async_sm.vllm_plugin.outputs import PromptLogprobs, vllm_output
from neuron_async_sm.vllm_plugin.ranks import PeerDevices
from neuron_async_sm.worker.async_output import AsyncModelRunnerOutput
from neuron_async_sm.worker.drafts import host_drafts
from neuron_async_sm.worker.model_runner import ModelRunner, relay_width

logger = logging.getLogger("neuron_async_sm")

VLLM_OUTPUT_THREAD = "WorkerAsyncOutputCopy"  # vLLM's mp worker thread that calls get_output() in order
KV_CACHE_LAYOUT = "LBNHC"  # what vLLM records; our device's cache layout is its own (model/kv_cache.py)
STATS_LOG_INTERVAL_S = 10.0


class VllmAsyncOutput(VllmAsyncModelRunnerOutput):
    """vLLM's handle on one step's output: our output object, which materializes exactly once."""

    def __init__(
        self, output: AsyncModelRunnerOutput, step: SchedulerOutput, prompts: PromptLogprobs, peers: PeerDevices
    ) -> None:
        self.output = output
        self.step = step
        self.prompts = prompts
        self.peers = peers

    def get_output(self) -> VllmModelRunnerOutput:
        # Hazard: double materialization. vLLM's thread and our runner (a step that breaks the async
        # flow) may both ask; our output's lock lets one of them transfer and write back.
        with blamed(self.peers):
            return vllm_output(self.output.get_output(), self.step, self.prompts)

    def get_kv_connector_output(self) -> None:
        return None  # no KV connector


class OutputCounter(StepObserver):
    """Counts the step outputs this rank creates (`NeuronAsyncSMWorker.sample_tokens`) and the ones it
    materializes (brings to the host)."""

    def __init__(self) -> None:
        self.created = 0
        self.materialized = 0

    def write_back(self, snapshot: StepSnapshot, tokens: list[int]) -> None:
        self.materialized += 1


@contextmanager
def blamed(peers: PeerDevices) -> Iterator[None]:
    """An error inside names the tensor-parallel rank that failed (vLLM logs a non-output rank's own)."""
    try:
        yield
    except Exception as exc:
        error = peers.blame(exc)
        if error is exc:
            raise
        raise error from exc


@contextmanager
def device_process_allowed() -> Iterator[None]:
    """Let this process start our device process although vLLM made it daemonic.

    vLLM's engine-core and worker processes are daemonic, and multiprocessing refuses a daemonic
    process children (a daemon's children are killed when it exits, not orphaned). Ours is one of
    those: the device process is daemonic itself and leaves when its pipe to us closes.
    """
    config = multiprocessing.current_process()._config  # noqa: SLF001 (the flag Process.start() checks)
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is None:
            config.pop("daemon", None)
        else:
            config["daemon"] = daemon


class NeuronAsyncSMWorker(WorkerBase):
    """One rank: vLLM's steps translated (`BatchTranslator`) and run by our ModelRunner on our device."""

    def __init__(
        self,
        vllm_config,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.options = PluginOptions.of(vllm_config.additional_config)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.counter = OutputCounter()
        self.overlapped_steps = 0  # execute_model() calls that found the previous output still unread
        self.num_blocks = 0  # vLLM's KV cache blocks (initialize_from_config)
        self._port: int | None = None
        self._step: SchedulerOutput | None = None
        self._mask_first = False  # the step waits for its mask to run (`execute_model`)
        self.prompts = PromptLogprobs()
        self._last_output: AsyncModelRunnerOutput | None = None
        self._step_of: dict[int, int] = {}  # traced runs: vLLM's step ordinal -> our step id
        self._last_log = time.monotonic()
        self._sampled: frozenset[str] = frozenset()  # the requests the last step sampled for (their drafts next)

    # -- start-up -----------------------------------------------------------------------------------

    def init_device(self) -> None:
        self.device = torch.device("cpu")  # vLLM's tensors stay on the host; our device is the runtime's
        if self.tp_size > 1:
            self._port = self._rendezvous_port()

    def _rendezvous_port(self) -> int:
        """The port our ranks' device processes meet on, chosen by rank 0 and told to the others over a
        gloo group of vLLM's worker processes (vLLM's own init method: they all have it). The group
        stays until the devices have started (`_swap_device_pids`)."""
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=self.distributed_init_method,
            rank=self.rank,
            world_size=self.tp_size,
            timeout=timedelta(seconds=120),
        )
        box = [free_port() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])

    def _swap_device_pids(self) -> PeerDevices:
        """Every rank's device process id, over the start-up group, which then goes."""
        import torch.distributed as dist

        try:
            pids: list[int | None] = [None] * self.tp_size
            dist.all_gather_object(pids, getattr(self.runtime, "device_pid", None))
            return PeerDevices(self.rank, tuple(pids))
        finally:
            dist.destroy_process_group()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Start this rank's device (it loads the checkpoint vLLM was given with our Llama loader)."""
        config = engine_config(self.vllm_config, self.options, rank=self.rank)
        self.model = model = load_model_config(config.model)
        self.config = config = check_before_device_start(config, model)
        group = None
        if self.tp_size > 1:
            assert self._port is not None
            group = TensorParallelGroup(self.rank, self.tp_size, self._port, collective_timeout_s(config))
        spec = config.speculative_config
        factory = StepProgramFactory(
            model_spec(config),
            relay_width(config),
            group,
            0 if spec is None else spec.width,
            None if spec is None else spec.model,  # the draft, loaded by our loader beside the target
        )
        with device_process_allowed():
            self.runtime = start_rank(config, factory, warmup_calls(config, model.vocab_size))
        self.peers = self._swap_device_pids() if self.tp_size > 1 else PeerDevices(self.rank)
        self.tracer = Tracer(config.trace_path)
        self.tracer.observe(self.counter)
        mp = self.parallel_config.distributed_executor_backend == "mp"
        self.runner = ModelRunner(
            config,
            self.runtime,
            vocab_size=model.vocab_size,
            rank=self.rank,
            tracer=self.tracer,
            # who materializes outputs in order: vLLM's mp worker thread, else vLLM's engine thread (this
            # one: the uni-process executor calls every worker method on it)
            output_thread=VLLM_OUTPUT_THREAD if mp else threading.current_thread().name,
            engine_core="vllm",
        )
        self.translator = BatchTranslator(
            config.max_num_seqs, config.max_model_len, model.vocab_size, config.seed, speculative=spec is not None
        )

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer, this rank's KV heads: vLLM's block accounting only."""
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=self.model.num_key_value_heads // self.tp_size,
            head_size=self.model.head_dim,
            dtype=TORCH_DTYPES[self.config.dtype],
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(self.model.num_hidden_layers)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return [KV_CACHE_LAYOUT]  # the base asks vLLM's attention backends, of which we have none

    def determine_available_memory(self) -> int:
        """Bytes for exactly our device's capacity in vLLM's blocks: max_num_seqs slots of
        max_model_len positions, plus the null block vLLM's block pool holds back. vLLM then never
        admits more than our slots hold; fewer blocks (num_gpu_blocks_override) force preemption."""
        spec = next(iter(self.get_kv_cache_spec().values()))
        # Speculation: vLLM allocates a running request's blocks k positions ahead (its lookahead slots).
        positions = self.config.max_model_len + self.vllm_config.num_lookahead_tokens
        blocks_per_slot = -(-positions // spec.block_size)
        num_blocks = self.config.max_num_seqs * blocks_per_slot + 1
        return num_blocks * spec.page_size_bytes * self.model.num_hidden_layers

    def initialize_from_config(self, kv_cache_config) -> None:
        self.num_blocks = kv_cache_config.num_blocks
        logger.info("rank %d: vLLM's KV cache: %d blocks", self.rank, self.num_blocks)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)  # warmed up when the device started

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # -- the step -----------------------------------------------------------------------------------

    def execute_model(self, scheduler_output) -> VllmModelRunnerOutput | None:
        """Run vLLM's step as ours; None asks vLLM for sample_tokens(). An empty step returns an empty
        output (vLLM treats None there as a failure) and reaches our runner with its next step.

        A step with a grammar row (structured output) gets its bitmask with sample_tokens(). When
        vLLM builds it at once (no grammar row's token in flight: it calls sample_tokens next), our
        runner runs the step then, mask and all, as our own engine does (SampleInProgram). When vLLM
        defers it (`pending_structured_output_tokens`: it applies the step in flight to the grammars
        first), the forward runs now and sample_tokens() samples its logits under the mask: our
        machine's SampleDeferred, which it decides from the same fact (a masked row's newest token
        still in the pending future)."""
        if self.tracer.enabled:
            self._trace_engine_events(scheduler_output)
        step = self.translator.translate(scheduler_output)
        if step is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        ordinal = getattr(scheduler_output, ORDINAL_ATTR, None)
        if self.tracer.enabled and ordinal is not None:
            self._step_of[ordinal] = step.step_id
        last = self._last_output
        if last is not None and last.materialize_count == 0:
            self.overlapped_steps += 1  # vLLM has not read the previous step yet: one step in flight
        self._step = step
        deferred = scheduler_output.pending_structured_output_tokens
        self._mask_first = bool(step.structured_output_req_ids) and not deferred
        if not self._mask_first:
            # Hazard: stale mask. vLLM defers a grammar step's mask exactly when a grammar row's token
            # is in flight; our machine then defers the sampling too (the runner asserts it does).
            with blamed(self.peers):
                self.runner.execute_model(step)
        self._maybe_log_stats()
        return None

    def sample_tokens(self, grammar_output) -> VllmModelRunnerOutput | VllmAsyncModelRunnerOutput:
        step, self._step = self._step, None
        assert step is not None, "sample_tokens() without a step"
        if self.tracer.enabled:  # a deferred mask: the step in flight was applied before it was built
            self._trace_engine_events(grammar_output)
        bitmask = self._bitmask(step, grammar_output)
        with blamed(self.peers):
            if self._mask_first:
                self.runner.execute_model(dataclasses.replace(step, grammar_bitmask=bitmask))
            output = self.runner.sample_tokens(bitmask if self.runner.sampling_deferred else None)
        self.counter.created += 1  # one output per step, whatever the mode or rank
        self._sampled = step.sampling_req_ids
        if isinstance(output, ModelRunnerOutput):  # sync mode, output rank: the tokens are here
            return vllm_output(output, step, self.prompts)
        if not self.runner.use_async_scheduling:
            return EMPTY_MODEL_RUNNER_OUTPUT  # sync mode, another rank: vLLM drops it unread
        self._last_output = output
        # On a non-output rank vLLM never calls get_output(): our runner feeds its future forward.
        return VllmAsyncOutput(output, step, self.prompts, self.peers)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Synchronous speculation: the drafts for each request the last step sampled for, which vLLM's
        scheduler schedules in the next step (maybe cut) and our runner then verifies as given. n-gram:
        our lookup over the request's history (`propose_ngram`; vLLM's own proposer takes the earliest
        occurrence of the longest suffix, ours the latest, so this is our engine's drafts and tokens);
        draft_model: the drafter's, brought home with the step's output. Async: never called (vLLM
        counts placeholders, the device holds the drafts)."""
        spec = self.config.speculative_config
        if spec is None or self.runner.use_async_scheduling or not self._sampled:
            return None
        sampled, self._sampled = self._sampled, frozenset()
        drafts = host_drafts(spec, self.runner.batch, sampled)
        return DraftTokenIds(list(drafts), list(drafts.values()))

    def _bitmask(self, step: SchedulerOutput, grammar_output) -> GrammarBitmask | None:
        """vLLM's GrammarOutput as ours: int32 `[rows, ceil(V/32)]` in vLLM's row order, keyed by
        request id (our runner scatters it into its own rows).

        A deferred mask may lack rows: vLLM builds it after applying the step in flight, which may
        have finished some of this step's requests (a stop, EOS, the grammar's end). Such a row
        samples unmasked and vLLM drops its token with the request. A row vLLM masks must be ours."""
        masked = step.structured_output_req_ids
        if not masked:
            return None
        width = -(-self.model.vocab_size // 32)
        req_ids = tuple(grammar_output.structured_output_request_ids) if grammar_output is not None else ()
        if not req_ids:  # every masked request finished meanwhile
            return GrammarBitmask((), np.zeros((0, width), dtype=np.int32), ())
        bitmask = np.asarray(grammar_output.grammar_bitmask, dtype=np.int32)  # [rows, W]
        if not masked.issuperset(req_ids) or bitmask.shape != (len(req_ids), width):
            raise UnsupportedStepError(
                f"step {step.step_id}: vLLM's grammar bitmask {bitmask.shape} for {sorted(req_ids)} does not "
                f"fit our masked rows {sorted(masked)} over a vocabulary of {self.model.vocab_size}"
            )
        tokens = getattr(grammar_output, GRAMMAR_TOKENS_ATTR, None) or [-1] * len(req_ids)  # -1: not traced
        return GrammarBitmask(req_ids, bitmask, tuple(tokens))

    # -- observability and shutdown -----------------------------------------------------------------

    def _trace_engine_events(self, carrier) -> None:
        """What vLLM's engine core did since its previous call to us (engine_hooks.py): steps applied,
        aborts, carried by a SchedulerOutput or by a deferred step's GrammarOutput. Written before
        this call's own events, the order in which the engine core did them."""
        for event, fields in getattr(carrier, EVENTS_ATTR, ()):
            if event == "AdvanceStep":
                step_id = self._step_of.pop(fields["ordinal"], None)
                if step_id is not None:  # None: a step our runner never ran (nothing scheduled)
                    fields = {k: v for k, v in fields.items() if k != "ordinal"}  # delivered, finished (counts)
                    self.tracer.event("AdvanceStep", step=step_id, **fields)
            else:
                self.tracer.event(event, **fields)

    def neuron_async_sm_stats(self) -> dict:
        """This rank's counters (`LLM.collective_rpc("neuron_async_sm_stats")`)."""
        stats = {
            "rank": self.rank,
            "async_scheduling": self.runner.use_async_scheduling,
            "outputs_created": self.counter.created,
            "outputs_materialized": self.counter.materialized,
            "overlapped_steps": self.overlapped_steps,
            "kv_cache_blocks": self.num_blocks,
            "free_kv_slots": self.translator.num_free_slots,
            "restarts": self.translator.restarts,
            "device_pid": getattr(self.runtime, "device_pid", None),  # None: the in-process device
        }
        if self.config.speculative_config is not None:  # drafts our runner verified, rows that verified any
            stats.update(num_draft_tokens=self.runner.num_draft_tokens, num_spec_rows=self.runner.num_spec_rows)
        if self.runner.use_async_scheduling:
            stats.update(self.runner.machine.counters())
        return stats

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= STATS_LOG_INTERVAL_S:
            self._last_log = now
            logger.info("neuron_async_sm worker stats: %s", self.neuron_async_sm_stats())

    def check_health(self) -> None:
        reason = getattr(self.runtime, "down_reason", None)
        if reason:
            raise RuntimeError(f"neuron_async_sm rank {self.rank}: device down: {reason}")

    def shutdown(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            logger.info("neuron_async_sm worker stats: %s", self.neuron_async_sm_stats())
            runtime.close()
            self.runtime = None
        tracer = getattr(self, "tracer", None)
        if tracer is not None:
            tracer.close()
