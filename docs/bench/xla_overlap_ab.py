"""A/B of CPU placement for steady decode on --device xla (PJRT's CPU client), alternating in one process.

Run from the XLA venv, under the bench lock: `flock /tmp/bench.lock $(.ci/xla-env | tail -1)/bin/python
docs/bench/xla_overlap_ab.py --pairs 4 --json docs/bench/xla_overlap_ab.json`.

On PJRT's CPU client the "device" computes on the cores that trace the next step, so in async mode the
device's compute slows the host (C rises). Two placements, switched between (sync, async) pairs in one
process, so load drift hits both alike:
- `shared`: every thread may run on every CPU (the default);
- `split`: Python's threads (the engine thread, which traces and dispatches; the output thread; the
  watchdog) on the first CPU, every native thread (PJRT's execution and Eigen pools) on the last CPU,
  as the emulated backend keeps its device process on a CPU of its own (`device_cpu`).
Pairs start after a quiet second (other processes under 15% of the CPUs) and a pair during which
others took more is redone (up to 3 x --pairs), as `bench --max-other-cpu 0.15` does.
Each placement gets its own speedup, ideal speedup and overlap efficiency (bench/metrics.py `compare`).
A smaller engine than `bench --workload steady` (two prefill buckets, one decode bucket, relay off: 18
programs to compile instead of ~70), the same decode steps: 8 rows in decode bucket 8.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from neuron_async_sm.bench.metrics import compare, median_metrics
from neuron_async_sm.bench.runner import OtherLoad, ProbedLLM, load_average, split_native_threads
from neuron_async_sm.bench.workloads import build_workload

CONFIG = dict(
    device="xla",
    max_num_seqs=8,
    decode_buckets=(8,),
    max_num_batched_tokens=256,  # every 32-token prompt in the first step, then decode only
    prefill_buckets=(32, 256),
    async_relay=False,
    seed=0,
)
MAX_OTHER_CPU = 0.15


def place(split: bool) -> None:
    """`split`: Python's threads on the first CPU, native ones on the last (bench/runner.py); else anywhere."""
    split_native_threads((os.cpu_count() or 1) - 1 if split else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=4, help="(sync, async) pairs per placement")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    workload = build_workload("steady", num_requests=8, output_tokens=args.output_tokens, seed=0)
    t0 = time.perf_counter()
    engines = {m: ProbedLLM("tiny-llama", async_scheduling=m == "async", **CONFIG) for m in ("sync", "async")}
    print(f"engines built (warm-up) in {time.perf_counter() - t0:.0f} s, load {load_average()}", flush=True)
    runs: dict[str, list[dict]] = {"shared": [], "split": []}
    try:
        for mode in engines:  # unrecorded
            engines[mode].run(workload)
        for rep in range(3 * args.pairs):
            if min(len(r) for r in runs.values()) >= args.pairs:
                break
            for placement in ("shared", "split") if rep % 2 == 0 else ("split", "shared"):
                place(placement == "split")
                order = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
                OtherLoad.wait_for_quiet(MAX_OTHER_CPU, timeout_s=60)
                pair = {mode: engines[mode].run(workload) for mode in order}
                if max(m["other_cpu"] for m in pair.values()) <= MAX_OTHER_CPU and len(runs[placement]) < args.pairs:
                    runs[placement].append(pair)
                s, a = pair["sync"], pair["async"]
                print(
                    f"{placement:6s} rep {rep}: sync {s['step_ms']:.1f} ms/step (C {s['host_ms_per_step']:.1f}, "
                    f"D {s['device_ms_per_step']:.1f}), async {a['step_ms']:.1f} (C {a['host_ms_per_step']:.1f}, "
                    f"D {a['device_ms_per_step']:.1f}); others {max(s['other_cpu'], a['other_cpu']):.0%}",
                    flush=True,
                )
        place(False)
    finally:
        for engine in engines.values():
            engine.close()
    report = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in CONFIG.items()},
        "load_end": load_average(),
    }
    for placement, pairs in runs.items():
        sync, async_ = [p["sync"] for p in pairs], [p["async"] for p in pairs]
        c = compare(sync, async_)
        ms, ma = median_metrics(sync), median_metrics(async_)
        report[placement] = {"comparison": c, "sync": ms, "async": ma, "pairs": pairs}
        print(
            f"{placement}: speedup {c['speedup']:.3f}, ideal {c['ideal_speedup']:.3f}, efficiency "
            f"{c['overlap_efficiency']:.2f} (pairs {', '.join(f'{e:.2f}' for e in c['overlap_efficiency_per_pair'])}); "
            f"sync {ms['step_ms']:.1f} ms/step C {ms['host_ms_per_step']:.1f} D {ms['device_ms_per_step']:.1f}; "
            f"async {ma['step_ms']:.1f} C {ma['host_ms_per_step']:.1f} D {ma['device_ms_per_step']:.1f}; "
            f"others max {max(r['other_cpu'] for pr in pairs for r in pr.values()):.0%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
