"""Where the host's fixed cost per step goes: CPU time of the engine's main thread per decode step.

Load-independent measures (the machine is shared): `time.thread_time()` of the main thread per loop
turn (a preempted thread accrues no CPU time; waits on the device cost none), and a cProfile of the
main thread alone (the profiler hooks only the thread that enables it). Steady decode of tiny-llama at
a small batch, sync and async, one engine each. The trees may alternate: run once per tree, or give
several trees (`--trees a b a b`): each run is a fresh process importing that tree's package.

    python docs/bench/host_fixed_profile.py --trees /tmp/before . /tmp/before . --out docs/bench/host_fixed_cpu.json
    python docs/bench/host_fixed_profile.py --profile async --batch 1   # top functions by own time
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

from in_tree import run_in_tree


def _engine(mode: str, batch: int):
    from neuron_async_sm import LLM

    return LLM(
        "tiny-llama",
        async_scheduling=mode == "async",
        max_num_seqs=max(batch, 1),
        decode_buckets=(max(batch, 1),),
        max_num_batched_tokens=256,
    )


def _decode_turns(
    llm, batch: int, steps: int, tag: str, profile: cProfile.Profile | None = None, process: list | None = None
) -> list[float]:
    """Main-thread CPU µs of each of `steps` steady decode turns (after the prefill and first decodes);
    `process` gets the host process's CPU µs per turn over them all (every host thread: the main one, the
    async output thread, the runtime's receiver), which is what the host's one core pays per step."""
    from neuron_async_sm import SamplingParams

    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        llm.add_request([3 + i, 4, 5, 6], params, f"{tag}-{i}")
    for _ in range(4):  # prefill, the first decode (shape change), async's fill of the batch queue
        llm.step()
    cpu = []
    if profile is not None:
        profile.enable()
    process_start = time.process_time()
    for _ in range(steps):
        start = time.thread_time()
        llm.step()
        cpu.append((time.thread_time() - start) * 1e6)
    if process is not None:
        process.append((time.process_time() - process_start) / steps * 1e6)
    if profile is not None:
        profile.disable()
    while llm.has_unfinished_requests():
        llm.step()
    return cpu


def one(batch: int, steps: int, rounds: int) -> dict:
    """Inside the tree under test: both modes, `rounds` alternating runs each; per-run medians."""
    import neuron_async_sm

    engines = {mode: _engine(mode, batch) for mode in ("sync", "async")}
    runs: dict[str, list[float]] = {"sync": [], "async": []}
    process: dict[str, list[float]] = {"sync": [], "async": []}
    try:
        for mode, llm in engines.items():
            _decode_turns(llm, batch, 32, f"warm-{mode}")
        for r in range(rounds):
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                turns = _decode_turns(engines[mode], batch, steps, f"r{r}-{mode}", process=process[mode])
                runs[mode].append(statistics.median(turns))
    finally:
        for llm in engines.values():
            llm.close()
    return {
        "tree": neuron_async_sm.__file__,
        "batch": batch,
        "steps": steps,
        "cpu_us_median_per_run": runs,
        "cpu_us": {m: statistics.median(v) for m, v in runs.items()},
        "process_cpu_us_mean_per_run": process,
        "process_cpu_us": {m: statistics.median(v) for m, v in process.items()},
        "load": os.getloadavg(),
    }


def profile(mode: str, batch: int, steps: int, top: int) -> None:
    llm = _engine(mode, batch)
    try:
        _decode_turns(llm, batch, 32, "warm")
        prof = cProfile.Profile()
        cpu = _decode_turns(llm, batch, steps, "prof", prof)
    finally:
        llm.close()
    print(f"{mode} batch {batch}: main-thread CPU per turn (profiled) median {statistics.median(cpu):.0f} µs")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="*", type=Path, default=[])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", choices=("sync", "async"))
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.profile:
        profile(args.profile, args.batch, args.steps, args.top)
        return
    if args.one:
        print("RESULT " + json.dumps(one(args.batch, args.steps, args.rounds)))
        return
    results = []
    for tree in args.trees or [Path(".")]:
        tree = tree.resolve()
        flags = ["--batch", str(args.batch), "--steps", str(args.steps), "--rounds", str(args.rounds)]
        report = run_in_tree(__file__, tree, flags, timeout_s=1800)
        results.append(report)
        main_us = {m: round(v) for m, v in report["cpu_us"].items()}
        process_us = {m: round(v) for m, v in report["process_cpu_us"].items()}
        load = report["load"]
        print(f"{tree}: CPU µs per step, main thread {main_us}, process {process_us} (load {load})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
