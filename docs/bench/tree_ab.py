"""A/B of `neuron-async-sm bench` between two source trees, alternating by invocation (ABBA).

Each invocation runs the given bench arguments (with `--json`) in a fresh process whose
`neuron_async_sm` comes from one tree (`PYTHONPATH`); the trees alternate A B B A ... so a slow spell
of the shared machine hits both. Printed and saved: each invocation's figures, and per tree the
medians over its invocations of the sync/async comparison (tokens/s, C, D, TTFT, speedup) or of the
transformers comparison (ours and theirs tokens/s, ratio per batch).

    git archive <old commit> | tar -x -C /tmp/before
    python docs/bench/tree_ab.py --before /tmp/before --after . --cycles 2 --out X.json \
        -- --workload churn --repetitions 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMPARE = ("tokens_per_s", "host_ms_per_step", "device_ms_per_step", "device_idle_ms_per_step", "ttft_ms_p50")


def invoke(tree: Path, bench_args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        cmd = ["nice", "-n", "-10", sys.executable, "-m", "neuron_async_sm", "bench", *bench_args, "--json", out.name]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        return json.loads(Path(out.name).read_text())


def figures(report: dict) -> dict:
    """The figures of one invocation that the summary takes medians of."""
    out: dict = {}
    if "sync" in report:
        for mode in ("sync", "async"):
            out.update({f"{mode}_{k}": report[mode][k] for k in COMPARE})
        out.update(speedup=report["speedup"], ideal_speedup=report["ideal_speedup"])
        out["async_step_fraction"] = report["async_step_fraction"]
    if "vs_transformers" in report:
        for row in report["vs_transformers"]["rows"]:
            b = row["batch"]
            out.update({f"b{b}_ours": row["ours_tokens_per_s"], f"b{b}_theirs": row["transformers_tokens_per_s"]})
            out[f"b{b}_ratio"] = row["ratio"]
        cb = report.get("vs_transformers_continuous")
        if cb:
            out.update(cb_ours=cb["tokens_per_s"]["ours"], cb_ratio=cb["ratio"])
    out["load_avg"] = report["machine"]["load_avg_end"][0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--cycles", type=int, default=2, help="pairs of invocations, order flipped every cycle")
    p.add_argument("--out", type=Path)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the bench arguments")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for cycle in range(args.cycles):
        order = ("before", "after") if cycle % 2 == 0 else ("after", "before")
        for name in order:
            result = figures(invoke(trees[name], bench_args))
            runs[name].append(result)
            print(name, json.dumps({k: round(v, 4) for k, v in result.items()}), flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, medians in summary.items():
        print(f"median {name}:", json.dumps({k: round(v, 4) for k, v in medians.items()}))
    if args.out:
        doc = {"bench_args": bench_args, "trees": {k: str(v) for k, v in trees.items()}, "runs": runs}
        args.out.write_text(json.dumps({**doc, "medians": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
