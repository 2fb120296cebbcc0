"""The engine core: the step loop, in its synchronous and its async (batch-queue) form.

`step_fn = step if batch_queue is None else step_with_batch_queue` — the two modes side by side.
The synchronous `step()` is the reference that async must match token for token.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from neuron_async_sm.config import ConfigError, EngineConfig
from neuron_async_sm.engine.executor import DeferredSampling, Executor
from neuron_async_sm.engine.model_len import resolve_model_len
from neuron_async_sm.engine.ranks import start_ranks
from neuron_async_sm.engine.warmup import warmup_calls, warmup_shapes
from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.model import (
    TINY_LLAMA,
    LlamaConfig,
    ModelSpec,
    StepProgram,
    build_step_program,
    load_model_config,
)
from neuron_async_sm.model.config import model_directory, tokenizer_path
from neuron_async_sm.model.drafter import build_drafter, check_draft_model
from neuron_async_sm.model.loader import checkpoint_path
from neuron_async_sm.model.parallel import TensorParallelGroup, build_sharded_step_program, check_divisible
from neuron_async_sm.model.program import RelayPad
from neuron_async_sm.model.spec_decode import SpecStepProgram
from neuron_async_sm.outputs import ModelRunnerOutput, RequestDelta, SchedulerOutput
from neuron_async_sm.request import Request
from neuron_async_sm.runtime import RuntimeFactory, create_runtime
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams
from neuron_async_sm.scheduler import Scheduler
from neuron_async_sm.structured_output import GrammarCompiler
from neuron_async_sm.trace import Tracer
from neuron_async_sm.worker.drafts import SPEC_STEP_PROGRAM
from neuron_async_sm.worker.model_input import logits_dtype
from neuron_async_sm.worker.model_runner import (
    LOGITS_PROGRAM,
    OUTPUT_RANK,
    RELAY_PAD_PROGRAM,
    SAMPLE_PROGRAM,
    STEP_PROGRAM,
    ModelRunner,
    relay_width,
)

logger = logging.getLogger("neuron_async_sm")

BATCH_QUEUE_DEPTH = 2
"""Async mode runs one step ahead: at most two steps are enqueued whose output is not applied yet."""

TEARDOWN_WAIT_S = 2.0
"""Bound on teardown's waits for host work. They run after the runtime is down, when no wait on the
device is left: an in-flight output then resolves in milliseconds, so this is only a backstop."""


class EngineDeadError(NeuronAsyncSMError, RuntimeError):
    """The engine failed earlier; build a new one."""


@dataclass(frozen=True)
class InFlightStep:
    """A batch queue entry: a step enqueued on the worker, and its output (resolved by the output thread)."""

    scheduled: SchedulerOutput
    output: Future[ModelRunnerOutput]


class StepProgramFactory:
    """Picklable: builds the step program inside the device (loads weights, allocates the KV cache).

    With a tensor-parallel `group`, the program is that rank's shard, and building it joins the group.
    """

    def __init__(
        self,
        spec: ModelSpec,
        relay_width: int,
        group: TensorParallelGroup | None = None,
        spec_width: int = 0,
        draft_model: str | None = None,
    ) -> None:
        self.spec = spec
        self.relay_width = relay_width  # rows the relay pads the previous output to (compiling devices)
        self.group = group
        self.spec_width = spec_width  # 1 + k with speculative decoding; 0: none
        self.draft_model = draft_model  # speculative_config.model (draft_model); None: no drafter

    def __call__(self, device: torch.device) -> dict:
        if self.group is None:
            program = build_step_program(self.spec, device)
        else:
            program = build_sharded_step_program(self.spec, self.group, device)
        programs = {
            STEP_PROGRAM: program,
            LOGITS_PROGRAM: LogitsProgram(program),
            SAMPLE_PROGRAM: SampleProgram(program),
            RELAY_PAD_PROGRAM: RelayPad(self.relay_width, device),
        }
        if self.spec_width:
            drafter = None
            if self.draft_model is not None:  # a second Llama and KV cache, same slots and positions
                draft_spec = replace(self.spec, model=self.draft_model, compile_shapes=())
                drafter = build_drafter(draft_spec, self.spec_width - 1, device, self.group)
            programs[SPEC_STEP_PROGRAM] = SpecStepProgram(program, self.spec_width, drafter)
        return programs


class SampleProgram:
    """The step's sampling alone, on the forward's logits (a future): a step whose mask waited."""

    def __init__(self, program: StepProgram) -> None:
        self.program = program

    def __call__(self, *, logits: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        return self.program.sample(logits, **inputs)


class LogitsProgram:
    """Forward without sampling, for host-side sampling (`on_device_sampling=False`, sync mode)."""

    def __init__(self, program: StepProgram) -> None:
        self.program = program

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        logits = self.program.forward_logits(**inputs)
        return logits.to(logits_dtype(self.program.spec.dtype))


def check_before_device_start(config: EngineConfig, model: LlamaConfig) -> EngineConfig:
    """Errors a user can act on, raised on the host instead of from inside the device process.

    Returns `config` with max_model_len resolved against the model and the KV cache budget.
    """
    if config.model != TINY_LLAMA:
        checkpoint_path(model_directory(config.model))  # raises ModelLoadError naming what is missing
    if config.tensor_parallel_size > 1 and (problem := check_divisible(model, config.tensor_parallel_size)):
        raise ConfigError(f"tensor_parallel_size: {problem}; choose a size that divides it")
    spec = config.speculative_config
    draft = None  # the draft model's config: its KV cache shares the budget
    if spec is not None and spec.method == "draft_model":
        draft = check_draft_model(spec, model, config.tensor_parallel_size)
    return resolve_model_len(config, model, draft)  # raises ConfigError naming the numbers and the flags


def model_spec(config: EngineConfig) -> ModelSpec:
    """The device's build recipe for a resolved `config` (max_model_len decided)."""
    assert config.max_model_len is not None, "resolve max_model_len first (check_before_device_start)"
    compile_shapes = () if config.enforce_eager else tuple(warmup_shapes(config))  # built in the device
    return ModelSpec(config.model, config.dtype, config.max_num_seqs, config.max_model_len, config.seed, compile_shapes)


class EngineCore:
    """Scheduler + executor + the step loop."""

    def __init__(self, config: EngineConfig, runtime_factory: RuntimeFactory = create_runtime) -> None:
        """``runtime_factory`` builds each runtime, called like ``create_runtime`` (a test wraps the backend)."""
        self.model_config = load_model_config(config.model)
        # Resolved once, before anything reads it: from here on max_model_len is the int chosen.
        self.config = config = check_before_device_start(config, self.model_config)
        self.tracer = Tracer(config.trace_path)
        self._spec = config.speculative_config is not None  # the trace's AdvanceStep carries token counts
        spec = model_spec(config)
        speculative = config.speculative_config
        spec_width = 0 if speculative is None else speculative.width
        draft_model = None if speculative is None else speculative.model
        # One runtime per tensor-parallel rank; the output rank's is `runtime`, its runner `runner`.
        self.runtimes = start_ranks(
            config,
            lambda group: StepProgramFactory(spec, relay_width(config), group, spec_width, draft_model),
            # compiling devices only; the grammars' variants where structured output can be asked for
            warmup=warmup_calls(
                config, self.model_config.vocab_size, grammars=tokenizer_path(config.model) is not None
            ),
            runtime_factory=runtime_factory,
        )
        self.runtime = self.runtimes[OUTPUT_RANK]
        vocab = self.model_config.vocab_size
        self.runners = [
            ModelRunner(
                config,
                runtime,
                vocab_size=vocab,
                eos_token_ids=self.model_config.eos_token_ids,
                rank=rank,
                tracer=self.tracer if rank == 0 else Tracer.NONE,
            )
            for rank, runtime in enumerate(self.runtimes)  # only the output rank (0) traces
        ]
        self.runner = self.runners[OUTPUT_RANK]
        self.executor = Executor(self.runners, async_output=config.async_scheduling, device_cpu=config.device_cpu)
        eos, vocab = self.model_config.eos_token_ids, self.model_config.vocab_size
        grammars = GrammarCompiler(tokenizer_path(config.model), vocab_size=vocab, eos_token_ids=eos)
        self.scheduler = Scheduler(config, eos_token_ids=eos, vocab_size=vocab, grammars=grammars)
        self._seed_base = config.seed * 1_000_003
        self._arrivals = 0
        # Async: steps enqueued on the worker whose output is not applied yet, oldest first.
        self.batch_queue: deque[InFlightStep] | None = deque() if config.async_scheduling else None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        self.dead_reason: str | None = None
        self.interrupted = False  # a step was interrupted (Ctrl-C): shutdown() waits for nothing
        self.num_steps = 0  # forward steps enqueued
        self._busy_s = 0.0  # time inside run_step(): tokens/s is not diluted by a client's idle time
        self._last_log = time.perf_counter()

    # -- requests -----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._check_alive()
        if params.n != 1:  # one engine request is one sequence: n children are n requests (params.children())
            raise InvalidRequestError(f"n: the engine runs one sequence a request; split n={params.n} with children()")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise InvalidRequestError(f"prompt_token_ids: must be a list of integers, got {prompt_token_ids!r}")
        # An unseeded request's seed depends only on the engine seed and how many requests were
        # accepted before it: a rejected request shifts nobody's tokens.
        seed = params.seed
        if seed is None:
            seed = random.Random(self._seed_base + self._arrivals).randrange(2**63)
        request = Request(request_id, list(prompt_token_ids), params, seed, self._arrivals)
        self.scheduler.add_request(request)  # validates; raises InvalidRequestError
        self._arrivals += 1

    def abort_request(self, request_id: str) -> RequestDelta | None:
        delta = self.scheduler.abort_request(request_id)
        if delta is not None and self.tracer.enabled:
            self.tracer.event("Abort", req_id=request_id)
        return delta

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    # -- the two loops ------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Synchronous step (Normal Flow): schedule, execute, block on tokens, update."""
        observer = self.tracer.observer
        with observer.span("schedule"):
            scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        self.num_steps += 1
        self.executor.execute_model(scheduled)
        output = self.executor.sample_tokens()
        assert isinstance(output, ModelRunnerOutput)
        with observer.span("output"):
            return self.scheduler.update_from_output(scheduled, output)

    def step_with_batch_queue(self) -> list[RequestDelta]:
        """Async step, one step ahead with a batch queue of depth 2.

        1. If the queue has room, schedule the next step and enqueue it on the worker without waiting
           for its tokens: the device starts it as soon as the previous program finishes.
        2. If the queue is still not full, return at once: the engine stays one step ahead.
        3. Otherwise wait for the oldest step's output (the async output thread materializes it) and
           apply it to the scheduler. The next call schedules the step after.
        A step whose grammar mask waits for the step in flight (SampleDeferred, structured output)
        enqueued its forward only: the oldest step is applied first (its tokens advance the grammars),
        then the mask is built and the step's sampling enqueued; it joins the queue, alone in it.
        """
        assert self.batch_queue is not None
        observer = self.tracer.observer
        if len(self.batch_queue) < BATCH_QUEUE_DEPTH:
            with observer.span("schedule"):
                scheduled = self.scheduler.schedule()
            if not scheduled.is_empty:
                self.num_steps += 1
                launched = self.executor.execute_model_async(scheduled)
                if isinstance(launched, DeferredSampling):
                    return self._sample_deferred(launched)
                self.batch_queue.append(InFlightStep(scheduled, launched))
                if len(self.batch_queue) < BATCH_QUEUE_DEPTH:
                    return []
        if not self.batch_queue:
            return []
        return self._apply_oldest()

    def _sample_deferred(self, launched: DeferredSampling) -> list[RequestDelta]:
        """The spec's AdvanceStep then DeferredSample: apply the step in flight, then sample the
        deferred one under the mask its grammars give now."""
        assert self.batch_queue is not None
        # Hazard: stale mask. The grammars must take the pending step's tokens before the mask is built.
        deltas = self._apply_oldest() if self.batch_queue else []
        with self.tracer.observer.span("output"):  # host work of applying outputs
            bitmask = self.scheduler.grammar_bitmask(launched.scheduled)
        self.batch_queue.append(InFlightStep(launched.scheduled, self.executor.sample_tokens_async(bitmask)))
        return deltas

    def _apply_oldest(self) -> list[RequestDelta]:
        """Wait for the oldest step's output and apply it to the scheduler (the spec's AdvanceStep)."""
        assert self.batch_queue is not None
        observer = self.tracer.observer
        oldest = self.batch_queue.popleft()
        scheduled = oldest.scheduled
        # Unbounded here, bounded below: the output thread waits only on the device, whose watchdog
        # fails every waiter after device_timeout_s without progress (DeviceHungError; 0: unbounded).
        with observer.span("result"):
            output = oldest.output.result()
        with observer.span("output"):
            deltas = self.scheduler.update_from_output(scheduled, output)
        if self.tracer.enabled:  # the spec's AdvanceStep: who got a token, who finished and why
            self.tracer.event(
                "AdvanceStep",
                step=scheduled.step_id,
                delivered=[d.request_id for d in deltas if d.new_token_ids],
                finished=[[d.request_id, d.finish_reason] for d in deltas if d.finish_reason is not None],
                # speculative: how many tokens each of `delivered` got (a run, cut at a stop)
                **({"counts": [len(d.new_token_ids) for d in deltas if d.new_token_ids]} if self._spec else {}),
            )
        return deltas

    def run_step(self) -> list[RequestDelta]:
        """One turn of the loop; a failure ends every in-flight request with an error, never hangs."""
        self._check_alive()
        started = time.perf_counter()
        try:
            deltas = self.step_fn()
        except Exception as exc:  # the device or the output thread failed
            return self._die(exc)
        except KeyboardInterrupt:
            # Hazard: a hung device. The user stopped waiting for it; shutdown() must not wait again.
            self.interrupted = True
            # Hazard: a half-done step. The interrupt can land anywhere in it (scheduled but not
            # enqueued, tokens half applied); stepping on from there could lose or misplace tokens.
            self.dead_reason = "a step was interrupted (KeyboardInterrupt)"
            raise
        finally:
            self._busy_s += time.perf_counter() - started
        self._maybe_log_stats()
        return deltas

    # -- failure, stats, shutdown -------------------------------------------------------------------

    def _die(self, exc: BaseException) -> list[RequestDelta]:
        reason = f"{type(exc).__name__}: {exc}"
        logger.error("engine failed: %s", reason)
        self.dead_reason = reason
        self._stop(force=False)
        self.executor.drain()
        return self.scheduler.fail_all(reason)

    def _stop(self, *, force: bool) -> None:
        """Close the runtime, then drain the in-flight steps and stop the output thread; bounded.

        The runtime goes first: closing it releases every waiter on the device (a hung or stopped
        device included), so the drain after it waits on host work only. `force`: the device gets
        no grace either; it is killed at once.
        """
        for runtime in self.runtimes:
            if force:
                runtime.kill()
            else:
                runtime.close()
        in_flight = [step.output for step in self.batch_queue or ()]
        if self.batch_queue:
            self.batch_queue.clear()
        # Hazard: a half-materialized output. fail_all() and drain() must not run while the
        # output thread still writes a step's tokens back: wait until every in-flight step resolved.
        deadline = time.monotonic() + TEARDOWN_WAIT_S
        late = 0
        for future in in_flight:
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                late += 1
        if late:
            logger.warning("%d in-flight step outputs did not resolve within %.0f s", late, TEARDOWN_WAIT_S)
        self.executor.shutdown(timeout_s=TEARDOWN_WAIT_S)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}; create a new LLM")

    def stats(self) -> dict:
        elapsed = self._busy_s
        stats = {
            "async_scheduling": self.config.async_scheduling,
            "steps": self.num_steps,
            "prompt_steps": self.scheduler.num_prompt_steps,  # steps with a prompt chunk; the rest decode
            "output_tokens": self.scheduler.num_output_tokens,
            "elapsed_s": elapsed,
            "tokens_per_s": self.scheduler.num_output_tokens / elapsed if elapsed > 0 else 0.0,
        }
        if self.config.async_scheduling:
            stats.update(self.runner.machine.counters())
        if self.config.speculative_config is not None:  # vLLM's spec_decode metrics
            scheduler = self.scheduler
            stats["spec_decode"] = {
                "num_spec_rows": self.runner.num_spec_rows,
                "num_draft_tokens": self.runner.num_draft_tokens,
                "num_accepted_tokens": scheduler.num_accepted_tokens,
            }
        # Programs compiled since warm-up (or the compiled programs' start-up): 0 unless it missed a shape.
        if self.runtime.compiles_per_shape or not self.config.enforce_eager:
            stats["compilations"] = self.runtime.stats().compilations
        return stats

    def _maybe_log_stats(self) -> None:
        now = time.perf_counter()
        if now - self._last_log >= self.config.stats_log_interval_s:
            self._last_log = now
            logger.info("engine stats: %s", self.stats())

    def shutdown(self) -> None:
        """Stop the device and the output thread; returns within a few seconds, even on a hung device.

        Torn down by an interrupt (Ctrl-C; the CLI's SIGTERM), it waits for nothing: the user may be
        interrupting a device that stopped responding, so the device is killed at once.
        """
        # exc_info: called from a `finally` / `__exit__` while the interrupt propagates.
        interrupted = self.interrupted or isinstance(sys.exc_info()[1], KeyboardInterrupt)
        self._stop(force=interrupted)
        self.tracer.close()
