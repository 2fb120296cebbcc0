"""Runs a workload on a sync and an async engine in one process, alternating, and compares them."""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from neuron_async_sm.bench.metrics import RequestTimes, compare, median_metrics, run_metrics
from neuron_async_sm.bench.probe import StepProbe
from neuron_async_sm.bench.workloads import Workload
from neuron_async_sm.engine.llm import LLM

Progress = Callable[[str], None]
"""Called after each run with a one-line summary (the CLI advances its progress bar)."""


def batch_config(max_num_seqs: int) -> dict:
    """Engine settings for a decode batch of up to `max_num_seqs`: power-of-two decode buckets up to it,
    and a token budget that admits every request's prompt in the first step."""
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_num_seqs) + (max_num_seqs,)
    budget = max(256, 32 * max_num_seqs)
    return {"max_num_seqs": max_num_seqs, "decode_buckets": buckets, "max_num_batched_tokens": budget,
            "prefill_buckets": (16, 32, 64, 128, 256, budget)}  # fmt: skip


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages of the machine (shared and noisy: recorded with each run)."""
    return [round(x, 2) for x in os.getloadavg()]


class ProbedLLM:
    """An LLM with a StepProbe attached, reused across repetitions (the device starts once)."""

    def __init__(self, model: str, **config: object) -> None:
        self.llm = LLM(model, **config)
        self.probe = StepProbe(self.llm.engine)
        self.async_scheduling = self.llm.config.async_scheduling
        self._runs = 0

    def run(self, workload: Workload) -> dict:
        """Drive the workload to completion turn by turn; the run's metrics."""
        llm, probe = self.llm, self.probe
        self._runs += 1
        before = llm.stats()
        pending = deque(sorted(workload.tagged(f"r{self._runs}"), key=lambda r: r.arrival_step))
        arrival: dict[str, float] = {}
        stamps: dict[str, list[float]] = {}
        gc.collect()
        probe.reset()
        load = load_average()
        started = time.perf_counter()
        turn = 0
        while pending or llm.has_unfinished_requests():
            while pending and pending[0].arrival_step <= turn:
                request = pending.popleft()
                rid = llm.add_request(request.prompt_token_ids, request.sampling_params, request.request_id)
                arrival[rid], stamps[rid] = time.perf_counter(), []
            if llm.has_unfinished_requests():
                deltas = probe.turn(llm.step)
                now = time.perf_counter()
                for delta in deltas:
                    stamps[delta.request_id].extend([now] * len(delta.new_token_ids))
                    if delta.error is not None:
                        raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
            turn += 1
        wall = time.perf_counter() - started
        requests = {rid: RequestTimes(arrival[rid], tuple(stamps[rid])) for rid in arrival}
        metrics = run_metrics(probe.log, probe.device_times(), requests, _counters(before, llm.stats()), wall)
        metrics["load_avg"] = load
        return metrics

    def close(self) -> None:
        self.probe.close()
        self.llm.close()


def _counters(before: dict, after: dict) -> dict:
    """The run's own counters: differences of the engine's cumulative ones."""
    out = {"async_scheduling": after["async_scheduling"]}
    if "state_counts" in after:
        out["async_steps"] = after["async_steps"] - before["async_steps"]
        out["sync_fallback_steps"] = after["sync_fallback_steps"] - before["sync_fallback_steps"]
        out["state_counts"] = {k: v - before["state_counts"][k] for k, v in after["state_counts"].items()}
    return out


@dataclass(frozen=True)
class ModeComparison:
    """Medians per mode and the comparison; `runs` keeps every repetition (in run order)."""

    sync: dict
    async_: dict
    comparison: dict
    runs: list[dict]

    def to_json(self) -> dict:
        """The issue's layout: {"sync", "async", "speedup", "ideal_speedup", "overlap_efficiency", ...}."""
        return {
            "sync": self.sync,
            "async": self.async_,
            **self.comparison,
            "async_step_fraction": self.async_["async_step_fraction"],
            "state_counts": self.async_["state_counts"],
            "runs": self.runs,
        }


def compare_modes(
    model: str,
    workload: Workload,
    *,
    repetitions: int,
    warmup: int = 1,
    progress: Progress | None = None,
    **config: object,
) -> ModeComparison:
    """Run `workload` on a sync and an async engine, alternating (ABBA order, so slow drift of the
    machine's load hits both modes alike), `repetitions` times each after `warmup` unrecorded runs."""
    engines = {mode: ProbedLLM(model, async_scheduling=mode == "async", **config) for mode in ("sync", "async")}
    try:
        for _ in range(warmup):
            for mode, engine in engines.items():
                metrics = engine.run(workload)
                if progress is not None:
                    progress(f"warm-up {mode} {metrics['step_ms']:.2f} ms/step")
        results: dict[str, list[dict]] = {"sync": [], "async": []}
        runs = []
        for rep in range(repetitions):
            order = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
            for mode in order:
                metrics = engines[mode].run(workload)
                results[mode].append(metrics)
                runs.append({"mode": mode, "repetition": rep, **metrics})
                if progress is not None:
                    progress(f"{mode} {metrics['step_ms']:.2f} ms/step, load {metrics['load_avg'][0]}")
    finally:
        for engine in engines.values():
            engine.close()
    comparison = compare(results["sync"], results["async"])
    return ModeComparison(median_metrics(results["sync"]), median_metrics(results["async"]), comparison, runs)
