"""The D/C sweep: measured speedup of async over sync against the overlap limit (C + D) / max(C, D).

The device time is set with `device_time_ms` (the emulated runtime holds each program at least that
long), so the program itself must be shorter than the D asked for: the sweep runs the one-layer
`MICRO_LLAMA_CONFIG` checkpoint on a wide steady batch, where C is large and the program small.

1. Calibrate: sync runs with no hold measure C (host time per step) and the program's own time, the
   floor below which no hold can bring D.
2. For each requested ratio r, hold each program to r * C and run the sync/async comparison. A ratio
   whose hold would be under the floor cannot lower D, so it raises C instead: no hold, and each
   step's host work grows by a pure-Python spin (`StepProbe(host_extra_ms)`) to floor / r in all.
   One more point runs first with neither: the real compute, host and program as they are.
3. Report the ratio actually measured (D / C of that point's sync runs) beside the requested one:
   C drifts with the machine's load, and the hold overshoots a little (the device sleeps).

Each point's figures are medians over its alternating (sync, async) pairs; `pairs` keeps every pair's
own speedup, overlap efficiency, C and D (`pair_figures`), and `pairs_at_target` counts the counted
pairs whose efficiency reaches `EFFICIENCY_TARGET` (the target at D ~ C: 4 pairs of 5 reach it).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint
from neuron_async_sm.bench.metrics import pair_ratios
from neuron_async_sm.bench.runner import ModeComparison, ProbedLLM, Progress, batch_config, compare_modes
from neuron_async_sm.bench.workloads import Workload, build_workload

DEFAULT_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
SWEEP_BATCH = 256  # large steps: the device's fixed per-program cost is a small share of D
EFFICIENCY_TARGET = 0.95  # overlap efficiency at D ~ C, counted pair by pair


def ideal_speedup(ratio: float) -> float:
    """(C + D) / max(C, D) for D = ratio * C."""
    return (1 + ratio) / max(1.0, ratio)


def calibrate(model: str, workload: Workload, **config: object) -> tuple[float, float]:
    """(C, decode D) in ms with no hold, medians of three sync runs after a warm-up. D is the median
    program (a decode step), not the mean, which the one long prefill program would inflate."""
    engine = ProbedLLM(model, async_scheduling=False, **config)
    try:
        engine.run(workload)  # warm-up
        runs = [engine.run(workload) for _ in range(3)]
    finally:
        engine.close()
    return (statistics.median(r["host_ms_per_step"] for r in runs), statistics.median(r["device_ms_p50"] for r in runs))


def pair_figures(result: ModeComparison) -> list[dict]:
    """One row per (sync, async) pair the comparison ran, in run order, with that pair's own figures
    (`metrics.pair_ratios`, what `metrics.compare` takes medians of).

    `counted`: the pair is one of those the point's medians are over (the comparison's own per-pair
    lists, matched by value); `excluded`: the machine was busier than --max-other-cpu during it.
    """
    by_rep: dict[int, dict[str, dict]] = {}
    for run in result.runs:
        by_rep.setdefault(run["repetition"], {})[run["mode"]] = run
    counted = list(result.comparison["speedup_per_pair"])
    rows = []
    for rep in sorted(by_rep):
        s, a = by_rep[rep]["sync"], by_rep[rep]["async"]
        ratios = pair_ratios(s, a)
        speedup = ratios["speedup"]
        is_counted = speedup in counted
        if is_counted:
            counted.remove(speedup)
        rows.append(
            {
                "repetition": rep,
                "first": next(r["mode"] for r in result.runs if r["repetition"] == rep),
                "counted": is_counted,
                "excluded": s["excluded"] or a["excluded"],
                **ratios,
                "C_ms": s["host_ms_per_step"],  # the sync run's, as the point's C
                "D_ms": s["device_ms_per_step"],
                "D_over_C": s["device_ms_per_step"] / s["host_ms_per_step"],
                "O_ms": s["sync_overhead_ms_per_step"],
                "sync_step_ms": s["step_ms"],
                "async_step_ms": a["step_ms"],
                "async_C_ms": a["host_ms_per_step"],
                "async_D_ms": a["device_ms_per_step"],
                "async_device_idle_ms": a["device_idle_ms_per_step"],
                "async_device_overhead_ms": a["device_overhead_ms_per_step"],  # the device's own, per program
                "async_wait_ms": a["wait_ms_per_step"],  # the main thread blocked on an earlier step's output
                "other_cpu": max(s["other_cpu"], a["other_cpu"]),
                "load_avg": s["load_avg"],
            }
        )
    return rows


def run_sweep(
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    *,
    batch: int = SWEEP_BATCH,
    output_tokens: int = 64,
    repetitions: int = 3,
    checkpoint_dir: str | None = None,
    progress: Progress | None = None,
    engine_options: dict | None = None,
    max_other_cpu: float | None = None,
) -> dict:
    """One comparison per ratio; JSON-ready. `engine_options`: more EngineConfig fields (e.g. device_cpu)."""
    with tempfile.TemporaryDirectory(prefix="neuron-async-sm-micro-") as tmp:
        model = str(write_checkpoint(Path(checkpoint_dir or tmp) / "micro-llama", MICRO_LLAMA_CONFIG))
        config = {**batch_config(batch), **(engine_options or {})}
        workload = build_workload(
            "steady", num_requests=batch, output_tokens=output_tokens, vocab_size=MICRO_LLAMA_CONFIG.vocab_size
        )
        host_ms, floor_ms = calibrate(model, workload, **config)
        if progress is not None:
            progress(f"calibrated C = {host_ms:.3f} ms, program alone {floor_ms:.3f} ms per step")
        points = []
        # First the real compute (no hold, no extra host work), then each requested ratio.
        plan = [(None, 0.0, 0.0)]
        for ratio in sorted(ratios):
            hold = ratio * host_ms if ratio * host_ms > floor_ms else 0.0
            extra = 0.0 if hold else max(0.0, floor_ms / ratio - host_ms)  # D stays at the floor: raise C
            plan.append((ratio, hold, extra))
        for ratio, hold, extra in plan:
            result = compare_modes(
                model,
                workload,
                repetitions=repetitions,
                device_time_ms=hold,
                host_extra_ms=extra,
                max_other_cpu=max_other_cpu,
                progress=progress,
                **config,
            )
            c = result.comparison
            pairs = pair_figures(result)
            points.append(
                {
                    "kind": "device hold" if hold else "host spin" if extra else "real compute",
                    "requested_ratio": ratio,  # None: the real-compute point
                    "device_time_ms": hold,  # 0: under the program's own time, no hold
                    "host_extra_ms": extra,  # emulated extra host work per step (ratios under the floor)
                    "D_over_C": c["D_over_C"],
                    "C_ms": c["C_ms"],
                    "D_ms": c["D_ms"],
                    "O_ms": c["O_ms"],
                    "speedup": c["speedup"],
                    "ideal_speedup": c["ideal_speedup"],
                    "ideal_speedup_with_transport": c["ideal_speedup_with_transport"],
                    "overlap_efficiency": c["overlap_efficiency"],
                    "overlap_efficiency_with_transport": c["overlap_efficiency_with_transport"],
                    "speedup_vs_ideal": c["speedup"] / c["ideal_speedup"],
                    "async_step_fraction": result.async_["async_step_fraction"],
                    "sync_step_ms": result.sync["step_ms"],
                    "async_step_ms": result.async_["step_ms"],
                    "async_D_ms": result.async_["device_ms_per_step"],  # the program slows when the host runs beside it
                    "async_device_idle_ms": result.async_["device_idle_ms_per_step"],
                    "async_device_overhead_ms": result.async_["device_overhead_ms_per_step"],
                    "excluded_pairs": c["excluded_pairs"],
                    "other_cpu": [r["other_cpu"] for r in result.runs],
                    "pairs": pairs,  # every pair, in run order; `counted` ones make the medians above
                    "efficiency_target": EFFICIENCY_TARGET,
                    "pairs_counted": sum(p["counted"] for p in pairs),
                    "pairs_at_target": sum(
                        p["counted"] and p["overlap_efficiency"] >= EFFICIENCY_TARGET for p in pairs
                    ),
                }
            )
    return {
        "model": "micro-llama (1 layer, hidden 32, vocab 256; seeded random weights)",
        "batch": batch,
        "output_tokens": output_tokens,
        "calibrated_C_ms": host_ms,
        "program_alone_ms": floor_ms,
        "points": points,
    }
