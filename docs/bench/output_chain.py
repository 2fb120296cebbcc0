"""Latency of the output path's hand-offs per step: the receiver thread has the step's ProgramDone ->
the async output thread has materialized it -> the engine's main thread returns from the step's Future.

Async, tiny-llama, batch 1, no device hold: the device is the bottleneck, so the main thread is already
waiting when the device finishes (steps where it was not are left out). Wall-clock latencies, so the
machine's load moves them; run trees alternately (`--trees a b b a ...`), one fresh process each:

    python docs/bench/output_chain.py --trees /tmp/before . . /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from in_tree import run_in_tree


def one(steps: int) -> dict:
    from concurrent.futures import Future

    import neuron_async_sm
    from neuron_async_sm import LLM, SamplingParams
    from neuron_async_sm.runtime import host_runtime as hr
    from neuron_async_sm.worker import async_output as ao

    clock = time.perf_counter
    received: dict[int, float] = {}  # program seq -> the receiver thread has its ProgramDone
    materialized: dict[int, float] = {}  # program seq -> the output thread finished materializing it
    returned: list[tuple[float, float]] = []  # per step, in order: (main thread waits from, returns at)
    on_done, materialize = hr.HostRuntime._on_program_done, ao.AsyncModelRunnerOutput._materialize
    result = Future.result

    def timed_on_done(self, message):
        received[message.seq] = clock()
        return on_done(self, message)

    def timed_materialize(self):
        seq = self._future.future_id
        try:
            return materialize(self)
        finally:
            materialized[seq] = clock()

    def timed_result(self, timeout=None):
        start = clock()
        value = result(self, timeout)
        returned.append((start, clock()))
        return value

    # A measurement script's own instrumentation of a throwaway process (the package is never patched).
    hr.HostRuntime._on_program_done = timed_on_done
    ao.AsyncModelRunnerOutput._materialize = timed_materialize
    llm = LLM("tiny-llama", async_scheduling=True, max_num_seqs=1, decode_buckets=(1,), max_num_batched_tokens=256)
    try:
        llm.add_request([3, 4, 5, 6], SamplingParams(max_tokens=steps + 100, ignore_eos=True))
        for _ in range(40):
            llm.step()
        Future.result = timed_result
        for _ in range(steps):
            llm.step()
        Future.result = result
    finally:
        llm.close()
    seqs = sorted(materialized)[-len(returned) :]  # one program per step: the k-th result is the k-th program
    to_output, to_main, total = [], [], []
    for (waits_from, returns_at), seq in zip(returned, seqs, strict=True):
        if seq in received and waits_from <= received[seq]:  # the main thread was waiting
            to_output.append(materialized[seq] - received[seq])
            to_main.append(returns_at - materialized[seq])
            total.append(returns_at - received[seq])
    us = lambda values: round(statistics.median(values) * 1e6, 1)  # noqa: E731
    return {
        "tree": neuron_async_sm.__file__,
        "steps_counted": len(total),
        "receiver_to_materialized_us": us(to_output),
        "materialized_to_main_us": us(to_main),
        "receiver_to_main_us": us(total),
        "load": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="*", type=Path, default=[])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.steps)))
        return
    results = []
    for tree in args.trees or [Path(".")]:
        tree = tree.resolve()
        report = run_in_tree(__file__, tree, ["--steps", str(args.steps)], timeout_s=600)
        results.append(report)
        print(json.dumps(report), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
