"""Where the async output chain's time goes at the sweep's D/C 1 point (issue 15 item 2), step by step.

micro-llama, steady batch 256, real device compute, the host raised to the program's time by the
probe's Python spin (as `bench --sweep 1` and `dc1_threads.py`). One async engine (and one sync, for
the pair's efficiency), built once, a warm-up each, then `--pairs` alternating (sync, async) runs.
In the async runs each step's chain is timed on its threads (wall clock, `time.perf_counter`, and
the thread's own CPU, `time.thread_time`):

- main waits: the engine's main thread enters the step's `Future.result()`;
- rx: the receiver thread's `recv` returned the step's ProgramDone, and it finished dispatching it;
- out: the thread that resolves the step's Future has the transferred tokens (`fetch` returned),
  has materialized (written back), and has resolved the Future;
- main returns from `result()`.

Reported per async run (medians over its steps where the main thread was waiting before the
receiver got the completion, and over all steps): each gap of the chain, the CPU each thread spent
on it, and how many steps had the completion already received when the main thread began waiting.

The instrumentation wraps a few functions of a throwaway process (the package is never patched);
`--trees a b b a` runs each tree in a fresh process, alternating:

    flock /tmp/bench.lock nice -n -10 .venv/bin/python docs/bench/output_path.py --trees /tmp/before . . /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dc1_threads import thread_ticks  # noqa: E402
from in_tree import run_in_tree  # noqa: E402


def instrument() -> dict[str, dict]:
    """Wrap the chain's functions; returns the tables they fill (by program seq, or by step order)."""
    from concurrent.futures import Future

    from neuron_async_sm.runtime import host_runtime as hr
    from neuron_async_sm.runtime import transport as tr
    from neuron_async_sm.worker import async_output as ao

    clock, cpu = time.perf_counter, time.thread_time
    t: dict[str, dict] = {"rx": {}, "out": {}, "main": {}, "set": {}}
    recv, on_done = tr.ProcessChannel.recv, hr.HostRuntime._on_program_done
    fetch, materialize = hr.HostRuntime.fetch, ao.AsyncModelRunnerOutput._materialize
    result, set_result = Future.result, Future.set_result
    local = threading.local()

    def timed_recv(self):
        message = recv(self)
        local.recv_at, local.recv_cpu = clock(), cpu()
        return message

    def timed_on_done(self, message):
        try:
            return on_done(self, message)
        finally:
            at = getattr(local, "recv_at", None)
            if at is not None:
                t["rx"][message.seq] = (at, clock(), cpu() - local.recv_cpu)

    def timed_fetch(self, future_id):
        try:
            return fetch(self, future_id)
        finally:
            local.fetched = (future_id, clock(), cpu())

    def timed_materialize(self):
        seq = self._future.future_id
        try:
            return materialize(self)
        finally:
            fetched = getattr(local, "fetched", None)
            if fetched is not None and fetched[0] == seq:
                t["out"][seq] = (fetched[1], clock(), cpu() - fetched[2], threading.current_thread().name)
                local.last = seq

    def timed_set_result(self, value):
        set_result(self, value)
        seq = getattr(local, "last", None)
        if seq is not None and hasattr(value, "step_id"):
            t["set"][value.step_id] = (clock(), cpu())

    def timed_result(self, timeout=None):
        start = clock()
        value = result(self, timeout)
        if hasattr(value, "step_id"):
            t["main"][value.step_id] = (start, clock())
        return value

    tr.ProcessChannel.recv = timed_recv
    hr.HostRuntime._on_program_done = timed_on_done
    hr.HostRuntime.fetch = timed_fetch
    ao.AsyncModelRunnerOutput._materialize = timed_materialize
    Future.set_result = timed_set_result
    Future.result = timed_result
    return t


def chain(t: dict[str, dict], seq_of_step: dict[int, int]) -> dict:
    """Per-step gaps (us), medians over steps where main waited before the receiver had the completion
    ('waited') and over all steps ('all')."""
    rows = []
    for step, (waits_from, returns_at) in t["main"].items():
        seq = seq_of_step.get(step)
        if seq is None or seq not in t["rx"] or seq not in t["out"]:
            continue
        rx_at, rx_done, rx_cpu = t["rx"][seq]
        out_fetched, out_done, out_cpu, out_thread = t["out"][seq]
        set_at = t["set"].get(step, (out_done, 0.0))[0]
        rows.append(
            {
                "received_before_wait": rx_at < waits_from,
                "main_wait": returns_at - waits_from,
                "wait_to_rx": max(0.0, rx_at - waits_from),  # completion reached Python after main blocked
                "rx_at_to_wait": max(0.0, waits_from - rx_at),  # received (C) before main blocked by this much
                "rx_handle": rx_done - rx_at,
                "rx_cpu": rx_cpu,
                "rx_to_out": out_fetched - rx_done,
                "out_materialize": out_done - out_fetched,
                "out_cpu": out_cpu,
                "out_to_set": set_at - out_done,
                "set_to_main": returns_at - set_at,
                "thread": out_thread,
            }
        )
    out: dict = {"steps": len(rows), "received_before_wait": sum(r["received_before_wait"] for r in rows)}
    keys = [k for k in rows[0] if k not in ("received_before_wait", "thread")] if rows else []
    out["threads"] = sorted({r["thread"] for r in rows})
    out["us"] = {k: round(statistics.median(r[k] for r in rows) * 1e6, 1) for k in keys}
    out["mean_us"] = {k: round(statistics.fmean(r[k] for r in rows) * 1e6, 1) for k in keys}
    return out


def one(args: argparse.Namespace) -> dict:
    import neuron_async_sm
    from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint
    from neuron_async_sm.bench.metrics import pair_ratios
    from neuron_async_sm.bench.runner import OtherLoad, ProbedLLM, batch_config
    from neuron_async_sm.bench.sweep import calibrate
    from neuron_async_sm.bench.workloads import build_workload

    config = {**batch_config(args.batch), "device_cpu": 1, "device_threads": 1}
    workload = build_workload(
        "steady", num_requests=args.batch, output_tokens=64, vocab_size=MICRO_LLAMA_CONFIG.vocab_size
    )
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_checkpoint(Path(tmp) / "micro-llama", MICRO_LLAMA_CONFIG))
        if args.spin_ms is None:
            host_ms, floor_ms = calibrate(model, workload, **config)
            spin = max(0.0, floor_ms / args.ratio - host_ms)
        else:
            host_ms = floor_ms = 0.0
            spin = args.spin_ms
        engines = {m: ProbedLLM(model, spin, async_scheduling=m == "async", **config) for m in ("sync", "async")}
        t = instrument()
        try:
            for engine in engines.values():
                engine.run(workload)
            for rep in range(args.pairs):
                OtherLoad.wait_for_quiet(args.max_other_cpu)
                pair = {}
                for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
                    for table in t.values():
                        table.clear()
                    engine = engines[mode]
                    runtime = engine.llm.engine.runtime
                    first_seq = runtime._next_seq
                    before = thread_ticks(runtime.device_pid)
                    metrics = engine.run(workload)
                    after = thread_ticks(runtime.device_pid)
                    per_step = {k: (after.get(k, 0) - before.get(k, 0)) / 1e3 / metrics["steps"] for k in after}
                    metrics["us_per_step"] = {k: round(v, 1) for k, v in sorted(per_step.items()) if abs(v) >= 0.5}
                    pair[mode] = metrics
                    if mode == "async":
                        # one program per step, in order: step k of this run is program first_seq + k
                        steps = sorted(t["main"])
                        seq_of_step = {s: first_seq + i for i, s in enumerate(steps)}
                        pair["chain"] = chain(t, seq_of_step)
                        waits = sorted(engine.probe.log.wait_s, reverse=True)
                        pair["chain"]["top_waits_us"] = [round(w * 1e6) for w in waits[:6]]
                        pair["chain"]["turns"] = len(waits)
                ratios = pair_ratios(pair["sync"], pair["async"])
                row = {
                    "pair": rep,
                    "efficiency": ratios["overlap_efficiency"],
                    "D_over_C": pair["sync"]["device_ms_per_step"] / pair["sync"]["host_ms_per_step"],
                    "sync_C_ms": pair["sync"]["host_ms_per_step"],
                    "async_step_ms": pair["async"]["step_ms"],
                    "async_C_ms": pair["async"]["host_ms_per_step"],
                    "async_wait_ms": pair["async"]["wait_ms_per_step"],
                    "async_idle_ms": pair["async"]["device_idle_ms_per_step"],
                    "other_cpu": max(pair["sync"]["other_cpu"], pair["async"]["other_cpu"]),
                    "chain": pair["chain"],
                    # schedstat per thread, us per step (counts: x 1e-3 per step); the main thread's
                    # includes the driver's work between turns
                    "sync_threads": pair["sync"]["us_per_step"],
                    "async_threads": pair["async"]["us_per_step"],
                }
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            for engine in engines.values():
                engine.close()
    return {
        "tree": neuron_async_sm.__file__,
        "C_ms": host_ms,
        "program_ms": floor_ms,
        "spin_ms": spin,
        "load": os.getloadavg(),
        "runs": runs,
        "efficiency": [round(r["efficiency"], 3) for r in runs],
        "at_target": sum(r["efficiency"] >= 0.95 for r in runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="*", type=Path, default=[])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ratio", type=float, default=1.0)
    p.add_argument("--spin-ms", type=float, default=None, help="the spin (default: calibrated as the sweep)")
    p.add_argument("--max-other-cpu", type=float, default=0.15)
    p.add_argument("--out", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args)))
        return
    forwarded = ["--pairs", str(args.pairs), "--batch", str(args.batch), "--ratio", str(args.ratio)]
    forwarded += ["--max-other-cpu", str(args.max_other_cpu)]
    if args.spin_ms is not None:
        forwarded += ["--spin-ms", str(args.spin_ms)]
    results = []
    for tree in args.trees or [Path(".")]:
        report = run_in_tree(__file__, tree.resolve(), forwarded, timeout_s=900, nice=True)
        summary = {k: report[k] for k in ("tree", "spin_ms", "efficiency", "at_target", "load")}
        summary["chain_us"] = [r["chain"]["us"] for r in report["runs"]]
        print(json.dumps(summary), flush=True)
        results.append(report)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
