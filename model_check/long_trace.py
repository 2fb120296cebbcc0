"""Record a long real trace and validate it: the figures of docs/spec.md's "Cost against trace length".

`python model_check/long_trace.py TRACE.ndjson [--requests 1250] [--check]` runs the benchmark's churn
workload (`bench --workload churn`'s runner and engine settings: relay on, 8 slots, device_time_ms=0)
with `--requests` requests, traced to TRACE.ndjson; 1,250 requests make ~10,000 logged events. With
`--check` it then validates the trace (`trace_check.check_trace`) and prints the verdict, the wall
time and the CPU time of this process and its children (TLC's JVMs) as one JSON line. Not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_check import check_trace, logged_events, read_trace  # noqa: E402


def record(path: Path, num_requests: int) -> None:
    """One churn run of `num_requests` requests on the benchmark's runner, traced to `path`."""
    from neuron_async_sm.bench.runner import ProbedLLM, batch_config
    from neuron_async_sm.bench.workloads import build_workload

    path.unlink(missing_ok=True)
    bench = ProbedLLM("tiny-llama", async_scheduling=True, trace_path=str(path), device_time_ms=0, **batch_config(8))
    try:
        bench.run(build_workload("churn", num_requests=num_requests))
    finally:
        bench.close()


def cpu_s() -> tuple[float, float]:
    """(user, sys) CPU seconds of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--requests", type=int, default=1250, help="churn requests (1,250: ~10,000 events)")
    parser.add_argument("--reuse", action="store_true", help="validate TRACE as it is, do not record it")
    parser.add_argument("--check", action="store_true", help="validate the trace and print the cost")
    args = parser.parse_args(argv)
    if not args.reuse:
        record(args.trace, args.requests)
    events = read_trace(args.trace)
    print(f"{args.trace}: {len(logged_events(events))} logged events", flush=True)
    if not args.check:
        return 0
    load, (user, sys_) = os.getloadavg(), cpu_s()
    started = time.perf_counter()
    verdict = check_trace(events, timeout_s=3600)
    wall = time.perf_counter() - started
    user2, sys2 = cpu_s()
    print(verdict.describe())
    figures = {
        "events": len(verdict.events),
        "accepted": verdict.accepted,
        "parts": verdict.parts,
        "distinct_states": verdict.distinct_states,
        "wall_s": round(wall, 1),
        "user_s": round(user2 - user, 1),
        "sys_s": round(sys2 - sys_, 1),
        "load_before": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(figures))
    return 0 if verdict.accepted else 1


if __name__ == "__main__":
    raise SystemExit(main())
