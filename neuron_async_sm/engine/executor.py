"""The executor: drives the worker ranks and, in async mode, the async output thread.

Shaped for tensor parallelism: every rank runs every step, but only the output rank's outputs go to
the async output thread (the design's TP0). The other ranks' outputs are materialized only when
their worker breaks the async flow; otherwise the next step's output simply supersedes them.
Ranks run in this process today; a multi-process rank only has to provide the same two calls.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from neuron_async_sm.outputs import ModelRunnerOutput, SchedulerOutput
from neuron_async_sm.runtime import keep_off_cpu
from neuron_async_sm.worker.async_output import OUTPUT_THREAD_NAME, AsyncModelRunnerOutput
from neuron_async_sm.worker.model_runner import ModelRunner

_STOP = object()

logger = logging.getLogger("neuron_async_sm")


@dataclass(frozen=True)
class PendingOutput:
    """One step's output handed to the async output thread, and the Future it resolves."""

    output: AsyncModelRunnerOutput  # still a device future; get_output() materializes it
    result: Future[ModelRunnerOutput]  # what the engine core waits on


class Executor:
    """Runs `execute_model` + `sample_tokens` on every rank; returns the output rank's result."""

    def __init__(
        self, runners: list[ModelRunner], *, output_rank: int = 0, async_output: bool, device_cpu: int | None = None
    ) -> None:
        self.runners = runners
        self.output_rank = output_rank
        self._device_cpu = device_cpu
        self._output_queue: queue.Queue[PendingOutput | object] | None = None
        self._output_thread: threading.Thread | None = None
        if async_output:
            self._output_queue = queue.Queue()
            self._output_thread = threading.Thread(target=self._async_output_loop, name=OUTPUT_THREAD_NAME, daemon=True)
            self._output_thread.start()

    def execute_model(self, scheduled: SchedulerOutput) -> None:
        for runner in self.runners:
            runner.execute_model(scheduled)

    def sample_tokens(self) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample on every rank; the output rank's result (sync: tokens; async: still a future)."""
        outputs = [runner.sample_tokens() for runner in self.runners]
        return outputs[self.output_rank]

    def execute_model_async(self, scheduled: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Async mode: enqueue the step on every rank; a Future resolved by the async output thread."""
        assert self._output_queue is not None, "executor was built without the async output thread"
        self.execute_model(scheduled)
        output = self.sample_tokens()
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
                item.result.set_exception(exc)

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
