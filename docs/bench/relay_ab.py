"""Relay A/B (docs/benchmarks.md, "The relay"): sync, async without the relay, async with it, in one
invocation, rotating the order per repetition. Usage: python docs/bench/relay_ab.py OUT.json churn:5 ...
[--wait=SECONDS] (the longest wait for a quiet second before each repetition; 120 unless given)."""

import json
import statistics
import sys

from neuron_async_sm.bench.metrics import median_metrics
from neuron_async_sm.bench.runner import OtherLoad, ProbedLLM, batch_config, load_average
from neuron_async_sm.bench.workloads import DEFAULT_NUM_REQUESTS, build_workload
from neuron_async_sm.model import load_model_config

MODES = {
    "sync": dict(async_scheduling=False),
    "async-norelay": dict(async_scheduling=True, async_relay=False),
    "async-relay": dict(async_scheduling=True, async_relay=True),
}
KEYS = (
    "tokens_per_s",
    "step_ms",
    "host_ms_per_step",
    "device_ms_per_step",
    "device_idle_ms_per_step",
    "ttft_ms_p50",
    "tpot_ms_p50",
    "itl_ms_p99",
    "async_step_fraction",
)


def main(name, reps, wait_s=120.0):
    n = DEFAULT_NUM_REQUESTS[name]
    seqs = n if name == "steady" else 8
    workload = build_workload(name, num_requests=n, vocab_size=load_model_config("tiny-llama").vocab_size)
    config = {**batch_config(seqs), "device_time_ms": 0.0, "device_threads": 1, "device_cpu": 1, "seed": 0}
    engines = {m: ProbedLLM("tiny-llama", 0.0, **kw, **config) for m, kw in MODES.items()}
    runs = {m: [] for m in MODES}
    order = list(MODES)
    try:
        for m in order:
            engines[m].run(workload)  # warm-up
        for rep in range(reps):
            seq = order if rep % 2 == 0 else order[::-1]
            OtherLoad.wait_for_quiet(0.15, timeout_s=wait_s)
            for m in seq:
                runs[m].append(engines[m].run(workload))
    finally:
        for e in engines.values():
            e.close()
    med = {m: median_metrics(r) for m, r in runs.items()}
    out = {"workload": name, "repetitions": reps, "load_avg_end": load_average(), "modes": {}}
    for m in MODES:
        row = {k: med[m].get(k) for k in KEYS}
        row["other_cpu"] = [r["other_cpu"] for r in runs[m]]
        if m != "sync":
            sp = [s["busy_s"] / a["busy_s"] for s, a in zip(runs["sync"], runs[m], strict=True)]
            row["speedup_median"] = statistics.median(sp)
            row["speedups"] = sp
            row["state_counts"] = med[m]["state_counts"]
        out["modes"][m] = row
    return out


if __name__ == "__main__":
    waits = [float(a.split("=", 1)[1]) for a in sys.argv[2:] if a.startswith("--wait=")]
    specs = [a.split(":") for a in sys.argv[2:] if not a.startswith("--")]
    results = [main(w, int(r), *waits) for w, r in specs]
    json.dump(results, open(sys.argv[1], "w"), indent=2)
    for res in results:
        print(res["workload"])
        for m, row in res["modes"].items():
            shown = {
                k: (round(v, 3) if isinstance(v, float) else v)
                for k, v in row.items()
                if k not in ("speedups", "other_cpu")
            }
            print(f"  {m:14s}", shown)
