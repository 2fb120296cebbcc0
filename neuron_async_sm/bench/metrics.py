"""What one benchmark run measured, and how sync and async runs compare.

Times are per *engine busy time* (the sum of loop-turn wall times, as `EngineCore.stats()` counts
it), so the driver's own bookkeeping between turns is left out of both modes alike.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from neuron_async_sm.bench.probe import PHASES, TurnLog
from neuron_async_sm.worker.async_machine import SPEC_STEADY


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class RequestTimes:
    """Wall-clock stamps of one request (perf_counter seconds)."""

    arrival: float
    token_times: tuple[float, ...]  # one stamp per emitted token


def run_metrics(
    log: TurnLog,
    device_times: list[float],
    device_idle: list[float],
    requests: dict[str, RequestTimes],
    counters: dict,
    wall_s: float,
) -> dict:
    """The flat, JSON-ready metrics of one run (times in ms unless the name says otherwise)."""
    step_turns = [i for i, s in enumerate(log.steps) if s]
    steps = sum(log.steps)
    busy_s = sum(log.wall_s)
    tokens = sum(len(r.token_times) for r in requests.values())
    host = log.host_s
    host_per_step = [host[i] for i in step_turns]
    ttft = [(r.token_times[0] - r.arrival) * 1e3 for r in requests.values() if r.token_times]
    tpot = [
        (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) * 1e3
        for r in requests.values()
        if len(r.token_times) > 1
    ]
    itl = [(b - a) * 1e3 for r in requests.values() for a, b in itertools.pairwise(r.token_times)]
    # The first program's idle time is the gap since the previous run, not part of this one.
    idle_s = sum(device_idle[1:])
    metrics = {
        "requests": len(requests),
        "output_tokens": tokens,
        "steps": steps,
        "busy_s": busy_s,
        "wall_s": wall_s,
        "tokens_per_s": tokens / busy_s,
        "tokens_per_step": tokens / steps,  # emitted tokens per target step (the batch's, not a row's)
        "decode_steps": steps - counters["prompt_steps"],  # steps without a prompt chunk
        "steps_per_s": steps / busy_s,
        "step_ms": busy_s / steps * 1e3,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p99": percentile(itl, 99),
        # C: host time on the critical path, per forward step (turns without a step are tiny and counted in).
        "host_ms_per_step": sum(host) / steps * 1e3,
        "host_ms_p50": percentile(host_per_step, 50) * 1e3,
        "host_cpu_ms_per_step": sum(log.cpu_s) / steps * 1e3,  # main thread CPU time: C without preemption
        "wait_ms_per_step": sum(log.wait_s) / steps * 1e3,
        # D: program execution time inside the device process.
        "device_ms_per_step": sum(device_times) / len(device_times) * 1e3,
        "device_ms_p50": percentile(device_times, 50) * 1e3,
        # Device idle: time the device waited with nothing queued, per step. Near zero: the host
        # never held the device up.
        "device_idle_ms_per_step": idle_s / steps * 1e3,
        # The device's own cost per program beyond the program (receive, decode inputs, encode and
        # send the result): the rest of a step once program time and idle time are taken out.
        "device_overhead_ms_per_step": (busy_s - sum(device_times) - idle_s) / steps * 1e3,
        # Where C goes (medians over steps: a preempted step would dominate a mean).
        **{f"{p}_ms_p50": percentile([log.phase_s[p][i] for i in step_turns], 50) * 1e3 for p in PHASES},
        # Garbage collection during the run: a full (gen 2) collection stops the host for a long pause.
        "gc_ms": sum(log.gc_s) * 1e3,
        "gc_full_collections": log.gc_count[2],
    }
    if len(device_times) == steps and not counters.get("async_scheduling", False):
        # Sync: turn i ran step i, so C, D and the step's wait W pair up step by step. W - D = O is
        # the transport: messages, wake-ups, the host copy. Neither host work nor program execution.
        steps_cdo = [(host[i], d, log.wait_s[i] - d) for i, d in zip(step_turns, device_times, strict=True)]
        other = sum(host) - sum(c for c, _, _ in steps_cdo)  # turns that ran no step
        metrics["serial_s"] = sum(c + d for c, d, _ in steps_cdo) + other  # C + D, no overlap
        metrics["ideal_s"] = sum(max(c, d) for c, d, _ in steps_cdo) + other  # max(C, D): perfect overlap
        # Counting the transport as host-side time, the sync run is exactly serial; the bound is max(C + O, D).
        metrics["ideal_with_transport_s"] = sum(max(c + o, d) for c, d, o in steps_cdo) + other
        metrics["sync_overhead_ms_per_step"] = sum(o for _, _, o in steps_cdo) / steps * 1e3
    if "spec_decode" in counters:  # this run's num_spec_rows, num_draft_tokens, num_accepted_tokens
        spec = counters["spec_decode"]
        metrics.update(spec)
        metrics.update(spec_rates(spec))
    if "state_counts" in counters:
        metrics["async_steps"] = counters["async_steps"]
        metrics["sync_fallback_steps"] = counters["sync_fallback_steps"]
        metrics["state_counts"] = counters["state_counts"]
        metrics["launch_counts"] = counters["launch_counts"]
        metrics["async_step_fraction"] = counters["async_steps"] / steps
    return metrics


def spec_rates(counts: dict) -> dict:
    """From summed spec_decode counters: acceptance_rate, drafts accepted / drafts proposed, and
    tokens_per_spec_row, what a row that verified drafts emitted on average (its accepted drafts and
    one more: the recovered or bonus token). NaN where nothing was drafted."""
    rows, drafted, accepted = counts["num_spec_rows"], counts["num_draft_tokens"], counts["num_accepted_tokens"]
    return {
        "acceptance_rate": accepted / drafted if drafted else math.nan,
        "tokens_per_spec_row": (rows + accepted) / rows if rows else math.nan,
    }


def median_metrics(runs: list[dict]) -> dict:
    """Per-field median over repetitions; state counts are totals over them (medians would not add up)."""
    out: dict = {"repetitions": len(runs), "steps_total": sum(r["steps"] for r in runs)}
    for key, value in runs[0].items():
        if isinstance(value, (str, bool)):
            continue  # labels of a run (mode, excluded)
        if isinstance(value, dict):
            out[key] = {k: sum(r[key][k] for r in runs) for k in value}
        elif isinstance(value, list):
            out[key] = [r[key] for r in runs]  # e.g. the load average of each run
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def pair_ratios(s: dict, a: dict) -> dict:
    """One (sync, async) pair's speedup, ideal_speedup and overlap_efficiency, plain and with the
    transport counted as host time (the definitions are `compare`'s)."""
    return {
        "speedup": s["busy_s"] / a["busy_s"],
        "ideal_speedup": s["serial_s"] / s["ideal_s"],
        "overlap_efficiency": (s["busy_s"] - a["busy_s"]) / (s["busy_s"] - s["ideal_s"]),
        "ideal_speedup_with_transport": s["busy_s"] / s["ideal_with_transport_s"],
        "overlap_efficiency_with_transport": (s["busy_s"] - a["busy_s"]) / (s["busy_s"] - s["ideal_with_transport_s"]),
    }


def compare(sync_runs: list[dict], async_runs: list[dict]) -> dict:
    """speedup, ideal_speedup and overlap_efficiency: medians over the alternating (sync, async) pairs.

    speedup = T_sync / T_async; ideal_speedup = sum(C + D) / sum(max(C, D)) over the sync run's steps
    ((C + D) / max(C, D) when every step costs the same); overlap_efficiency =
    (T_sync - T_async) / (T_sync - T_ideal) with T_ideal = sum(max(C, D)).
    """
    ratios = [pair_ratios(s, a) for s, a in zip(sync_runs, async_runs, strict=True)]
    speedup = [r["speedup"] for r in ratios]
    ideal = [r["ideal_speedup"] for r in ratios]
    efficiency = [r["overlap_efficiency"] for r in ratios]
    bound = [r["ideal_speedup_with_transport"] for r in ratios]
    bound_efficiency = [r["overlap_efficiency_with_transport"] for r in ratios]
    c = statistics.median(s["host_ms_per_step"] for s in sync_runs)
    d = statistics.median(s["device_ms_per_step"] for s in sync_runs)
    return {
        "speedup": statistics.median(speedup),
        "ideal_speedup": statistics.median(ideal),
        "overlap_efficiency": statistics.median(efficiency),
        "C_ms": c,  # host time per step on the critical path, sync run
        "D_ms": d,  # device time per step, sync run
        "O_ms": statistics.median(s["sync_overhead_ms_per_step"] for s in sync_runs),  # transport, sync run
        "D_over_C": d / c,
        # The same two figures with the transport O counted as host-side time: (C + O + D) / max(C + O, D).
        # The sync run pays O every step and async hides it too, so only this bound is an upper bound.
        "ideal_speedup_with_transport": statistics.median(bound),
        "overlap_efficiency_with_transport": statistics.median(bound_efficiency),
        "speedup_per_pair": speedup,
        "overlap_efficiency_per_pair": efficiency,
    }


def speculation(groups: list[dict[str, dict]]) -> dict:
    """The spec engines' figures over the kept repetitions, each a group of runs by engine name
    (runner.MODES and runner.SPEC_MODES: "sync", "async", "sync_spec", "async_spec").

    - "sync", "async": the spec engines' medians; then `compare`'s figures for them (async against
      sync with speculation, against the same run's ideal: C and D of a spec step, D the target's
      verification and the drafter's passes, one program).
    - "spec_over_none": per mode, tokens/s with speculation / without, per repetition (both ran in
      it) and their median and range.
    - per mode, over every kept run: "acceptance_rate" and "tokens_per_spec_row" (`spec_rates`),
      "tokens_per_step" without and with speculation (emitted tokens / target steps).
    - "spec_steady_fraction": the async spec engine's SpecSteady steps / its decode steps.
    """
    sync, async_ = [g["sync_spec"] for g in groups], [g["async_spec"] for g in groups]
    out: dict = {"sync": median_metrics(sync), "async": median_metrics(async_), **compare(sync, async_)}
    out["spec_over_none"], out["tokens_per_step"] = {}, {}
    out["acceptance_rate"], out["tokens_per_spec_row"] = {}, {}
    for mode in ("sync", "async"):
        ratios = [g[f"{mode}_spec"]["tokens_per_s"] / g[mode]["tokens_per_s"] for g in groups]
        out["spec_over_none"][mode] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "per_repetition": ratios,
        }
        spec_runs = [g[f"{mode}_spec"] for g in groups]
        totals = {k: sum(r[k] for r in spec_runs) for k in ("num_spec_rows", "num_draft_tokens", "num_accepted_tokens")}
        rates = spec_rates(totals)
        out["acceptance_rate"][mode] = rates["acceptance_rate"]
        out["tokens_per_spec_row"][mode] = rates["tokens_per_spec_row"]
        out["tokens_per_step"][mode] = {
            spec: sum(g[name]["output_tokens"] for g in groups) / sum(g[name]["steps"] for g in groups)
            for spec, name in (("none", mode), ("spec", f"{mode}_spec"))
        }
    counts = out["async"]["state_counts"]
    out["state_counts"] = counts
    out["decode_steps"] = sum(r["decode_steps"] for r in async_)  # the async spec engine's, every kept run
    out["spec_steady_fraction"] = counts[SPEC_STEADY] / out["decode_steps"]
    return out
