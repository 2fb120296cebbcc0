"""One step's output whose sampled tokens may still live in a device future."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron_async_sm.outputs import ModelRunnerOutput
from neuron_async_sm.runtime import DeviceFuture
from neuron_async_sm.trace import Tracer

OUTPUT_THREAD_NAME = "async-output"  # the async output thread (engine/executor.py), named in the trace header


@dataclass(frozen=True)
class StepSnapshot:
    """Taken when the step is sampled (the design's `_bookkeeping_sync`): which request owns each row.

    The next step's `_update_states()` may reorder or remove rows; tokens are written back by these
    request ids, never by current row, so they always reach the request they were sampled for.
    """

    step_id: int
    req_ids: tuple[str, ...]  # row i of the future belongs to req_ids[i]
    sample_positions: tuple[int | None, ...]  # token position each row samples; None: partial prefill


class AsyncModelRunnerOutput:
    """Blocking, thread-safe, call-once materialization of one step's sampled tokens.

    The async output thread and the worker main thread (when it breaks the async flow) may both call
    `get_output()`; the per-object lock lets exactly one of them transfer and write back, and the
    other gets the same result.
    """

    def __init__(
        self,
        snapshot: StepSnapshot,
        future: DeviceFuture,
        write_back: Callable[[StepSnapshot, list[int]], None],
        tracer: Tracer = Tracer.NONE,
        host_sampler: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.snapshot = snapshot
        # None: the future holds sampled token ids. Otherwise it holds logits sampled on the host.
        self._host_sampler = host_sampler
        self._future: DeviceFuture | None = future
        self._write_back = write_back
        self._tracer = tracer
        self._lock = threading.Lock()
        self._result: ModelRunnerOutput | None = None
        self._error: BaseException | None = None
        self.materialize_count = 0  # how many times the transfer + write-back ran (must stay <= 1)

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
        assert self._future is not None
        try:
            with self._tracer.observer.span("fetch"):
                host = self._future.to_host()  # blocks until the program ran; re-raises its error
            if self._host_sampler is not None:
                host = self._host_sampler(host)
            tokens = host.tolist()[: len(self.snapshot.req_ids)]  # ints (an integer tensor); no torch slice
            self._write_back(self.snapshot, tokens)
            self._result = ModelRunnerOutput(self.snapshot.step_id, list(self.snapshot.req_ids), tokens)
        except BaseException as exc:  # surfaced to every caller, never swallowed
            self._error = exc
        finally:
            # Only our reference goes: the buffer still holds the future while a program may read it.
            self._future = None
            self.materialize_count += 1
            if self._tracer.enabled:  # logged inside the lock: the trace orders it like the state change
                self._tracer.event(
                    "Materialize",
                    step=self.snapshot.step_id,
                    req_ids=list(self.snapshot.req_ids),
                    positions=list(self.snapshot.sample_positions),
                    ok=self._error is None,
                    count=self.materialize_count,
                    tokens=[] if self._result is None else self._result.sampled_token_ids,  # by snapshot row
                )
