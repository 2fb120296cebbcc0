"""A/B of the host-cost benchmark between two source trees, alternating by invocation (ABBA).

Each invocation is one `host_cost_vs_batch` run (both modes, every batch size, round robin) in a
fresh process whose `neuron_async_sm` is imported from that tree; the trees alternate A B B A ...
so a slow spell of the shared machine hits both. The figures are medians over the invocations of
each one's least-squares fit (fixed µs + µs per running request) and of each batch size's C.

    git archive <old commit> | tar -x -C /tmp/before
    python docs/bench/host_cost_ab.py --before /tmp/before --after . --cycles 4 --out docs/bench/host_cost_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from in_tree import run_in_tree


def one(sizes: tuple[int, ...], repetitions: int) -> None:
    """Runs inside the tree under test; prints one JSON line."""
    import neuron_async_sm
    from neuron_async_sm.bench.host_cost import host_cost_vs_batch

    report = host_cost_vs_batch(sizes, repetitions=repetitions, output_tokens=96)
    print("RESULT " + json.dumps({"tree": neuron_async_sm.__file__, **report}))


def invoke(tree: Path, sizes: str, repetitions: int) -> dict:
    return run_in_tree(__file__, tree, ["--sizes", sizes, "--repetitions", str(repetitions)], timeout_s=1800, nice=True)


def summary(results: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for tree, reports in results.items():
        for mode in ("sync", "async"):
            fits = [r["linear_fit"][mode] for r in reports]
            batches = [row["batch"] for row in reports[0]["rows"]]
            out[f"{tree}_{mode}"] = {
                "fixed_us": statistics.median(f["intercept_us"] for f in fits),
                "slope_us_per_request": statistics.median(f["slope_us_per_request"] for f in fits),
                "c_us_by_batch": {
                    b: statistics.median(
                        row[f"{mode}_host_us"] for r in reports for row in r["rows"] if row["batch"] == b
                    )
                    for b in batches
                },
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path)
    p.add_argument("--after", type=Path)
    p.add_argument("--cycles", type=int, default=4, help="pairs of invocations, order flipped every cycle")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--repetitions", type=int, default=3, help="round-robin repetitions inside one invocation")
    p.add_argument("--out", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(tuple(int(x) for x in args.sizes.split(",")), args.repetitions)
        return
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for cycle in range(args.cycles):
        for name in ("before", "after") if cycle % 2 == 0 else ("after", "before"):
            started = time.time()
            report = invoke(trees[name], args.sizes, args.repetitions)
            results[name].append(report)
            fit = report["linear_fit"]
            print(
                f"cycle {cycle} {name:6s} {time.time() - started:4.0f} s  "
                f"sync {fit['sync']['intercept_us']:4.0f} + {fit['sync']['slope_us_per_request']:5.2f}/req  "
                f"async {fit['async']['intercept_us']:4.0f} + {fit['async']['slope_us_per_request']:5.2f}/req",
                flush=True,
            )
    report = {"trees": {k: str(v) for k, v in trees.items()}, "summary": summary(results), "runs": results}
    for key, row in report["summary"].items():
        print(
            f"{key:13s} fixed {row['fixed_us']:4.0f} us + {row['slope_us_per_request']:5.2f} us/request; C by batch "
            + ", ".join(f"{b}: {c:.0f}" for b, c in row["c_us_by_batch"].items())
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
