"""Runs a workload on a sync and an async engine in one process, alternating, and compares them."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from neuron_async_sm.bench.metrics import RequestTimes, compare, median_metrics, run_metrics, speculation
from neuron_async_sm.bench.probe import StepProbe
from neuron_async_sm.bench.workloads import Workload
from neuron_async_sm.config import SpeculativeConfig
from neuron_async_sm.engine.llm import LLM, Turn
from neuron_async_sm.worker.async_machine import ASYNC_STATES

Progress = Callable[[str], None]
"""Called after each run with a one-line summary (the CLI advances its progress bar)."""


def batch_config(max_num_seqs: int) -> dict:
    """Engine settings for a decode batch of up to `max_num_seqs`: power-of-two decode buckets up to it,
    and a token budget that admits every request's prompt in the first step."""
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_num_seqs) + (max_num_seqs,)
    budget = max(256, 32 * max_num_seqs)
    return {
        "max_num_seqs": max_num_seqs,
        "decode_buckets": buckets,
        "max_num_batched_tokens": budget,
        "prefill_buckets": (16, 32, 64, 128, 256, budget),
    }


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages of the machine (shared and noisy: recorded with each run)."""
    return [round(x, 2) for x in os.getloadavg()]


class OtherLoad:
    """The share of the machine's CPU time that other processes used during a run (Linux /proc).

    The load average lags by a minute; this is exact to a clock tick over the run itself: CPU time
    of every CPU, minus this process (all its threads) and the device process, over wall time x CPUs.
    """

    def __init__(self, pids: list[int | None]) -> None:
        self._pids = [p for p in pids if p is not None]
        self._start = self._snapshot()

    @staticmethod
    def _busy_ticks() -> int | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    def _own_ticks(self) -> int:
        total = 0
        for pid in ["self", *self._pids]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime, all threads
            except (OSError, ValueError, IndexError):
                pass
        return total

    def _snapshot(self) -> tuple[float, int | None, int]:
        return time.perf_counter(), self._busy_ticks(), self._own_ticks()

    @staticmethod
    def wait_for_quiet(max_share: float | None, timeout_s: float = 120.0, window_s: float = 1.0) -> float:
        """Block until other processes used at most `max_share` of the CPUs over one window (or the
        timeout passed); the last window's share. `max_share=None`: do not wait (NaN)."""
        if max_share is None:
            return float("nan")
        deadline = time.perf_counter() + timeout_s
        while True:
            probe = OtherLoad([])
            time.sleep(window_s)
            share = probe.share()
            if not share > max_share or time.perf_counter() > deadline:  # NaN (no /proc): do not wait
                return share

    def share(self) -> float:
        """Other processes' share of all CPUs since construction (NaN where /proc is missing)."""
        start, busy, own = self._start
        end, busy_now, own_now = self._snapshot()
        if busy is None or busy_now is None or end <= start:
            return float("nan")
        ticks = os.sysconf("SC_CLK_TCK") * (end - start) * (os.cpu_count() or 1)
        return max(0.0, (busy_now - busy - (own_now - own)) / ticks)


def split_native_threads(device_cpu: int | None) -> None:
    """Give this process's native threads `device_cpu` and its Python threads every other CPU; None:
    every thread may run anywhere. For a device computed in this process on the host's own CPUs
    (--device xla on PJRT's CPU client, whose execution and Eigen pools are native threads), as the
    emulated device process is pinned with `device_cpu`: the device's compute no longer preempts the
    thread that traces the next step. Threads started later inherit their creator's CPUs, so call
    it before each run."""
    cpus = set(range(os.cpu_count() or 1))
    python = {t.native_id for t in threading.enumerate()}
    for tid in map(int, os.listdir("/proc/self/task")):
        if device_cpu is None:
            target = cpus
        else:
            target = cpus - {device_cpu} if tid in python else {device_cpu}
        try:
            os.sched_setaffinity(tid, target)
        except OSError:
            pass  # the thread ended meanwhile


class ProbedLLM:
    """An LLM with a StepProbe attached, reused across repetitions (the device starts once).

    `host_extra_ms` emulates a heavier host (the D/C sweep): see StepProbe. `native_cpu`: before each
    run, `split_native_threads(native_cpu)` (an in-process device on the host's CPUs; None: no pinning).
    """

    def __init__(self, model: str, host_extra_ms: float = 0.0, native_cpu: int | None = None, **config: object) -> None:
        self.probe = StepProbe(host_extra_ms)
        self.llm = LLM(model, **config)
        self.probe.attach(self.llm.engine)
        self.async_scheduling = self.llm.config.async_scheduling
        self.native_cpu = native_cpu
        self._runs = 0

    def run(self, workload: Workload) -> dict:
        """Drive the workload to completion turn by turn; the run's metrics."""
        llm, probe = self.llm, self.probe
        self._runs += 1
        before = llm.stats()
        arrival: dict[str, float] = {}
        stamps: dict[str, list[float]] = {}
        if self.native_cpu is not None:
            split_native_threads(self.native_cpu)
        gc.collect()
        probe.reset()
        load = load_average()
        other = OtherLoad([getattr(llm.engine.runtime, "device_pid", None)])  # None: the device is this process

        def arrived(turn: Turn) -> None:
            if turn.rejected:
                request, exc = turn.rejected[0]
                raise RuntimeError(f"request {request.request_id} rejected: {exc}")
            now = time.perf_counter()
            for request in turn.admitted:
                arrival[request.request_id], stamps[request.request_id] = now, []

        tagged = workload.tagged(f"r{self._runs}")
        started = time.perf_counter()
        for turn in llm.turns(tagged, before_step=arrived, step=lambda: probe.turn(llm.step)):
            now = time.perf_counter()
            for delta in turn.deltas:
                stamps[delta.request_id].extend([now] * len(delta.new_token_ids))
                if delta.error is not None:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
        wall = time.perf_counter() - started
        requests = {rid: RequestTimes(arrival[rid], tuple(stamps[rid])) for rid in arrival}
        counters = _counters(before, llm.stats())
        metrics = run_metrics(probe.log, probe.device_times(), probe.device_idle_times(), requests, counters, wall)
        metrics["load_avg"] = load
        metrics["other_cpu"] = other.share()
        return metrics

    def close(self) -> None:
        self.probe.close()
        self.llm.close()


def _counters(before: dict, after: dict) -> dict:
    """The run's own counters: differences of the engine's cumulative ones."""
    out = {
        "async_scheduling": after["async_scheduling"],
        "prompt_steps": after["prompt_steps"] - before["prompt_steps"],
    }
    if "spec_decode" in after:  # num_spec_rows, num_draft_tokens, num_accepted_tokens
        out["spec_decode"] = {k: v - before["spec_decode"][k] for k, v in after["spec_decode"].items()}
    if "state_counts" in after:
        out["async_steps"] = after["async_steps"] - before["async_steps"]
        out["sync_fallback_steps"] = after["sync_fallback_steps"] - before["sync_fallback_steps"]
        out["state_counts"] = {k: v - before["state_counts"][k] for k, v in after["state_counts"].items()}
        out["launch_counts"] = {k: v - before["launch_counts"][k] for k, v in after["launch_counts"].items()}
    return out


@dataclass(frozen=True)
class ModeComparison:
    """Medians per mode and the comparison; `runs` keeps every repetition (in run order).
    `speculation`: with a speculative config, the spec engines' figures (`metrics.speculation`)."""

    sync: dict
    async_: dict
    comparison: dict
    runs: list[dict]
    speculation: dict | None = None

    def to_json(self) -> dict:
        """The issue's layout: {"sync", "async", "speedup", "ideal_speedup", "overlap_efficiency", ...}."""
        counts = self.async_["state_counts"]
        out = {
            "sync": self.sync,
            "async": self.async_,
            **self.comparison,
            # Over every recorded async run: async (Steady and Relay) steps / all steps, and the steps per path state.
            "async_step_fraction": sum(counts[s] for s in ASYNC_STATES) / self.async_["steps_total"],
            "state_counts": counts,
            # structured output: steps with a masked row, by when they sampled (SampleDeferred: after
            # the step in flight was applied)
            "launch_counts": self.async_["launch_counts"],
            "deferred_step_fraction": self.async_["launch_counts"]["SampleDeferred"] / self.async_["steps_total"],
            "runs": self.runs,
        }
        if self.speculation is not None:
            out["speculation"] = self.speculation
        return out


MODES = ("sync", "async")
SPEC_MODES = ("sync_spec", "async_spec")
"""Engine names of the comparison: each mode without speculation, then with it (a speculative config)."""


def compare_modes(
    model: str,
    workload: Workload,
    *,
    repetitions: int,
    warmup: int = 1,
    max_other_cpu: float | None = None,
    host_extra_ms: float = 0.0,
    native_cpu: int | None = None,
    progress: Progress | None = None,
    speculative_config: SpeculativeConfig | None = None,
    **config: object,
) -> ModeComparison:
    """Run `workload` on a sync and an async engine, and with `speculative_config` on a sync and an
    async engine that speculate too, one run of each per repetition in an order that rotates by one
    engine every repetition (two engines: ABBA), so slow drift of the machine's load hits every
    engine alike; `repetitions` times each after `warmup` unrecorded runs.

    On a shared machine, `max_other_cpu` waits (up to 2 minutes) for a quiet second before each
    repetition and keeps only repetitions during which other processes used at most that share of
    the CPUs; a busy one is recorded as excluded and run again, up to 5 x `repetitions` in all
    (then the quietest are kept). `native_cpu`: see ProbedLLM.
    """
    plans = {mode: {"async_scheduling": mode == "async"} for mode in MODES}
    if speculative_config is not None:
        # The relay is off under speculation (EngineConfig says so in a warning): asked off, no warning.
        spec = {"speculative_config": speculative_config, "async_relay": False}
        plans.update({name: {**plans[mode], **spec} for mode, name in zip(MODES, SPEC_MODES, strict=True)})
    engines = {name: ProbedLLM(model, host_extra_ms, native_cpu, **{**config, **plan}) for name, plan in plans.items()}
    names = list(engines)
    try:
        for _ in range(warmup):
            for name, engine in engines.items():
                metrics = engine.run(workload)
                if progress is not None:
                    progress(f"warm-up {name} {metrics['step_ms']:.2f} ms/step")
        groups: list[dict[str, dict]] = []
        runs = []
        attempts = 5 * repetitions if max_other_cpu is not None else repetitions
        for rep in range(attempts):
            turn = rep % len(names)
            order = names[turn:] + names[:turn]
            OtherLoad.wait_for_quiet(max_other_cpu)
            group = {name: engines[name].run(workload) for name in order}
            busy = max(m["other_cpu"] for m in group.values())
            excluded = max_other_cpu is not None and not busy <= max_other_cpu
            for name in order:
                runs.append({"mode": name, "repetition": rep, "excluded": excluded, **group[name]})
                if progress is not None:
                    progress(f"{name} {group[name]['step_ms']:.2f} ms/step, others {group[name]['other_cpu']:.0%}")
            if not excluded:
                groups.append(group)
                if len(groups) == repetitions:
                    break
    finally:
        for engine in engines.values():
            engine.close()
        if native_cpu is not None:
            split_native_threads(None)
    if len(groups) < repetitions:  # the machine never calmed down: keep the quietest repetitions
        by_quiet = sorted(_groups(runs), key=lambda g: max(m["other_cpu"] for m in g.values()))
        groups = by_quiet[:repetitions]
    sync, async_ = [g["sync"] for g in groups], [g["async"] for g in groups]
    comparison = compare(sync, async_)
    comparison["excluded_pairs"] = sum(r["excluded"] for r in runs) // len(names)  # repetitions redone
    spec = speculation(groups) if speculative_config is not None else None
    return ModeComparison(median_metrics(sync), median_metrics(async_), comparison, runs, spec)


def _groups(runs: list[dict]) -> list[dict[str, dict]]:
    groups: dict[int, dict[str, dict]] = {}
    for run in runs:
        groups.setdefault(run["repetition"], {})[run["mode"]] = run
    return list(groups.values())
