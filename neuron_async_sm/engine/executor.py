"""The executor: drives the worker ranks and, in async mode, the async output thread.

One ModelRunner per tensor-parallel rank, each over its own device process (`engine/ranks.py`), all
driven by the same SchedulerOutput. Every rank runs every step and takes the same machine path
(checked each step: a rank that diverged would feed its shard different inputs). Only the output
rank's (the design's TP0) outputs go to the async output thread and are written back into CPU state;
the other ranks' sampled-token futures are only ever fed forward to their next program or dropped,
never brought to the host: their programs compute on the output rank's input ids (`model/parallel.py`).
A failure on any rank is reported naming the rank that failed (a killed rank, not the peers whose
collectives it broke).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.outputs import ModelRunnerOutput, SchedulerOutput
from neuron_async_sm.runtime import keep_off_cpu
from neuron_async_sm.structured_output import GrammarBitmask
from neuron_async_sm.worker.async_output import OUTPUT_THREAD_NAME, AsyncModelRunnerOutput
from neuron_async_sm.worker.model_runner import OUTPUT_RANK, ModelRunner

_STOP = object()

BLAME_WAIT_S = 1.0
"""How long a failed step waits for a dead rank's runtime to notice its device is gone. A killed
rank breaks its peers' collectives at the same moment its own channel closes; the peer's program
error can arrive first, and the rank to name is the one whose device went away."""

logger = logging.getLogger("neuron_async_sm")


class RankFailedError(NeuronAsyncSMError, RuntimeError):
    """A tensor-parallel rank failed; `rank` is the rank whose device failed (or the one that reported it)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankPathMismatchError(NeuronAsyncSMError, AssertionError):
    """The ranks took different machine paths for one step: their inputs would differ."""


def check_same_path(step_id: int, paths: Sequence[str | None]) -> None:
    """Every rank's machine took the same path this step (None: sync mode, no machine)."""
    if len(set(paths)) > 1:
        taken = ", ".join(f"rank {rank} {path}" for rank, path in enumerate(paths))
        raise RankPathMismatchError(f"step {step_id}: the ranks took different machine paths: {taken}")


@dataclass(frozen=True)
class PendingOutput:
    """One step's output handed to the async output thread, and the Future it resolves."""

    output: AsyncModelRunnerOutput  # still a device future; get_output() materializes it
    result: Future[ModelRunnerOutput]  # what the engine core waits on


@dataclass(frozen=True)
class DeferredSampling:
    """A step whose forward is enqueued and whose sampling waits for its grammar mask (SampleDeferred)."""

    scheduled: SchedulerOutput


class Executor:
    """Runs `execute_model` + `sample_tokens` on every rank; returns the output rank's result."""

    def __init__(self, runners: list[ModelRunner], *, async_output: bool, device_cpu: int | None = None) -> None:
        assert [runner.rank for runner in runners] == list(range(len(runners))), "runners in rank order"
        self.runners = runners
        self.output_rank = OUTPUT_RANK
        self._device_cpu = device_cpu
        self._output_queue: queue.Queue[PendingOutput | object] | None = None
        self._output_thread: threading.Thread | None = None
        if async_output:
            self._output_queue = queue.Queue()
            self._output_thread = threading.Thread(target=self._async_output_loop, name=OUTPUT_THREAD_NAME, daemon=True)
            self._output_thread.start()

    def execute_model(self, scheduled: SchedulerOutput) -> None:
        """Enqueue the step on every rank, the output rank first; then check the paths agree.

        With speculative decoding the other ranks build their rows from the output rank's drafts
        and row starts (`ModelRunner.drafted`): they have no token history of their own.
        """
        output = self.runners[self.output_rank]
        with self._on_rank(output.rank):
            output.execute_model(scheduled)
        drafted = output.drafted  # None without speculative decoding
        for runner in self.runners:
            if runner is not output:
                with self._on_rank(runner.rank):
                    runner.execute_model(scheduled, drafted)
        if len(self.runners) > 1:
            paths = [runner.machine.state if runner.use_async_scheduling else None for runner in self.runners]
            check_same_path(scheduled.step_id, paths)

    def sample_tokens(self) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample on every rank; the output rank's result (sync: tokens; async: still a future).

        The other ranks' outputs are dropped here: in async mode their futures live on in their
        runner's pending step, to be fed to the next step's program; nothing ever reads them.
        """
        outputs = []
        for runner in self.runners:
            with self._on_rank(runner.rank):
                outputs.append(runner.sample_tokens())
        return outputs[self.output_rank]

    def execute_model_async(self, scheduled: SchedulerOutput) -> Future[ModelRunnerOutput] | DeferredSampling:
        """Async mode: enqueue the step on every rank; a Future resolved by the async output thread, or,
        when the machine deferred its sampling (SampleDeferred), `DeferredSampling`: the forward is
        enqueued and `sample_tokens_async` finishes the step once the caller has the mask."""
        self.execute_model(scheduled)
        if self.runners[self.output_rank].sampling_deferred:
            return DeferredSampling(scheduled)
        return self.sample_tokens_async()

    def sample_tokens_async(self, grammar_bitmask: GrammarBitmask | None = None) -> Future[ModelRunnerOutput]:
        """Async mode: close the enqueued step on every rank (a deferred one samples under
        `grammar_bitmask`); the Future the async output thread resolves."""
        assert self._output_queue is not None, "executor was built without the async output thread"
        outputs = []
        for runner in self.runners:
            with self._on_rank(runner.rank):
                outputs.append(runner.sample_tokens(grammar_bitmask))
        output = outputs[self.output_rank]
        assert isinstance(output, AsyncModelRunnerOutput)
        result: Future[ModelRunnerOutput] = Future()
        self._output_queue.put(PendingOutput(output, result))
        return result

    def _async_output_loop(self) -> None:
        """Materialize each step's output in order, overlapped with the engine scheduling the next.

        Never waits on the worker main thread: get_output() needs only the device and the output's
        own lock, which the main thread holds only while it materializes (no deadlock).
        """
        assert self._output_queue is not None
        keep_off_cpu(self._device_cpu)  # woken by the device's completions: must not preempt the device
        while True:
            item = self._output_queue.get()
            if item is _STOP:
                return
            assert isinstance(item, PendingOutput)
            try:
                item.result.set_result(item.output.get_output())
            except BaseException as exc:  # surfaced to the engine core, never swallowed
                item.result.set_exception(self._rank_error(exc, self.output_rank))

    @contextmanager
    def _on_rank(self, rank: int) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            error = self._rank_error(exc, rank)
            if error is exc:
                raise
            raise error from exc

    def _rank_error(self, exc: BaseException, rank: int) -> BaseException:
        """`exc`, raised on `rank`, as the error of the rank that failed (unchanged with one rank).

        A rank whose device is gone is the cause; a peer's failed collective is its symptom.
        """
        if len(self.runners) == 1 or isinstance(exc, RankFailedError | RankPathMismatchError):
            return exc
        deadline = time.monotonic() + BLAME_WAIT_S
        while True:
            down = [(r.rank, reason) for r in self.runners if (reason := getattr(r.runtime, "down_reason", None))]
            if down or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if down:
            failed, reason = down[0]
            message = f"tensor-parallel rank {failed} failed: {reason}"
        else:
            failed, message = rank, f"tensor-parallel rank {rank} failed: {type(exc).__name__}: {exc}"
        error = RankFailedError(message, failed)
        error.__cause__ = exc
        return error

    def drain(self) -> None:
        for runner in self.runners:
            runner.drain()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop the async output thread after the outputs queued before; waits at most `timeout_s`.

        The thread waits only on the device, so once the runtime is down it exits in milliseconds;
        one that does not (a bug) is abandoned (a daemon) rather than hanging the caller.
        """
        if self._output_thread is not None and self._output_queue is not None:
            self._output_queue.put(_STOP)
            self._output_thread.join(timeout=timeout_s)
            if self._output_thread.is_alive():
                logger.warning("async output thread did not stop within %.0f s; abandoned", timeout_s)
            self._output_thread = None
