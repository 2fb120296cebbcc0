"""The model runner: applies a SchedulerOutput, builds inputs, enqueues the program, hands back tokens.

Synchronous mode (the reference) follows the design's Normal Flow: every step blocks on the host copy
of its sampled tokens. Async mode follows the Async Flow: the sampled-token future stays on the device
and feeds the next step; the runner asks the AsyncStepMachine which path a step takes and carries out
that plan. It never decides the path itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from neuron_async_sm.runtime import DeviceFuture, DeviceRuntime, TensorSpec
from neuron_async_sm.runtime.messages import dtype_name
from neuron_async_sm.trace import Tracer
from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.async_output import OUTPUT_THREAD_NAME, AsyncModelRunnerOutput, StepSnapshot
from neuron_async_sm.worker.input_batch import CachedRequestState, InputBatch, scheduled_order
from neuron_async_sm.worker.model_input import (
    SAMPLED_DTYPE,
    ModelInput,
    WrittenTokens,
    build_model_input,
    logits_dtype,
    padded_input_shape,
)

STEP_PROGRAM = "model_step"  # forward + on-device sampling -> token ids [B] int32
LOGITS_PROGRAM = "model_logits"  # forward only -> logits [B, vocab], sampled on the host
RELAY_PAD_PROGRAM = "relay_pad"  # sampled tokens [P] -> [relay_width(config)]: the relay's input, fixed in shape
OUTPUT_RANK = 0  # the design's TP0: the one rank whose outputs reach the scheduler and are written back
# Sync mode (the reference) runs no machine: nothing is ever pending, every input is CPU-built.
SYNC_PLAN = sm.StepPlan(materialize_first=False, input_source=sm.InputSource.CPU)


_SAMPLED_DTYPE_NAME = str(SAMPLED_DTYPE)


def relay_width(config: EngineConfig) -> int:
    """The most rows a step's output can have (a decode bucket of max_num_seqs rows; a prefill has fewer)."""
    return config.decode_bucket(config.max_num_seqs)


@dataclass(frozen=True)
class AsyncExecutionBuffer:
    """The bridge between consecutive async steps, refilled at the end of every step (Reinstate)."""

    future: DeviceFuture  # sampled tokens of the previous step, [padded rows] int32, still on device
    req_ids: tuple[str, ...]  # ordered request ids that produced it
    output: AsyncModelRunnerOutput  # materialized only when the worker breaks the async flow


@dataclass(frozen=True)
class ExecutedStep:
    scheduled: SchedulerOutput
    model_input: ModelInput
    future: DeviceFuture
    path: str | None  # the machine's path state (async mode), None in sync mode


class ModelRunner:
    """One rank's worker state: the input batch, the async buffer and the step machine."""

    def __init__(
        self,
        config: EngineConfig,
        runtime: DeviceRuntime,
        *,
        vocab_size: int,
        rank: int = 0,
        tracer: Tracer = Tracer.NONE,
        output_thread: str = OUTPUT_THREAD_NAME,
    ) -> None:
        """`output_thread`: the name of the thread that materializes outputs in order, for the trace's
        header (ours: engine/executor.py's; under vLLM's mp executor, its worker's output-copy thread)."""
        self.config = config
        self.runtime = runtime
        self.rank = rank
        # A non-output rank never brings a sampled token to the host: its futures are fed forward or
        # dropped, and its CPU token state past the prompt stays POISON_TOKEN. Its programs compute
        # on the output rank's input ids instead (broadcast on the device, model/parallel.py).
        self.is_output_rank = rank == OUTPUT_RANK
        self.tracer = tracer
        self.output_thread = output_thread
        self.use_async_scheduling = config.async_scheduling
        self.vocab_size = vocab_size
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len)
        # Guards the CPU token state against the async output thread's write-back. Lock order: an
        # output's lock may be held while taking this one, never the reverse (no deadlock).
        self._state_lock = threading.Lock()
        self._last_written: WrittenTokens | None = None  # the last write-back (under _state_lock)
        self.buffer: AsyncExecutionBuffer | None = None
        self.machine = sm.AsyncStepMachine(on_transition=self._trace_transition)
        self._executed: ExecutedStep | None = None
        self._step_id = -1
        self._step_req_ids: tuple[str, ...] = ()
        self._step_new: list[NewRequestData] = []  # requests this step adds to the batch, in admission order
        self._step_relay: list[int] = []  # the relay's row map of this step (empty unless it relayed)
        self._step_gather: list[int] = []  # ReorderRemap: per row, the pending future's row it reads
        self._step_inputs: list[list] = []  # tracing only: per row, where its input id came from
        self._header_due = tracer.enabled  # the trace's header is written by the first step's thread
        self._sampled_specs: dict[int, TensorSpec] = {}  # rows -> the step program's output spec

    # -- the step -----------------------------------------------------------------------------------

    def execute_model(self, scheduled: SchedulerOutput) -> None:
        """Update states, prepare inputs, enqueue the program."""
        with self.tracer.observer.span("execute"):
            self._execute_model(scheduled)

    def sample_tokens(self) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Snapshot the row owners and return the step's output (async: still a future; sync: blocks on it)."""
        with self.tracer.observer.span("output"):
            return self._sample_tokens()

    def _execute_model(self, scheduled: SchedulerOutput) -> None:
        self._step_id = scheduled.step_id
        self._step_relay = []
        if self._header_due:
            self._trace_header()
        path = self._begin_async_step(scheduled) if self.use_async_scheduling else None
        plan = SYNC_PLAN if path is None else sm.PLANS[path]
        if plan.materialize_first:
            # Hazard: stale input ids. The newest token of these requests exists only in the pending
            # future; materialize it into CPU state *before* the batch is updated and inputs built.
            with self.tracer.observer.span("materialize"):
                self._materialize_pending()
        self._update_states(scheduled)
        model_input = self._prepare_model_input(scheduled, cpu_ids=not self._feeds_every_id(plan.input_source))
        if path is not None:
            assert model_input.req_ids == self._step_req_ids, "row order differs from the observed order"
        inputs = model_input.step_inputs() | self._future_inputs(plan.input_source, model_input)
        if self.tracer.enabled:
            self._step_inputs = self._traced_inputs(plan.input_source, model_input)
        if self.config.on_device_sampling:
            num_rows = model_input.num_rows
            out = self._sampled_specs.get(num_rows)
            if out is None:  # one per bucket, kept: a TensorSpec validates itself when built
                out = self._sampled_specs[num_rows] = TensorSpec((num_rows,), SAMPLED_DTYPE)
            future = self.runtime.enqueue(STEP_PROGRAM, inputs, out)
        else:  # sync mode only (config validation): the program returns logits
            out = TensorSpec((model_input.num_rows, self.vocab_size), logits_dtype(self.config.dtype))
            future = self.runtime.enqueue(LOGITS_PROGRAM, model_input.forward_inputs(), out)
        self._executed = ExecutedStep(scheduled, model_input, future, path)

    def _sample_tokens(self) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        executed, self._executed = self._executed, None
        assert executed is not None, "sample_tokens() without execute_model()"
        model_input = executed.model_input
        snapshot = StepSnapshot(executed.scheduled.step_id, model_input.req_ids, model_input.sample_positions)
        host_sampler = None if self.config.on_device_sampling else model_input.sample_on_host
        output = AsyncModelRunnerOutput(snapshot, executed.future, self._write_back, self.tracer, host_sampler)
        self.tracer.observer.output_created(output)
        if not self.use_async_scheduling:
            # Normal Flow: block on the host copy (a non-output rank's is dropped unread).
            return output.get_output() if self.is_output_rank else output
        # Reinstate: whatever path this step took, the next one can go async again.
        self.buffer = AsyncExecutionBuffer(executed.future, model_input.req_ids, output)
        self.machine.reinstate()
        return output

    def drain(self) -> None:
        """Forget the pending future (after a failure; a shut-down engine is not reused, nothing drains it)."""
        self.buffer = None
        self._executed = None
        self.machine.drain()

    # -- async plan ---------------------------------------------------------------------------------

    def _begin_async_step(self, scheduled: SchedulerOutput) -> str:
        self._step_new = scheduled.scheduled_new_reqs
        order = self.batch.preview_order(scheduled.finished_req_ids, [n.request_id for n in self._step_new])
        self._step_req_ids = scheduled_order(order, scheduled.num_scheduled_tokens)
        buffer = self.buffer
        obs = sm.StepObservation(
            has_pending=buffer is not None,
            prev_req_ids=buffer.req_ids if buffer else (),
            curr_req_ids=self._step_req_ids,
            all_decode=scheduled.all_decode,
            pending_shape=tuple(buffer.future.shape) if buffer else (),
            pending_dtype=dtype_name(buffer.future.dtype) if buffer else "",
            input_shape=padded_input_shape(self.config, scheduled),
            input_dtype=_SAMPLED_DTYPE_NAME,
            relay=self.config.async_relay,
        )
        return self.machine.step(obs)

    def _future_inputs(self, source: sm.InputSource, model_input: ModelInput) -> dict[str, object]:
        """The program inputs the plan's input source replaces or adds; none for CPU-built inputs."""
        if source is sm.InputSource.CPU:
            return {}
        assert self.buffer is not None, "the machine plans a future input only when one is pending"
        if source is sm.InputSource.FUTURE:
            # Device-to-device feed: the previous step's sampled tokens are this step's input ids.
            return {"input_ids": self.buffer.future}
        if source is sm.InputSource.RELAYED_FUTURE:
            # The future is an ordinary program input, as in Steady; the program gathers from it.
            self._step_relay = self._relay_rows(model_input)
            rows = torch.tensor(self._step_relay, dtype=torch.int32)  # [B]
            return {"relay_tokens": self._relay_tokens(), "relay_rows": rows}
        if not self.is_output_rank:
            return {}  # the remap would read the future on the host; the output rank's ids replace these
        return {"input_ids": self._remap_pending(model_input)}  # InputSource.REMAPPED_FUTURE

    def _relay_tokens(self) -> DeviceFuture:
        """The pending future as the relay reads it: as is, or (a device that compiles per shape) padded
        on the device to relay_width rows, so that a relay program's shape is its input's alone and
        warm-up covers it; otherwise each (previous rows, input shape) pair compiles while serving."""
        assert self.buffer is not None
        future = self.buffer.future
        if not self.runtime.compiles_per_shape:
            return future
        padded = TensorSpec((relay_width(self.config),), future.dtype)
        return self.runtime.enqueue(RELAY_PAD_PROGRAM, {"tokens": future}, padded)  # rows keep their index

    def _relay_rows(self, model_input: ModelInput) -> list[int]:
        """The relay's row map: for each row (padding included), the pending future's row that sampled
        the token this row computes on, or -1 to keep the CPU-built id.

        Hazard: token ownership. Matched by request id, never by row: rows move and leave between steps.
        Hazard: stale input ids. Matched only where the pending step sampled this row's first position,
        so a prompt chunk after a cut chunk (which sampled nothing) keeps its prompt; any other row's
        token is on the host already (its step was applied before this one was scheduled).
        """
        assert self.buffer is not None
        snapshot = self.buffer.output.snapshot
        owners = zip(snapshot.req_ids, snapshot.sample_positions, strict=True)
        sampled = {(req_id, p): j for j, (req_id, p) in enumerate(owners) if p is not None}  # (id, position) -> row
        first = (model_input.positions if model_input.is_decode else model_input.positions[:, 0]).tolist()  # [B]
        rows = [-1] * model_input.num_rows
        for i, req_id in enumerate(model_input.req_ids):
            rows[i] = sampled.get((req_id, first[i]), -1)
        return rows

    def _remap_pending(self, model_input: ModelInput) -> torch.Tensor:
        """Permute the future's real rows into the current order; padding rows stay where they are.

        Hazard: token ownership after condense(). Without the remap, row i would feed request
        curr[i] the token sampled for prev[i]. The gather forces the future on this thread.
        """
        assert self.buffer is not None
        prev_row = {req_id: i for i, req_id in enumerate(self.buffer.req_ids)}
        order = list(range(model_input.num_rows))
        for i, req_id in enumerate(model_input.req_ids):
            order[i] = prev_row[req_id]
        self._step_gather = order
        with self.tracer.observer.span("fetch"):
            return self.buffer.future.index_select(torch.tensor(order, dtype=torch.int64))

    def _materialize_pending(self) -> None:
        """Break the async flow: bring the pending output to the host on this (main) thread."""
        if self.buffer is not None and self.is_output_rank:  # other ranks: see is_output_rank
            self.buffer.output.get_output()

    # -- CPU state ----------------------------------------------------------------------------------

    def _update_states(self, scheduled: SchedulerOutput) -> None:
        added = [
            CachedRequestState(
                n.request_id, list(n.prompt_token_ids), n.sampling_params, n.seed, n.kv_slot, n.num_output_tokens
            )
            for n in scheduled.scheduled_new_reqs
        ]
        with self._state_lock:
            self.batch.update(scheduled.finished_req_ids, added)

    def _feeds_every_id(self, source: sm.InputSource) -> bool:
        """The plan's input source replaces every CPU-built input id (see `_future_inputs`)."""
        return source is sm.InputSource.FUTURE or (source is sm.InputSource.REMAPPED_FUTURE and self.is_output_rank)

    def _prepare_model_input(self, scheduled: SchedulerOutput, *, cpu_ids: bool) -> ModelInput:
        with self._state_lock:
            req_ids, slots = self.batch.scheduled_rows(scheduled.num_scheduled_tokens)
            return build_model_input(
                self.config, scheduled, self.batch, req_ids, slots, written=self._last_written, cpu_ids=cpu_ids
            )

    def _write_back(self, snapshot: StepSnapshot, tokens: list[int]) -> None:
        """Write sampled tokens into CPU state by the snapshot's request ids (never by current row)."""
        self.tracer.observer.write_back(snapshot, tokens)
        with self._state_lock:
            # Hazard: token ownership after condense(). One scatter addressed by the snapshot's
            # request ids; the rows may have moved or left since this step was sampled.
            self.batch.write_tokens(snapshot.req_ids, snapshot.sample_positions, tokens)
            self._last_written = WrittenTokens(snapshot, tokens)

    def _trace_header(self) -> None:
        """The trace's header: the constants a trace checker needs (model_check/), and the threads."""
        self._header_due = False
        self.tracer.event(
            "config",
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.config.max_model_len,
            decode_buckets=list(self.config.decode_buckets),
            async_scheduling=self.config.async_scheduling,
            async_relay=self.config.async_relay,
            engine_thread=threading.current_thread().name,  # the engine loop: it runs every step
            output_thread=self.output_thread,
        )

    def _traced_inputs(self, source: sm.InputSource, model_input: ModelInput) -> list[list]:
        """Tracing only: per row, the input id it computes on, as the program gets it: `["prompt"]`,
        `["future", j]` (row j of the pending future, as is, remapped or relayed) or
        `["host", token, position]` (the CPU-built id; POISON_TOKEN when the host lacks it)."""
        first = (model_input.positions if model_input.is_decode else model_input.positions[:, 0]).tolist()
        ids = (model_input.input_ids if model_input.is_decode else model_input.input_ids[:, 0]).tolist()
        rows: list[list] = []
        for i, req_id in enumerate(model_input.req_ids):
            if source is sm.InputSource.RELAYED_FUTURE and self._step_relay[i] >= 0:
                rows.append(["future", self._step_relay[i]])
            elif first[i] < len(self.batch.requests[req_id].prompt_token_ids):
                rows.append(["prompt"])
            elif source is sm.InputSource.FUTURE:
                rows.append(["future", i])  # the future is input_ids: row i reads row i
            elif source is sm.InputSource.REMAPPED_FUTURE:
                rows.append(["future", self._step_gather[i]])
            else:
                rows.append(["host", ids[i], first[i]])
        return rows

    def _trace_transition(self, trigger: str, source: str, dest: str) -> None:
        if self.tracer.enabled:
            reinstate = trigger == "reinstate"
            self.tracer.event(
                trigger,
                step=self._step_id,
                source=source,
                state=dest,
                req_ids=list(self._step_req_ids),
                new=[n.request_id for n in self._step_new],
                relay_from=list(self._step_relay),  # the relay's row map (reinstate after a Relay)
                # per new request: the outputs it may have (max_tokens, capped by max_model_len)
                max_tokens=[
                    min(n.sampling_params.max_tokens, self.config.max_model_len - len(n.prompt_token_ids))
                    for n in self._step_new
                ],
                prompt_lens=[len(n.prompt_token_ids) for n in self._step_new],
                inputs=self._step_inputs if reinstate else [],  # per row: where its input id came from
                # the machine's counters after this step (reinstate), checked against the spec's
                counters=[self.machine.async_steps, self.machine.sync_fallback_steps] if reinstate else [],
            )
