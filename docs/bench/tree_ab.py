"""A/B of any `neuron-async-sm bench` command between two source trees, alternating (ABBA).

Each invocation runs the bench arguments given after `--` (plus `--json`) in a fresh process whose
`neuron_async_sm` is imported from one tree (`PYTHONPATH`; checked before the first run). The trees
alternate A B B A ..., so a slow spell of the shared machine hits both. Printed and written: each
invocation's figures, and per tree the median of each figure over its invocations. The figures
are whatever sections the report has: the sync/async comparison (tokens/s, C, D, device idle,
TTFT, speedup), the D/C sweep (speedup and overlap efficiency per point), the host cost (the
fitted fixed part and slope, C per batch size) and the peer comparison (tokens/s and ratio per
batch, continuous batching).

    git worktree add /tmp/before <commit>      # or: git archive <commit> | tar -x -C /tmp/before
    python docs/bench/tree_ab.py --before /tmp/before --after . --cycles 2 --out ab.json \\
        -- --workload churn --repetitions 3 --max-other-cpu 0.15
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
HOST_COST_BATCHES = (1, 8, 64)


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def check_tree(tree: Path) -> None:
    """Fails unless a process with `tree` first on PYTHONPATH imports neuron_async_sm from `tree`
    (an editable install elsewhere, or a tree without the package, would silently measure another one)."""
    code = "import neuron_async_sm; print(neuron_async_sm.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(tree), capture_output=True, text=True, check=False)
    imported = out.stdout.strip()
    if out.returncode != 0 or not Path(imported).resolve().is_relative_to(tree):
        raise SystemExit(f"{tree}: neuron_async_sm imports from {imported or out.stderr.strip()!r}, not this tree")


def invoke(tree: Path, bench_args: list[str]) -> dict:
    """One `bench` invocation importing `tree`; its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "neuron_async_sm", "bench", *bench_args, "--json", str(out)]
        if os.geteuid() == 0:
            cmd = ["nice", "-n", "-10", *cmd]  # as benchmarks.md's figures ran; only root may raise priority
        subprocess.run(cmd, env=_env(tree), cwd=tree, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        return json.loads(out.read_text())


def figures(report: dict) -> dict[str, float]:
    """The figures of one invocation that the summary takes medians of, flat."""
    out: dict[str, float] = {}
    if "sync" in report:
        for mode in ("sync", "async"):
            out.update({f"{mode}_{k}": report[mode][k] for k in COMPARE})
        out.update(speedup=report["speedup"], ideal_speedup=report["ideal_speedup"])
        out["async_step_fraction"] = report["async_step_fraction"]
    for point in report.get("sweep", {}).get("points", []):
        label = "real" if point["requested_ratio"] is None else f"dc{point['requested_ratio']:g}"
        out.update({f"sweep_{label}_{k}": point[k] for k in ("D_over_C", "speedup", "overlap_efficiency")})
    if "host_cost_batch" in report:
        host = report["host_cost_batch"]
        for mode, fit in host["linear_fit"].items():
            out[f"host_{mode}_fixed_us"] = fit["intercept_us"]
            out[f"host_{mode}_us_per_request"] = fit["slope_us_per_request"]
            for row in host["rows"]:
                if row["batch"] in HOST_COST_BATCHES:
                    out[f"host_{mode}_C{row['batch']}_us"] = row[f"{mode}_host_us"]
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


def order(cycle: int) -> tuple[str, str]:
    """ABBA: the tree that runs first flips every cycle."""
    return ("before", "after") if cycle % 2 == 0 else ("after", "before")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="the tree to compare against (e.g. main)")
    p.add_argument("--after", type=Path, required=True, help="the tree with the change")
    p.add_argument("--cycles", type=int, default=2, help="pairs of invocations, order flipped every cycle")
    p.add_argument("--out", type=Path, help="write every invocation's figures and the medians as JSON")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the bench arguments")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for tree in trees.values():
        check_tree(tree)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for cycle in range(args.cycles):
        for name in order(cycle):
            result = figures(invoke(trees[name], bench_args))
            runs[name].append(result)
            print(name, json.dumps({k: round(v, 4) for k, v in result.items()}), flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, row in medians.items():
        print(f"median {name}:", json.dumps({k: round(v, 4) for k, v in row.items()}))
    doc = {"bench_args": bench_args, "trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "medians": medians}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
