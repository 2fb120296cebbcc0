"""The model runner: applies a SchedulerOutput, builds inputs, enqueues the program, hands back tokens.

Synchronous mode (the reference) follows the design's Normal Flow: every step blocks on the host copy
of its sampled tokens. Async mode follows the Async Flow: the sampled-token future stays on the device
and feeds the next step; the runner asks the AsyncStepMachine which path a step takes and carries out
that plan. It never decides the path itself.

One step, in order: the batch works out the step's rows and padded shape once (`InputBatch.plan`);
the machine decides the path from them; the plan may materialize the pending step; the batch takes
on the rows and the inputs are built (`build_model_input`); the program is enqueued. `sample_tokens`
then makes the step's output, which becomes the pending step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model.grammar_mask import apply_token_bitmask
from neuron_async_sm.model.inputs import SAMPLING_INPUT_NAMES
from neuron_async_sm.model.logprobs import PACKED_DTYPE
from neuron_async_sm.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput, StepSnapshot
from neuron_async_sm.runtime import DeviceFuture, DeviceRuntime, TensorSpec
from neuron_async_sm.runtime.messages import dtype_name
from neuron_async_sm.structured_output import GrammarBitmask
from neuron_async_sm.trace import Tracer
from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.async_output import OUTPUT_THREAD_NAME, AsyncModelRunnerOutput
from neuron_async_sm.worker.drafts import SPEC_STEP_PROGRAM, DraftedRows, build_spec_model_input
from neuron_async_sm.worker.input_batch import InputBatch, StepRows
from neuron_async_sm.worker.model_input import SAMPLED_DTYPE, ModelInput, build_model_input, logits_dtype

STEP_PROGRAM = "model_step"  # forward + on-device sampling -> token ids [B] int32
LOGITS_PROGRAM = "model_logits"  # forward only -> logits [B, vocab], sampled on the host
SAMPLE_PROGRAM = "model_sample"  # logits [B, vocab] (a future) + sampling inputs + bitmask -> token ids [B]
RELAY_PAD_PROGRAM = "relay_pad"  # sampled tokens [P] -> [relay_width(config)]: the relay's input, fixed in shape
OUTPUT_RANK = 0  # the design's TP0: the one rank whose outputs reach the scheduler and are written back

_SAMPLED_DTYPE_NAME = str(SAMPLED_DTYPE)
# The plans whose input is a drafted future's next_input (draft_model): the spec program reads it.
_DRAFTED_SOURCES = (sm.InputSource.DRAFTED_FUTURE, sm.InputSource.FUTURE_LAST_ACCEPTED)


def relay_width(config: EngineConfig) -> int:
    """The most rows a step's output can have (a decode bucket of max_num_seqs rows; a prefill has fewer)."""
    return config.decode_bucket(config.max_num_seqs)


@dataclass
class StepTrace:
    """What the trace records of one step (tracing only): its `step` and `reinstate` events."""

    step_id: int
    req_ids: tuple[str, ...]  # the step's rows, in order
    new: list[NewRequestData]  # requests the step adds to the batch, in admission order
    relay_from: list[int] = field(default_factory=list)  # the relay's row map (empty unless it relayed)
    inputs: list[list] = field(default_factory=list)  # per row, where its input id came from
    # Speculative decoding: per row the drafts the scheduler reserved, and the draft ids proposed
    drafts: list[int] | None = None  # None: no speculation
    proposed: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class ExecutedStep:
    """A step enqueued by `execute_model` and not yet closed by `sample_tokens`."""

    scheduled: SchedulerOutput
    model_input: ModelInput
    # the program's output: sampled tokens [B] (or logits [B, vocab], host sampling or split); None: a
    # deferred spec step, whose program waits for its mask (`deferred`)
    future: DeviceFuture | None
    trace: StepTrace | None  # None: not tracing
    split: bool = False  # SampleDeferred: `future` is the forward's logits; sample_tokens samples them
    token_bitmask: torch.Tensor | None = None  # int32 [B, W] host sampling's mask (None: no masked row)
    # SampleDeferred on a spec step: its program's inputs and output, enqueued with the mask. Verification
    # samples inside the one program (no split spec program), and nothing is left to wait for: a masked
    # request under speculation is scheduled only once its step in flight was applied.
    deferred: tuple[dict[str, object], TensorSpec] | None = None


class ModelRunner:
    """One rank's worker state: the input batch, the pending step and the step machine."""

    def __init__(
        self,
        config: EngineConfig,
        runtime: DeviceRuntime,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        rank: int = 0,
        tracer: Tracer = Tracer.NONE,
        output_thread: str = OUTPUT_THREAD_NAME,
        engine_core: str = "ours",
    ) -> None:
        """`output_thread`: the name of the thread that materializes outputs in order, for the trace's
        header (ours: engine/executor.py's; under vLLM's mp executor, its worker's output-copy thread;
        under its uni-process executor, the engine thread). `engine_core`: which engine core drives
        this runner, for the trace's header: "ours" or "vllm" (the spec's EngineCore).
        `eos_token_ids`: the model's, which min_tokens holds back with a request's stop_token_ids."""
        self.config = config
        self.runtime = runtime
        self.rank = rank
        # A non-output rank never brings a sampled token to the host: its futures are fed forward or
        # dropped, and its CPU token state past the prompt stays POISON_TOKEN. Its programs compute
        # on the output rank's input ids instead (broadcast on the device, model/parallel.py).
        self.is_output_rank = rank == OUTPUT_RANK
        self.tracer = tracer
        self.output_thread = output_thread
        self.engine_core = engine_core
        self.use_async_scheduling = config.async_scheduling
        self.vocab_size = vocab_size
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, eos_token_ids)
        # Async mode: the previous step's output, its sampled-token future still on the device, refilled
        # at the end of every step (Reinstate). Materialized only when the worker breaks the async flow.
        self.pending: AsyncModelRunnerOutput | None = None
        self.machine = sm.AsyncStepMachine()
        self._executed: ExecutedStep | None = None
        self._header_due = tracer.enabled  # the trace's header is written by the first step's thread
        self._sampled_specs: dict[int, TensorSpec] = {}  # rows -> the step program's output spec
        self.num_draft_tokens = 0  # drafts proposed (speculative decoding)
        self.num_spec_rows = 0  # rows that verified at least one draft
        spec = config.speculative_config
        self._host_drafter = spec is not None and spec.method == "ngram"  # drafts from the host's history
        self.drafted: DraftedRows | None = None  # the last spec step's decode rows, for the other ranks

    @property
    def sampling_deferred(self) -> bool:
        """The step `execute_model` enqueued waits for its mask (SampleDeferred): pass it to sample_tokens."""
        return self._executed is not None and self._executed.split

    # -- the step -----------------------------------------------------------------------------------

    def execute_model(self, scheduled: SchedulerOutput, drafted: DraftedRows | None = None) -> None:
        """Update states, prepare inputs, enqueue the program (without waiting for it).

        `drafted`: on a non-output rank with speculative decoding, the output rank's `self.drafted`
        for this step (this rank has no token history to draft from, worker/drafts.py)."""
        with self.tracer.observer.span("execute"):
            self._execute_model(scheduled, drafted)

    def sample_tokens(
        self, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Close the step `execute_model` enqueued and return its output.

        `grammar_bitmask`: a deferred step's mask (SampleDeferred), built by the engine core after it
        applied the pending step; its sampling is enqueued now, on the forward's logits.

        Samples nothing itself: the program samples on the device (or, host sampling, its logits are
        sampled when the output materializes). Snapshots which request owns each row, then in sync
        mode blocks until the tokens are on the host and applied to the batch and returns them; in
        async mode returns the output still as a device future (the async output thread materializes
        it), which stays the pending step the next step may feed on.
        """
        with self.tracer.observer.span("output"):
            return self._sample_tokens(grammar_bitmask)

    def _execute_model(self, scheduled: SchedulerOutput, drafted: DraftedRows | None) -> None:
        if self._header_due:
            self._trace_header()
        rows = self.batch.plan(scheduled, self.config)  # the row order and padded shape, once
        trace = (
            StepTrace(scheduled.step_id, rows.req_ids, scheduled.scheduled_new_reqs) if self.tracer.enabled else None
        )
        spec = self.config.speculative_config
        if trace is not None and spec is not None:
            trace.drafts = [scheduled.num_draft_tokens.get(r, 0) for r in rows.req_ids]
        # Sync mode (the reference) runs no machine: nothing is ever pending.
        obs = self._observe(scheduled, rows) if self.use_async_scheduling else None
        path = self._decide(obs, trace) if obs is not None else sm.NO_PENDING_FUTURE
        plan = sm.PLANS[path]
        if plan.materialize_first:
            # Hazard: stale input ids. The newest token of these requests exists only in the pending
            # future; materialize it into CPU state *before* the batch is updated and inputs built.
            with self.tracer.observer.span("materialize"):
                self._materialize_pending()
        with self.batch.lock:  # the output thread's write-back waits while the batch changes
            if spec is not None:  # drafts from the host (n-gram, a fallback row) or the device's next_input
                # Hazard: diverged ranks. Only the output rank has the history: the others take its drafts.
                assert (drafted is None) == self.is_output_rank, "drafts come from the output rank alone"
                on_device = self._reads_next_input(plan.input_source)  # the device places these rows (slot_len)
                model_input, self.drafted = build_spec_model_input(
                    self.config,
                    scheduled,
                    self.batch,
                    rows,
                    drafted,
                    fed=on_device,
                    one_extras_variant=self.runtime.compiles_per_shape,
                )
                # On the device's rows, the drafts the scheduler reserved (the drafter proposes as many
                # unless max_model_len is near, where the scheduler has turned speculation off).
                proposed = [len(d) for d in self.drafted.drafts.values()]
                self.num_draft_tokens += sum(proposed)
                self.num_spec_rows += sum(1 for n in proposed if n)
            else:
                model_input = build_model_input(
                    self.config,
                    scheduled,
                    self.batch,
                    rows,
                    cpu_ids=not self._feeds_every_id(plan.input_source),
                    one_extras_variant=self.runtime.compiles_per_shape,
                )
        fed, fed_rows = self._future_inputs(plan.input_source, model_input)
        if trace is not None:
            trace.relay_from = list(fed_rows) if plan.input_source is sm.InputSource.RELAYED_FUTURE else []
            trace.inputs = self._traced_inputs(plan.input_source, model_input, fed_rows)
            if spec is not None:
                trace.proposed = _proposed_drafts(model_input, on_device)
        num_rows = rows.shape[0] if spec is None else model_input.num_rows  # B (a spec step's shape is rebuilt)
        split, mask = self._launch(scheduled, obs, trace, model_input)
        if spec is not None:  # accepted tokens [B, 1 + k], -1 after each row's run (draft_model: then next_input)
            columns = spec.width * (2 if spec.method == "draft_model" else 1)
            dtype = SAMPLED_DTYPE
            if model_input.logprobs is not None:  # then the logprobs, the whole packed as float32
                columns, dtype = columns + model_input.logprobs.layout.width, PACKED_DTYPE
            out = TensorSpec((num_rows, columns), dtype)
            if split:  # the whole program waits for the mask (ExecutedStep.deferred)
                deferred = ({**model_input.inputs, **fed}, out)
                self._executed = ExecutedStep(scheduled, model_input, None, trace, split, deferred=deferred)
                return
            future = self.runtime.enqueue(SPEC_STEP_PROGRAM, {**model_input.inputs, **fed, **mask}, out)
        elif split:  # SampleDeferred: the forward now; sample_tokens samples its logits under the mask
            # The prompt's logprob blocks, when asked, come after each row's logits (StepProgram.forward_logits).
            layout = model_input.logprobs.layout if model_input.logprobs is not None else None
            prompt_width = layout.width - layout.sample_width if layout is not None else 0
            out = TensorSpec((num_rows, self.vocab_size + prompt_width), logits_dtype(self.config.dtype))
            # The forward takes the processing inputs too: a penalized row's history is written by it.
            forward = {k: v for k, v in model_input.inputs.items() if k not in SAMPLING_INPUT_NAMES}
            forward.pop("sample_logprobs", None)  # the sampling program's
            future = self.runtime.enqueue(LOGITS_PROGRAM, {**forward, **fed}, out)
        elif model_input.logprobs is not None:  # float32: the tokens in column 0, then the logprobs
            out = TensorSpec((num_rows, 1 + model_input.logprobs.layout.width), PACKED_DTYPE)
            future = self.runtime.enqueue(STEP_PROGRAM, {**model_input.inputs, **fed, **mask}, out)
        elif self.config.on_device_sampling:
            out = self._sampled_specs.get(num_rows)
            if out is None:  # one per bucket, kept: a TensorSpec validates itself when built
                out = self._sampled_specs[num_rows] = TensorSpec((num_rows,), SAMPLED_DTYPE)
            future = self.runtime.enqueue(STEP_PROGRAM, {**model_input.inputs, **fed, **mask}, out)
        else:  # sync mode only (config validation): the program returns logits
            out = TensorSpec((num_rows, self.vocab_size), logits_dtype(self.config.dtype))
            future = self.runtime.enqueue(LOGITS_PROGRAM, model_input.forward_inputs(), out)
        self._executed = ExecutedStep(scheduled, model_input, future, trace, split, mask.get("token_bitmask"))

    def _launch(
        self,
        scheduled: SchedulerOutput,
        obs: sm.StepObservation | None,
        trace: StepTrace | None,
        model_input: ModelInput,
    ) -> tuple[bool, dict[str, torch.Tensor]]:
        """A step with a masked row: whether its sampling is deferred (the machine's `launch`), and
        otherwise the program's `token_bitmask` input (empty: no masked row, nothing to pay)."""
        if not scheduled.structured_output_req_ids:
            return False, {}
        split = False
        if obs is not None:  # async: the machine decides; sync mode never defers (every grammar is current)
            transition = self.machine.launch(obs)
            self._trace_transition(transition, trace, masked=scheduled.structured_output_req_ids)
            split = sm.SAMPLE_PLANS[transition.dest].split
        if split:
            return True, {}
        bitmask = scheduled.grammar_bitmask
        # Hazard: stale mask. The machine samples in the program only when every masked row's grammar
        # holds its newest token, which is exactly when the scheduler could build the mask.
        assert bitmask is not None, (
            f"step {scheduled.step_id}: no mask for masked rows {scheduled.structured_output_req_ids}"
        )
        return False, self._token_bitmask(scheduled.step_id, bitmask, model_input)

    def _token_bitmask(self, step_id: int, bitmask: GrammarBitmask, model_input: ModelInput) -> dict[str, torch.Tensor]:
        """The program's `token_bitmask` input, int32 [B, W], in this step's row order."""
        if self.tracer.enabled:  # FreshMaskInv on real runs: which grammar state each masked row samples under
            index = model_input.tensor("output_index").tolist()
            row = {req_id: i for i, req_id in enumerate(model_input.req_ids)}
            masks = [[r, n, index[row[r]]] for r, n in zip(bitmask.req_ids, bitmask.grammar_tokens, strict=True)]
            self.tracer.event("mask", step=step_id, masks=masks)
        # Hazard: mask ownership. Scattered by request id into the rows as this step orders them.
        rows = bitmask.rows(model_input.req_ids, model_input.num_rows)  # [B, W] (speculative: [B, 1 + k, W])
        # Hazard: an empty mask. A row that allows no token would sample from logits that are all -inf;
        # the scheduler gives a dead end's row all ones (and finishes the request) instead.
        assert rows.any(axis=-1).all(), f"step {step_id}: a bitmask row allows no token"
        return {"token_bitmask": torch.from_numpy(rows)}

    def _sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        executed, self._executed = self._executed, None
        assert executed is not None, "sample_tokens() without execute_model()"
        model_input = executed.model_input
        assert executed.split == (grammar_bitmask is not None), "a mask comes with, and only with, a deferred step"
        if executed.split:
            assert grammar_bitmask is not None
            mask = self._token_bitmask(executed.scheduled.step_id, grammar_bitmask, model_input)
            if executed.deferred is not None:  # a spec step: verification samples in its one program
                inputs, out = executed.deferred
                future = self.runtime.enqueue(SPEC_STEP_PROGRAM, {**inputs, **mask}, out)
            else:
                # The sampling program's inputs: all but the forward's own (the prompt's targets went into its blocks).
                sampling = {k: v for k, v in model_input.inputs.items() if k not in ("input_ids", "prompt_targets")}
                if model_input.logprobs is not None:  # packed as the fused program's: tokens, then the logprobs
                    out = TensorSpec((model_input.num_rows, 1 + model_input.logprobs.layout.width), PACKED_DTYPE)
                elif (out := self._sampled_specs.get(model_input.num_rows)) is None:
                    out = self._sampled_specs[model_input.num_rows] = TensorSpec((model_input.num_rows,), SAMPLED_DTYPE)
                future = self.runtime.enqueue(SAMPLE_PROGRAM, {"logits": executed.future, **sampling, **mask}, out)
            executed = ExecutedStep(executed.scheduled, model_input, future, executed.trace)
        assert executed.future is not None
        snapshot = StepSnapshot(executed.scheduled.step_id, model_input.req_ids, model_input.sample_positions)
        logprobs = model_input.logprobs
        host_sampler = None
        if not self.config.on_device_sampling and logprobs is None:  # sync only: the batch's token ids are complete
            host_sampler = partial(model_input.sample_on_host, token_ids=self.batch.token_ids)
        if host_sampler is not None and executed.token_bitmask is not None:
            mask, sample = executed.token_bitmask, host_sampler
            host_sampler = lambda logits: sample(apply_token_bitmask(logits, mask))  # noqa: E731
        spec = self.config.speculative_config
        output = AsyncModelRunnerOutput(
            snapshot,
            executed.future,
            self.batch,
            self.tracer,
            host_sampler,
            logprobs,
            spec_width=0 if spec is None else spec.width,
            next_input=spec is not None and spec.method == "draft_model",
        )
        if not self.use_async_scheduling:
            # Normal Flow: block on the host copy (a non-output rank's is dropped unread).
            return output.get_output() if self.is_output_rank else output
        # Reinstate: whatever path this step took, the next one can go async again.
        self.pending = output
        self._trace_transition(self.machine.reinstate(), executed.trace)
        return output

    def drain(self) -> None:
        """Forget the pending future (after a failure; a shut-down engine is not reused, nothing drains it)."""
        self.pending = None
        self._executed = None
        self._trace_transition(self.machine.drain(), None)

    # -- async plan ---------------------------------------------------------------------------------

    def _observe(self, scheduled: SchedulerOutput, rows: StepRows) -> sm.StepObservation:
        """What the machine decides this step's path (and launch) from."""
        pending = self.pending
        masked = scheduled.structured_output_req_ids
        all_decode, all_spec = scheduled.all_decode, False
        if self.config.speculative_config is not None:
            all_decode, all_spec = self._spec_rows(scheduled)
        return sm.StepObservation(
            has_pending=pending is not None,
            prev_req_ids=pending.snapshot.req_ids if pending is not None else (),
            curr_req_ids=rows.req_ids,
            all_decode=all_decode,
            pending_shape=pending.fed_shape if pending is not None else (),
            pending_dtype=dtype_name(pending.fed_dtype) if pending is not None else "",
            input_shape=rows.shape,
            input_dtype=_SAMPLED_DTYPE_NAME,
            relay=self.config.async_relay,
            host_drafter=self._host_drafter,
            pending_drafted=pending is not None and pending.drafted,
            all_spec=all_spec,
            masked_req_ids=masked,
            pending_sampled_req_ids=pending.snapshot.sampled_req_ids()
            if pending is not None and masked
            else frozenset(),
        )

    def _spec_rows(self, scheduled: SchedulerOutput) -> tuple[bool, bool]:
        """With speculation (the scheduler's all_decode is always False there, every input `[rows, L]`):
        whether every row is a decode row of one token, and whether every row verifies k drafts."""
        config = self.config.speculative_config
        assert config is not None
        k, one, spec = config.num_speculative_tokens, True, True
        requests, computed, drafts = self.batch.requests, scheduled.num_computed_tokens, scheduled.num_draft_tokens
        for req_id, n in scheduled.num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None or computed[req_id] < state.num_prompt_tokens:  # a new request or a prompt chunk
                return False, False
            one = one and n == 1
            spec = spec and drafts.get(req_id, 0) == k
        return one, spec

    def _decide(self, obs: sm.StepObservation, trace: StepTrace | None) -> str:
        """The step's path state, as the machine decides it from the step's observations."""
        transition = self.machine.step(obs)
        self._trace_transition(transition, trace)
        return transition.dest

    def _future_inputs(
        self, source: sm.InputSource, model_input: ModelInput
    ) -> tuple[dict[str, object], Sequence[int]]:
        """The program inputs the plan's input source replaces or adds (none for CPU-built inputs), and
        per row the pending future's row it reads (-1: its CPU-built id; empty: no row reads it)."""
        if source is sm.InputSource.CPU:
            return {}, []
        assert self.pending is not None, "the machine plans a future input only when one is pending"
        if source is sm.InputSource.FUTURE:
            # Device-to-device feed: the previous step's sampled tokens are this step's input ids.
            return {"input_ids": self.pending.future}, range(len(model_input.req_ids))  # row i reads row i
        if source in _DRAFTED_SOURCES:
            # The same rows in the same order: the spec program reads each row's next_input from the
            # future, its last accepted token and the first num_drafts drafts (SpecExit: none, so the
            # last accepted token alone, never a draft's column), at the device's positions.
            if source is sm.InputSource.FUTURE_LAST_ACCEPTED:
                assert not model_input.tensor("num_drafts").any(), "SpecExit: every row one token"
            return {"drafted_input": self.pending.future}, range(len(model_input.req_ids))
        if source is sm.InputSource.RELAYED_FUTURE:
            # The future is an ordinary program input, as in Steady; the program gathers from it.
            relay = self._relay_rows(model_input)
            rows = torch.tensor(relay, dtype=torch.int32)  # [B]
            return {"relay_tokens": self._relay_tokens(), "relay_rows": rows}, relay
        if self.pending.drafted:  # each rank's own next_input, its rows permuted (the same values on every rank)
            if not self.is_output_rank:
                # Hazard: a non-output rank's token on the host. Its program permutes the rows on the device.
                order = self._remap_order(model_input)
                return {
                    "drafted_input": self.pending.future,
                    "drafted_rows": torch.tensor(order, dtype=torch.int32),
                }, order
            remapped, order = self._remap_pending(model_input)
            return {"drafted_input": remapped["input_ids"]}, order
        if not self.is_output_rank:
            return {}, []  # the remap would read the future on the host; the output rank's ids replace these
        return self._remap_pending(model_input)  # InputSource.REMAPPED_FUTURE

    def _relay_tokens(self) -> DeviceFuture:
        """The pending future as the relay reads it: as is, or (a device that compiles per shape) padded
        on the device to relay_width rows, so that a relay program's shape is its input's alone and
        warm-up covers it; otherwise each (previous rows, input shape) pair compiles while serving."""
        assert self.pending is not None
        future = self.pending.future
        if not self.runtime.compiles_per_shape:
            return future
        padded = TensorSpec((relay_width(self.config),), self.pending.fed_dtype)  # a packed output's: int
        return self.runtime.enqueue(RELAY_PAD_PROGRAM, {"tokens": future}, padded)  # rows keep their index

    def _relay_rows(self, model_input: ModelInput) -> list[int]:
        """The relay's row map: for each row (padding included), the pending future's row that sampled
        the token this row computes on, or -1 to keep the CPU-built id.

        Hazard: token ownership. Matched by request id, never by row: rows move and leave between steps.
        Hazard: stale input ids. Matched only where the pending step sampled this row's first position,
        so a prompt chunk after a cut chunk (which sampled nothing) keeps its prompt; any other row's
        token is on the host already (its step was applied before this one was scheduled).
        """
        assert self.pending is not None
        snapshot = self.pending.snapshot
        owners = zip(snapshot.req_ids, snapshot.sample_positions, strict=True)
        sampled = {(req_id, p): j for j, (req_id, p) in enumerate(owners) if p is not None}  # (id, position) -> row
        positions = model_input.tensor("positions")
        first = (positions if model_input.is_decode else positions[:, 0]).tolist()  # [B]
        rows = [-1] * len(first)
        for i, req_id in enumerate(model_input.req_ids):
            rows[i] = sampled.get((req_id, first[i]), -1)
        return rows

    def _remap_pending(self, model_input: ModelInput) -> tuple[dict[str, object], list[int]]:
        """Permute the future's real rows into the current order; padding rows stay where they are.

        Hazard: token ownership after condense(). Without the remap, row i would feed request
        curr[i] the token sampled for prev[i]. The gather forces the future on this thread.
        """
        order = self._remap_order(model_input)
        assert self.pending is not None
        with self.tracer.observer.span("fetch"):
            return {"input_ids": self.pending.future.index_select(torch.tensor(order, dtype=torch.int64))}, order

    def _remap_order(self, model_input: ModelInput) -> list[int]:
        """Per row of this step, the pending future's row of its request (padding rows: their own)."""
        assert self.pending is not None
        prev_row = {req_id: i for i, req_id in enumerate(self.pending.snapshot.req_ids)}
        order = list(range(model_input.num_rows))
        for i, req_id in enumerate(model_input.req_ids):
            order[i] = prev_row[req_id]
        return order

    def _materialize_pending(self) -> None:
        """Break the async flow: bring the pending output to the host on this (main) thread."""
        if self.pending is not None and self.is_output_rank:  # other ranks: see is_output_rank
            self.pending.get_output()

    def _reads_next_input(self, source: sm.InputSource) -> bool:
        """The spec program takes this step's decode rows from the pending future's next_input, at the
        device's positions: SpecSteady, SpecExit, and ReorderRemap of a drafted future (docs/spec-decode.md §7)."""
        if source in _DRAFTED_SOURCES:
            return True
        return source is sm.InputSource.REMAPPED_FUTURE and self.pending is not None and self.pending.drafted

    def _feeds_every_id(self, source: sm.InputSource) -> bool:
        """The plan's input source replaces every CPU-built input id (see `_future_inputs`)."""
        return source is sm.InputSource.FUTURE or (source is sm.InputSource.REMAPPED_FUTURE and self.is_output_rank)

    # -- trace --------------------------------------------------------------------------------------

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
            engine_core=self.engine_core,
            # speculative decoding: k (SpecDecode.tla's K; absent: no speculation)
            **(
                {}
                if (spec := self.config.speculative_config) is None
                else {"num_speculative_tokens": spec.num_speculative_tokens}
            ),
        )

    def _traced_inputs(self, source: sm.InputSource, model_input: ModelInput, fed_rows: Sequence[int]) -> list[list]:
        """Per row, the input id it computes on, as the program gets it: `["prompt"]`,
        `["future", j]` (row j of the pending future, as is, remapped or relayed) or
        `["host", token, position]` (the CPU-built id; POISON_TOKEN when the host lacks it)."""
        positions, input_ids = model_input.tensor("positions"), model_input.tensor("input_ids")
        first = (positions if model_input.is_decode else positions[:, 0]).tolist()
        ids = (input_ids if model_input.is_decode else input_ids[:, 0]).tolist()
        from_future = source in (sm.InputSource.FUTURE, sm.InputSource.REMAPPED_FUTURE, *_DRAFTED_SOURCES)
        rows: list[list] = []
        for i, req_id in enumerate(model_input.req_ids):
            if source is sm.InputSource.RELAYED_FUTURE and fed_rows[i] >= 0:
                rows.append(["future", fed_rows[i]])
            elif first[i] < len(self.batch.requests[req_id].prompt_token_ids):
                rows.append(["prompt"])
            elif from_future:
                rows.append(["future", fed_rows[i]])
            else:
                rows.append(["host", ids[i], first[i]])
        return rows

    def _trace_transition(
        self, transition: sm.Transition, trace: StepTrace | None, masked: frozenset[str] = frozenset()
    ) -> None:
        """The machine's move as a trace event; `masked`: a launch's rows that sample under a grammar."""
        if not self.tracer.enabled:
            return
        if trace is None:  # drain: no step of its own
            self.tracer.event(transition.trigger, source=transition.source, state=transition.dest, req_ids=[])
            return
        reinstate = transition.trigger == "reinstate"
        new = trace.new
        self.tracer.event(
            transition.trigger,
            step=trace.step_id,
            source=transition.source,
            state=transition.dest,
            req_ids=list(trace.req_ids),
            new=[n.request_id for n in new],
            **({} if trace.drafts is None else _spec_fields(trace, reinstate)),
            relay_from=list(trace.relay_from) if reinstate else [],  # the relay's row map
            # per new request: the outputs it may still have (max_tokens less those a restart's prompt
            # holds, capped by max_model_len)
            max_tokens=[
                min(
                    n.sampling_params.max_tokens - n.num_output_tokens,
                    self.config.max_model_len - len(n.prompt_token_ids),
                )
                for n in new
            ],
            prompt_lens=[len(n.prompt_token_ids) for n in new],
            inputs=trace.inputs if reinstate else [],  # per row: where its input id came from
            # the machine's counters after this step (reinstate), checked against the spec's
            counters=[self.machine.async_steps, self.machine.sync_fallback_steps] if reinstate else [],
            **({"masked": sorted(masked)} if transition.trigger == "launch" else {}),
        )


def _proposed_drafts(model_input: ModelInput, on_device: bool) -> list[list[int] | None]:
    """Per row of a spec step, the draft ids it verifies: the last `num_drafts` of its real tokens;
    None where the device feeds them (`on_device`: SpecSteady, SpecExit; the host never saw them)."""
    if on_device:
        return [None] * len(model_input.req_ids)
    ids, lens = model_input.tensor("input_ids").tolist(), model_input.tensor("query_lens").tolist()
    drafts = model_input.tensor("num_drafts").tolist()
    return [ids[i][lens[i] - drafts[i] : lens[i]] for i in range(len(model_input.req_ids))]


def _spec_fields(trace: StepTrace, reinstate: bool) -> dict[str, object]:
    """A spec step's trace fields (docs/spec.md, TraceSpecDecode): `drafts` on the step event (per row the
    drafts the scheduler reserved), `proposed` on the reinstate (per row the draft ids verified)."""
    return {"proposed": trace.proposed} if reinstate else {"drafts": trace.drafts}
