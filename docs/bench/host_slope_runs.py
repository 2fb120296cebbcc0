"""Per invocation of a host_cost_ab.py report: C at batch 1, 8 and 64, C64/C1, the fit, and the load.

host_cost_ab.py summarizes medians over the invocations; this prints each one, so that a slow spell
(other processes' CPU share, `other_cpu`, up to 1.0 of the machine) can be told apart from the trees:

    python docs/bench/host_slope_runs.py docs/bench/host_slope_ab.json
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    report = json.loads(open(sys.argv[1]).read())
    for tree, runs in report["runs"].items():
        for i, run in enumerate(runs):
            c = {row["batch"]: row for row in run["rows"]}
            other = max(max(row["sync_other_cpu"], row["async_other_cpu"]) for row in run["rows"])
            cells = []
            for mode in ("sync", "async"):
                fit = run["linear_fit"][mode]
                c1, c8, c64 = (c[b][f"{mode}_host_us"] for b in (1, 8, 64))
                cells.append(
                    f"{mode} {fit['intercept_us']:4.0f} + {fit['slope_us_per_request']:4.2f}/req, "
                    f"C1 {c1:4.0f} C8 {c8:4.0f} C64 {c64:4.0f} C64/C1 {c64 / c1:4.2f}"
                )
            load = f"other_cpu <= {other:.2f}, load {run['load_avg_end']}"
            print(f"{tree:6s} #{i}  " + "  |  ".join(cells) + "  |  " + load)
    for key, row in report["summary"].items():
        c = {int(b): v for b, v in row["c_us_by_batch"].items()}
        print(
            f"{key:13s} median: fixed {row['fixed_us']:4.0f} us + {row['slope_us_per_request']:4.2f} us/request, "
            f"C1 {c[1]:4.0f} C8 {c[8]:4.0f} C64 {c[64]:4.0f}, C64/C1 {c[64] / c[1]:4.2f}"
        )


if __name__ == "__main__":
    main()
