"""The D/C sweep: measured speedup of async over sync against the overlap limit (C + D) / max(C, D).

The device time is set with `device_time_ms` (the emulated runtime holds each program to that long),
so the program itself must be shorter than the smallest D of the sweep: the sweep runs the one-layer
`MICRO_LLAMA_CONFIG` checkpoint on a wide steady batch, where C is large and the program small.

1. Calibrate: a short sync run with no hold measures C (host time per step on the critical path).
2. For each requested ratio r, hold each program to r * C and run the sync/async comparison.
3. Report the ratio actually measured (D / C of that point's sync runs) beside the requested one:
   C drifts with the machine's load, and D has a floor (the program's own compute).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from neuron_async_sm.bench.checkpoint import MICRO_LLAMA_CONFIG, write_checkpoint
from neuron_async_sm.bench.runner import ProbedLLM, Progress, batch_config, compare_modes
from neuron_async_sm.bench.workloads import build_workload

DEFAULT_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
SWEEP_BATCH = 64


def ideal_speedup(ratio: float) -> float:
    """(C + D) / max(C, D) for D = ratio * C."""
    return (1 + ratio) / max(1.0, ratio)


def calibrate_host_ms(model: str, batch: int, output_tokens: int, **config: object) -> float:
    """C in ms: median host time per step of sync runs with no device hold."""
    workload = build_workload("steady", num_requests=batch, output_tokens=output_tokens)
    engine = ProbedLLM(model, async_scheduling=False, **config)
    try:
        engine.run(workload)  # warm-up
        return statistics.median(engine.run(workload)["host_ms_per_step"] for _ in range(3))
    finally:
        engine.close()


def run_sweep(
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
    *,
    batch: int = SWEEP_BATCH,
    output_tokens: int = 128,
    repetitions: int = 3,
    checkpoint_dir: str | None = None,
    progress: Progress | None = None,
    engine_options: dict | None = None,
) -> dict:
    """One comparison per ratio; JSON-ready. `engine_options`: more EngineConfig fields (e.g. device_cpu)."""
    with tempfile.TemporaryDirectory(prefix="neuron-async-sm-micro-") as tmp:
        model = str(write_checkpoint(Path(checkpoint_dir or tmp) / "micro-llama", MICRO_LLAMA_CONFIG))
        config = {**batch_config(batch), **(engine_options or {})}
        host_ms = calibrate_host_ms(model, batch, output_tokens, **config)
        if progress is not None:
            progress(f"calibrated C = {host_ms:.3f} ms/step at batch {batch}")
        workload = build_workload("steady", num_requests=batch, output_tokens=output_tokens)
        points = []
        for ratio in ratios:
            result = compare_modes(
                model, workload, repetitions=repetitions, device_time_ms=ratio * host_ms, progress=progress, **config
            )
            c = result.comparison
            points.append({
                "requested_ratio": ratio,
                "device_time_ms": ratio * host_ms,
                "D_over_C": c["D_over_C"],
                "C_ms": c["C_ms"],
                "D_ms": c["D_ms"],
                "speedup": c["speedup"],
                "ideal_speedup": c["ideal_speedup"],
                "ideal_speedup_at_ratio": ideal_speedup(c["D_over_C"]),
                "overlap_efficiency": c["overlap_efficiency"],
                "speedup_vs_ideal": c["speedup"] / c["ideal_speedup"],
                "async_step_fraction": result.async_["async_step_fraction"],
                "sync_step_ms": result.sync["step_ms"],
                "async_step_ms": result.async_["step_ms"],
            })  # fmt: skip
    return {
        "model": "micro-llama (1 layer, hidden 64; weights seeded like tiny-llama)",
        "batch": batch,
        "output_tokens": output_tokens,
        "calibrated_C_ms": host_ms,
        "points": points,
    }
