"""Host cost per step: how C grows with the running batch and with the number of waiting requests.

C is the probe's host time per forward step (wall minus device waits) during steady decode; both
modes are measured (async: the engine main thread's share, the output thread runs beside it).
"""

from __future__ import annotations

import statistics

from neuron_async_sm.bench.probe import StepProbe
from neuron_async_sm.bench.runner import OtherLoad, ProbedLLM, Progress, batch_config, load_average
from neuron_async_sm.bench.workloads import build_workload
from neuron_async_sm.sampling_params import SamplingParams

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_WAITING = (0, 100, 1000, 10_000)
MODES = ("sync", "async")


def host_cost_vs_batch(
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    *,
    model: str = "tiny-llama",
    output_tokens: int = 96,
    repetitions: int = 5,
    progress: Progress | None = None,
    engine_options: dict | None = None,
    max_other_cpu: float | None = None,
) -> dict:
    """Median C (µs per step) per batch size and mode, on one engine per mode sized for the largest batch.

    Round robin: each repetition visits every batch size and mode once, so a slow spell of the shared
    machine spreads over all points instead of bending the curve at one of them.
    `max_other_cpu`: wait for a quiet second (see `OtherLoad.wait_for_quiet`) before each measurement.
    """
    config = {**batch_config(max(batch_sizes)), **(engine_options or {})}
    engines = {mode: ProbedLLM(model, async_scheduling=mode == "async", **config) for mode in MODES}
    workloads = {b: build_workload("steady", num_requests=b, output_tokens=output_tokens) for b in batch_sizes}
    runs: dict[tuple[int, str], list[dict]] = {(b, m): [] for b in batch_sizes for m in MODES}
    try:
        for workload in workloads.values():
            for engine in engines.values():
                engine.run(workload)  # warm-up: this batch size's first steps
        for rep in range(repetitions):
            for batch, workload in workloads.items():
                for mode, engine in engines.items():
                    OtherLoad.wait_for_quiet(max_other_cpu)
                    runs[batch, mode].append(engine.run(workload))
            if progress is not None:
                progress(f"round {rep + 1}/{repetitions} of {len(batch_sizes)} batch sizes")
    finally:
        for engine in engines.values():
            engine.close()
    rows = []
    for batch in batch_sizes:
        row: dict = {"batch": batch}
        for mode in MODES:
            mine = runs[batch, mode]
            row[f"{mode}_other_cpu"] = max(r["other_cpu"] for r in mine)
            row[f"{mode}_host_us"] = statistics.median(r["host_ms_p50"] for r in mine) * 1e3
            row[f"{mode}_host_us_mean"] = statistics.median(r["host_ms_per_step"] for r in mine) * 1e3
            row[f"{mode}_host_cpu_us"] = statistics.median(r["host_cpu_ms_per_step"] for r in mine) * 1e3
            for phase in ("schedule", "execute", "output"):
                row[f"{mode}_{phase}_us"] = statistics.median(r[f"{phase}_ms_p50"] for r in mine) * 1e3
            row[f"{mode}_device_us"] = statistics.median(r["device_ms_p50"] for r in mine) * 1e3
        rows.append(row)
    fits = {mode: linear_fit([r["batch"] for r in rows], [r[f"{mode}_host_us"] for r in rows]) for mode in MODES}
    return {
        "model": model,
        "output_tokens": output_tokens,
        "repetitions": repetitions,
        "rows": rows,
        "linear_fit": fits,
        "load_avg_end": load_average(),
    }


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares C = intercept + slope * batch; the worst point's distance from the line, relative."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    intercept = mean_y - slope * mean_x
    worst = max(abs(y - (intercept + slope * x)) / y for x, y in zip(xs, ys, strict=True))
    return {"intercept_us": intercept, "slope_us_per_request": slope, "max_relative_residual": worst}


def host_cost_vs_waiting(
    waiting_counts: tuple[int, ...] = DEFAULT_WAITING,
    *,
    model: str = "tiny-llama",
    running: int = 8,
    steps: int = 128,
    repetitions: int = 3,
    progress: Progress | None = None,
    engine_options: dict | None = None,
    max_other_cpu: float | None = None,
) -> dict:
    """Median C (µs per decode step) with `running` requests decoding and N more waiting for a slot.

    A fresh engine per measurement: the waiting requests never get a slot during the measured steps,
    and aborting thousands of them would measure abort, not the step. Round robin over the counts
    and modes, `repetitions` times; each point is the median of its repetitions' per-step medians.
    """
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {(w, m): [] for w in waiting_counts for m in MODES}
    for rep in range(repetitions):
        for waiting in waiting_counts:
            for mode in MODES:
                engine = ProbedLLM(
                    model, async_scheduling=mode == "async", max_num_seqs=running, **(engine_options or {})
                )
                try:
                    OtherLoad.wait_for_quiet(max_other_cpu)
                    samples[waiting, mode].append(_decode_host_us(engine, running, waiting, steps))
                finally:
                    engine.close()
        if progress is not None:
            progress(f"round {rep + 1}/{repetitions} of {len(waiting_counts)} waiting counts")
    rows = []
    for waiting in waiting_counts:
        row: dict = {"waiting": waiting}
        for mode in MODES:
            row[f"{mode}_host_us"] = statistics.median(median for median, _ in samples[waiting, mode])
            row[f"{mode}_host_us_mean"] = statistics.median(mean for _, mean in samples[waiting, mode])
            row[f"{mode}_host_us_each"] = [median for median, _ in samples[waiting, mode]]
        rows.append(row)
    return {
        "model": model,
        "running": running,
        "steps": steps,
        "repetitions": repetitions,
        "rows": rows,
        "load_avg_end": load_average(),
    }


def _decode_host_us(engine: ProbedLLM, running: int, waiting: int, steps: int) -> tuple[float, float]:
    """(median, mean) host µs per step over `steps` decode steps, measured after a warm-up run."""
    llm = engine.llm
    llm.generate([[3 + i, 4, 5] for i in range(running)], SamplingParams(max_tokens=32, ignore_eos=True))
    long = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(running):  # added first: they take every slot
        llm.add_request([3 + i, 4, 5, 6], long, f"run-{i}")
    for i in range(waiting):
        llm.add_request([7, 8, 9, 10 + i % 900], SamplingParams(max_tokens=4), f"wait-{i}")
    probe: StepProbe = engine.probe
    for _ in range(2):  # prefill, then the first decode (a shape change): not steady yet
        probe.turn(llm.step)
    probe.reset()
    for _ in range(steps):
        probe.turn(llm.step)
    host = [h for h, s in zip(probe.log.host_s, probe.log.steps, strict=True) if s]
    assert len(llm.engine.scheduler.waiting) == waiting, "a waiting request was admitted mid-measurement"
    return statistics.median(host) * 1e6, sum(host) / len(host) * 1e6
