"""Real compute's D/C against the batch size, micro-llama steady decode (issue 15: a real-compute point at D ~ C).

For each batch, `sweep.calibrate` (sync, no hold, no spin: a warm-up, then medians of three runs) gives C
(host ms per step) and D (the median program), with the engine settings the sweep uses at that batch.
Batches alternate in a round-robin over `--rounds`, so a slow spell of the shared machine hits each alike.

    flock /tmp/bench.lock nice -n -10 .venv/bin/python docs/bench/dc_vs_batch.py --json docs/bench/dc_vs_batch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint
from neuron_async_sm.bench.runner import OtherLoad, batch_config, load_average
from neuron_async_sm.bench.sweep import calibrate
from neuron_async_sm.bench.workloads import build_workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="16,32,64,128,256,384,512")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-other-cpu", type=float, default=0.15)
    p.add_argument("--json", default=None)
    p.add_argument("--head", default=None, help="the commit of the tree imported (default: git rev-parse)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    # The tree measured: a `git archive` export has no .git, so say which commit it is (--head).
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = args.head or git
    rows: dict[int, list[dict]] = {b: [] for b in batches}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_checkpoint(Path(tmp) / "micro-llama", MICRO_LLAMA_CONFIG))
        for rnd in range(args.rounds):
            for b in batches if rnd % 2 == 0 else batches[::-1]:
                workload = build_workload(
                    "steady", num_requests=b, output_tokens=args.output_tokens, vocab_size=MICRO_LLAMA_CONFIG.vocab_size
                )
                OtherLoad.wait_for_quiet(args.max_other_cpu)
                other = OtherLoad([])  # the device process is a child: its CPU counts as "other" here
                c, d = calibrate(model, workload, **batch_config(b), device_cpu=1, device_threads=1)
                row = {"batch": b, "round": rnd, "C_ms": c, "D_ms": d, "D_over_C": d / c, "load": load_average()}
                row["all_but_this_process_cpu"] = other.share()
                rows[b].append(row)
                print(f"batch {b:4d} C {c:.3f} ms D {d:.3f} ms D/C {d / c:.2f} load {row['load'][0]}", flush=True)
    summary = [
        {
            "batch": b,
            "C_ms": statistics.median(r["C_ms"] for r in rows[b]),
            "D_ms": statistics.median(r["D_ms"] for r in rows[b]),
            "D_over_C": statistics.median(r["D_over_C"] for r in rows[b]),
        }
        for b in batches
    ]
    for s in summary:
        print(f"median batch {s['batch']:4d} C {s['C_ms']:.3f} D {s['D_ms']:.3f} D/C {s['D_over_C']:.2f}")
    if args.json:
        out = {"head": head, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "summary": summary, "runs": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
