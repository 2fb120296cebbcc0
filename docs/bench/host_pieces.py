"""Where a step's host time goes, piece by piece: wall and CPU time (`time.thread_time`) of named
functions on the engine's main thread, per steady decode step, medians over the steps.

Each function is wrapped (about 1 µs per call on top of what it measures); only calls on the main
thread while measuring count. A piece's median is over the steps that called it; pieces nest (the
enqueue is inside `_execute_model`), so they do not add up. Run it under the tree to measure:

    PYTHONPATH=/tmp/before python docs/bench/host_pieces.py sync 1 400
    PYTHONPATH=. python docs/bench/host_pieces.py async 64 300
"""

from __future__ import annotations

import functools
import multiprocessing.connection
import statistics
import sys
import threading
import time


def main() -> None:
    mode, batch = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    import neuron_async_sm.engine.core as core
    import neuron_async_sm.engine.executor as executor
    import neuron_async_sm.runtime.host_runtime as host_runtime
    import neuron_async_sm.runtime.in_flight as in_flight
    import neuron_async_sm.runtime.messages as messages
    import neuron_async_sm.runtime.transport as transport
    import neuron_async_sm.scheduler as scheduler
    import neuron_async_sm.worker.async_output as async_output
    import neuron_async_sm.worker.model_runner as model_runner
    from neuron_async_sm import LLM, SamplingParams

    main_thread = threading.get_ident()
    measuring = [False]
    step_pieces: dict[str, list] = {}  # this step: name -> [wall s, cpu s, calls]
    pieces: dict[str, list[list]] = {}  # name -> one entry per step that called it

    def wrap(owner: object, name: str, label: str | None = None) -> None:
        if not hasattr(owner, name):
            return  # not in this tree
        inner = getattr(owner, name)
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            if not measuring[0] or threading.get_ident() != main_thread:
                return inner(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                piece = step_pieces.setdefault(label, [0.0, 0.0, 0])
                piece[0] += time.perf_counter() - wall
                piece[1] += time.thread_time() - cpu
                piece[2] += 1

        setattr(owner, name, timed)

    for owner, names in [
        (core.EngineCore, ("step", "step_with_batch_queue")),
        (executor.Executor, ("execute_model", "execute_model_async", "sample_tokens")),
        (scheduler.Scheduler, ("schedule", "update_from_output")),
        (
            model_runner.ModelRunner,
            ("_execute_model", "_begin_async_step", "_update_states", "_prepare_model_input", "_sample_tokens"),
        ),
        (model_runner.ModelRunner, ("_write_back",)),
        (host_runtime.HostRuntime, ("enqueue", "_wire_input", "fetch", "_send")),
        (host_runtime.HostFuture, ("__init__", "to_host")),
        (in_flight.InFlight, ("acquire_slot",)),
        (transport.ProcessChannel, ("send",)),
        (messages.WireTensor, ("decode",)),
        (async_output.AsyncModelRunnerOutput, ("get_output", "_materialize")),
    ]:
        for name in names:
            wrap(owner, name)
    wrap(transport, "encode", "transport.encode")
    wrap(multiprocessing.connection.Connection, "_send", "Connection._send")
    wrap(threading.Event, "wait", "Event.wait")

    size = max(batch, 1)
    llm = LLM(
        "tiny-llama",
        async_scheduling=mode == "async",
        max_num_seqs=size,
        decode_buckets=(size,),
        max_num_batched_tokens=256,
    )

    def run(tag: str, n: int) -> tuple[list[float], list[float]]:
        params = SamplingParams(max_tokens=n + 16, ignore_eos=True)
        for i in range(batch):
            llm.add_request([3 + i, 4, 5, 6], params, f"{tag}-{i}")
        for _ in range(4):  # prefill, the first decode (a shape change), async's fill of the batch queue
            llm.step()
        walls, cpus = [], []
        measuring[0] = tag != "warm"
        for _ in range(n):
            wall, cpu = time.perf_counter(), time.thread_time()
            step_pieces.clear()
            llm.step()
            for label, piece in step_pieces.items():
                pieces.setdefault(label, []).append(piece)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
        measuring[0] = False
        while llm.has_unfinished_requests():
            llm.step()
        return walls, cpus

    try:
        run("warm", 64)
        pieces.clear()
        walls, cpus = run("measured", steps)
    finally:
        llm.close()
    print(
        f"{mode} batch {batch}: turn wall median {statistics.median(walls) * 1e6:.0f} µs, "
        f"main-thread CPU median {statistics.median(cpus) * 1e6:.0f} µs"
    )
    rows = {label: [statistics.median(p[i] for p in per_step) for i in range(3)] for label, per_step in pieces.items()}
    for label, (wall, cpu, calls) in sorted(rows.items(), key=lambda row: -row[1][1]):
        print(f"  {label:40s} calls/step {calls:4.1f}  wall {wall * 1e6:7.1f}  cpu {cpu * 1e6:7.1f} µs (median)")


if __name__ == "__main__":
    main()
