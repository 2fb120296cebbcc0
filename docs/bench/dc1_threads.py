"""Where an async step's time goes at D ~ C (issue 15): CPU time per step of each thread of the host
process and of the device process, for the sweep's D/C 1 point (micro-llama, steady batch 256, real
device compute, the host raised to the program's time by the probe's Python spin).

One sync and one async engine, built once, a warm-up each, then `--pairs` alternating pairs (ABBA),
each after the bench's wait for a quiet second. Per run: the probe's C (main thread, waits out),
wait, D, device idle and overhead; from /proc's schedstat (nanoseconds), the time each Python thread
(by name; native threads together) and the device process ran on a CPU, and the time each sat
runnable waiting for one (run queue: preemption); all per step. The main thread's figures include
the driver's work between runs' turns (run set-up and metrics), so its C is the probe's.

    flock /tmp/bench.lock nice -n -10 .venv/bin/python docs/bench/dc1_threads.py --json docs/bench/dc1_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint
from neuron_async_sm.bench.runner import OtherLoad, ProbedLLM, batch_config
from neuron_async_sm.bench.sweep import calibrate
from neuron_async_sm.bench.workloads import build_workload

CHAIN_THREADS = ("neuron-device-rx", "async-output")


def _schedstat(path: str) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one)."""
    try:
        with open(path) as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def thread_ticks(device_pid: int | None) -> dict[str, int]:
    """ns on a CPU ('NAME') and on the run queue ('NAME queued') by thread name (native threads: 'native'),
    and the device process's ('device'), all its threads."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    stats = [
        (names.get(tid, "native"), f"/proc/self/task/{tid}/schedstat")
        for tid in map(int, os.listdir("/proc/self/task"))
    ]
    if device_pid is not None:
        stats += [
            ("device", f"/proc/{device_pid}/task/{tid}/schedstat") for tid in os.listdir(f"/proc/{device_pid}/task")
        ]
    for name, path in stats:
        run, wait = _schedstat(path)
        out[name] = out.get(name, 0) + run
        out[f"{name} queued"] = out.get(f"{name} queued", 0) + wait
        for key, value in _sched(path[: -len("schedstat")] + "sched").items():  # counts, x 1e6: per step below
            out[f"{name} {key}"] = out.get(f"{name} {key}", 0) + value * 1_000_000
    return out


def _sched(path: str) -> dict[str, int]:
    """Preemptions (involuntary switches), sleeps (voluntary switches: blocking, a GIL hand-off included) and
    migrations between CPUs, from /proc's sched (if present)."""
    wanted = {"nr_involuntary_switches": "preempted", "nr_voluntary_switches": "slept", "se.nr_migrations": "migrated"}
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in wanted:
                    out[wanted[key.strip()]] = int(value)
    except (OSError, ValueError):
        pass
    return out


def one_run(engine: ProbedLLM, workload) -> dict:
    pid = getattr(engine.llm.engine.runtime, "device_pid", None)
    before = thread_ticks(pid)
    metrics = engine.run(workload)
    after = thread_ticks(pid)
    steps = metrics["steps"]
    cpu = {k: (after.get(k, 0) - before.get(k, 0)) / 1e6 / steps for k in after}
    keys = (
        "step_ms",
        "host_ms_per_step",
        "host_cpu_ms_per_step",
        "wait_ms_per_step",
        "device_ms_per_step",
        "device_idle_ms_per_step",
        "device_overhead_ms_per_step",
        "schedule_ms_p50",
        "execute_ms_p50",
        "output_ms_p50",
        "busy_s",
        "other_cpu",
    )
    row = {k: metrics[k] for k in keys if k in metrics}
    for k in ("serial_s", "ideal_s"):
        if k in metrics:
            row[k] = metrics[k]
    row["cpu_ms_per_step"] = cpu
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ratio", type=float, default=1.0)
    p.add_argument("--max-other-cpu", type=float, default=0.15)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--chain-anywhere",
        action="store_true",
        help="experiment: the receiver and output threads may run on every CPU (the engine: off the device's)",
    )
    p.add_argument("--switch-interval-ms", type=float, default=None, help="experiment: sys.setswitchinterval")
    p.add_argument("--head", default=None, help="the commit of the tree imported (default: git rev-parse)")
    args = p.parse_args()
    # The tree measured: a `git archive` export has no .git, so say which commit it is (--head).
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = args.head or git
    config = {**batch_config(args.batch), "device_cpu": 1, "device_threads": 1}
    workload = build_workload(
        "steady", num_requests=args.batch, output_tokens=64, vocab_size=MICRO_LLAMA_CONFIG.vocab_size
    )
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_checkpoint(Path(tmp) / "micro-llama", MICRO_LLAMA_CONFIG))
        host_ms, floor_ms = calibrate(model, workload, **config)
        extra = max(0.0, floor_ms / args.ratio - host_ms)  # as the sweep: D stays at the floor, C rises to it
        print(f"C {host_ms:.3f} ms, program {floor_ms:.3f} ms, spin {extra:.3f} ms", flush=True)
        engines = {m: ProbedLLM(model, extra, async_scheduling=m == "async", **config) for m in ("sync", "async")}
        try:
            for engine in engines.values():
                engine.run(workload)
            if args.chain_anywhere:  # an experiment: the output chain may also run on the device's CPU
                for t in threading.enumerate():
                    if t.name in CHAIN_THREADS and t.native_id is not None:
                        os.sched_setaffinity(t.native_id, set(range(os.cpu_count() or 1)))
            if args.switch_interval_ms is not None:
                sys.setswitchinterval(args.switch_interval_ms / 1e3)
            for rep in range(args.pairs):
                OtherLoad.wait_for_quiet(args.max_other_cpu)
                for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
                    row = {"mode": mode, "pair": rep, **one_run(engines[mode], workload)}
                    runs.append(row)
                    cpu = " ".join(f"{k} {v:.3f}" for k, v in sorted(row["cpu_ms_per_step"].items()) if v >= 0.005)
                    print(
                        f"{rep} {mode:5s} step {row['step_ms']:.3f} C {row['host_ms_per_step']:.3f} "
                        f"wait {row['wait_ms_per_step']:.3f} D {row['device_ms_per_step']:.3f} "
                        f"idle {row['device_idle_ms_per_step']:.3f} ovh {row['device_overhead_ms_per_step']:.3f} "
                        f"others {row['other_cpu']:.0%} | cpu/step: {cpu}",
                        flush=True,
                    )
        finally:
            for engine in engines.values():
                engine.close()
    for mode in ("sync", "async"):
        rows = [r for r in runs if r["mode"] == mode]
        names = sorted({k for r in rows for k in r["cpu_ms_per_step"]})
        med = {k: statistics.median(r["cpu_ms_per_step"].get(k, 0.0) for r in rows) for k in names}
        print(
            f"{mode} medians: step {statistics.median(r['step_ms'] for r in rows):.3f} ms; cpu/step "
            + " ".join(f"{k} {v:.3f}" for k, v in med.items())
        )
    if args.json:
        out = {
            "ratio": args.ratio,
            "chain_anywhere": args.chain_anywhere,
            "switch_interval_ms": args.switch_interval_ms,
            "head": head,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "C_ms": host_ms,
            "program_ms": floor_ms,
            "spin_ms": extra,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
