"""One step's output whose sampled tokens may still live in a device future: the pending step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from neuron_async_sm.outputs import ModelRunnerOutput, StepSnapshot
from neuron_async_sm.runtime import DeviceFuture
from neuron_async_sm.trace import Tracer
from neuron_async_sm.worker.model_input import SAMPLED_DTYPE

if TYPE_CHECKING:
    from neuron_async_sm.worker.input_batch import InputBatch
    from neuron_async_sm.worker.step_logprobs import StepLogprobs

OUTPUT_THREAD_NAME = "async-output"  # the async output thread (engine/executor.py), named in the trace header


class AsyncModelRunnerOutput:
    """Blocking, thread-safe, call-once materialization of one step's sampled tokens.

    Also the worker's pending step in async mode: its `future` feeds the next step and its
    `snapshot` says which request owns each row of it.

    The async output thread and the worker main thread (when it breaks the async flow) may both call
    `get_output()`; the per-object lock lets exactly one of them transfer the tokens and hand them to
    the worker's batch, and the other gets the same result.
    """

    def __init__(
        self,
        snapshot: StepSnapshot,
        future: DeviceFuture,
        batch: InputBatch,
        tracer: Tracer = Tracer.NONE,
        host_sampler: Callable[[torch.Tensor], torch.Tensor] | None = None,
        logprobs: StepLogprobs | None = None,
        spec_width: int = 0,
        next_input: bool = False,
    ) -> None:
        self.snapshot = snapshot
        # Sampled token ids, [padded rows] int32, still on the device: the next step may feed on it.
        # With logprobs, [padded rows, 1 + width] float32: the tokens in column 0 (exact integers), the
        # logprobs after them (model/logprobs.py, worker/step_logprobs.py). Otherwise (host_sampler set,
        # sync mode only) logits [padded rows, vocab] sampled on the host.
        self.future = future
        self._host_sampler = host_sampler
        self._logprobs = logprobs
        # Speculative decoding: W = 1 + k (0: none); the future is [rows, W] tokens, -1 after each row's
        # run, then (draft_model, `next_input`) [rows, W] next_input, then the logprobs when asked (the
        # whole then float32).
        self._spec_width = spec_width
        self._next_input = next_input
        self._batch = batch  # the worker's CPU token state: it applies the tokens (InputBatch.write_back)
        self._tracer = tracer
        self._lock = threading.Lock()
        self._result: ModelRunnerOutput | None = None
        self._error: BaseException | None = None
        self.materialize_count = 0  # how many times the transfer + write-back ran (must stay <= 1)

    @property
    def fed_shape(self) -> tuple[int, ...]:
        """The shape a later step reads of the future as its input ids: a logprobs output's tokens
        (column 0, `[B]`; the program takes that column), otherwise the whole future."""
        shape = tuple(self.future.shape)
        return shape[:1] if self._logprobs is not None else shape

    @property
    def fed_dtype(self) -> torch.dtype:
        """The dtype a later step reads of the future as its input ids (and the relay's pad returns): a
        logprobs output's token columns are the sampled dtype's integers (float32 holds them exactly;
        the programs take them as ids), otherwise the future's own."""
        return SAMPLED_DTYPE if self._logprobs is not None else self.future.dtype

    @property
    def drafted(self) -> bool:
        """The draft_model spec program made it: it carries next_input (every row: column 0 its last
        accepted token, then the drafts proposed after it)."""
        return self._next_input

    @property
    def step_id(self) -> int:
        return self.snapshot.step_id

    def get_output(self) -> ModelRunnerOutput:
        # Hazard: double materialization. Without the lock both threads could transfer and write the
        # same tokens back, appending a request's token twice.
        with self._lock:
            if self._result is None and self._error is None:
                self._materialize()
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

    def _materialize(self) -> None:
        snapshot = self.snapshot
        try:
            with self._tracer.observer.span("fetch"):
                host = self.future.to_host()  # blocks until the program ran; re-raises its error
            if self._host_sampler is not None:
                host = self._host_sampler(host)
            logprobs = prompt_logprobs = spec_logprobs = runs = next_input = None
            if self._spec_width:  # per row its accepted drafts and one more token, then -1
                width = self._spec_width
                columns = width * (2 if self._next_input else 1)
                # ints (with logprobs the output is float32: its token columns are exact integers)
                rows = host[: len(snapshot.req_ids), :columns].to(torch.int32).tolist()
                if self._next_input:  # draft_model: the tokens, then next_input
                    next_input = [row[width:] for row in rows]
                    rows = [row[:width] for row in rows]
                runs = [row[: row.index(-1)] if -1 in row else row for row in rows]
                tokens = [run[0] for run in runs]
                if self._logprobs is not None:  # read in the same materialization as the tokens
                    positions = snapshot.sample_positions
                    spec_logprobs, prompt_logprobs = self._logprobs.read_runs(host, columns, runs, positions)
                    logprobs = [None if row is None else row[0] for row in spec_logprobs]
            elif self._logprobs is not None:  # read in the same materialization as the tokens
                tokens, logprobs, prompt_logprobs = self._logprobs.read(host, snapshot.sample_positions)
            else:
                tokens = host.tolist()[: len(snapshot.req_ids)]  # ints (an integer tensor); no torch slice
            self._tracer.observer.write_back(snapshot, tokens)
            # Inside the lock: a thread that asks second returns only once the batch holds the tokens.
            if runs is None:
                self._batch.write_back(snapshot, tokens)
            else:
                self._batch.write_runs(snapshot, runs, next_input)
            self._result = ModelRunnerOutput(
                snapshot.step_id,
                list(snapshot.req_ids),
                tokens,
                runs,
                logprobs,
                prompt_logprobs,
                spec_logprobs,
                next_input,
            )
        except BaseException as exc:  # surfaced to every caller, never swallowed
            self._error = exc
        finally:
            self.materialize_count += 1
            if self._tracer.enabled:  # logged inside the lock: the trace orders it like the state change
                self._tracer.event(
                    "Materialize",
                    step=snapshot.step_id,
                    req_ids=list(snapshot.req_ids),
                    positions=list(snapshot.sample_positions),
                    ok=self._error is None,
                    count=self.materialize_count,
                    tokens=[] if self._result is None else self._result.sampled_token_ids,  # by snapshot row
                    # speculative: each row's run (accepted drafts, then one more token)
                    **({"runs": runs} if (runs := self._result and self._result.spec_token_ids) else {}),
                )
