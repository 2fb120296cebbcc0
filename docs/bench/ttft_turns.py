"""TTFT anatomy (docs/benchmarks.md, "The relay"): per request of a workload, the loop turns from its
arrival to its admission (the step that schedules its prompt) and to its first token, for sync, async
without the relay and async with it. Turn counts do not depend on the machine's load; the ms figures
do. Usage: python docs/bench/ttft_turns.py OUT.json [churn] [repetitions]"""

import json
import statistics
import sys
import time
from collections import Counter, deque

from neuron_async_sm.bench.runner import batch_config, load_average
from neuron_async_sm.bench.workloads import DEFAULT_NUM_REQUESTS, build_workload
from neuron_async_sm.engine.llm import LLM
from neuron_async_sm.model import load_model_config

MODES = {
    "sync": dict(async_scheduling=False),
    "async-norelay": dict(async_scheduling=True, async_relay=False),
    "async-relay": dict(async_scheduling=True, async_relay=True),
}


def run(llm, workload, tag):
    """Drive the workload as the bench does (arrivals by turn); per request (arrival turn, admission
    turn, first-token turn) and the arrival -> first token time in ms."""
    scheduler, turn = llm.engine.scheduler, 0
    admitted, arrived, first = {}, {}, {}
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        for new in out.scheduled_new_reqs:
            admitted[new.request_id] = turn
        return out

    scheduler.schedule = recording_schedule
    pending = deque(sorted(workload.tagged(tag), key=lambda r: r.arrival_step))
    try:
        while pending or llm.has_unfinished_requests():
            while pending and pending[0].arrival_step <= turn:
                r = pending.popleft()
                rid = llm.add_request(r.prompt_token_ids, r.sampling_params, r.request_id)
                arrived[rid] = (turn, time.perf_counter())
            if llm.has_unfinished_requests():
                for delta in llm.step():
                    if delta.new_token_ids and delta.request_id not in first:
                        first[delta.request_id] = (turn, time.perf_counter())
            turn += 1
    finally:
        scheduler.schedule = schedule
    return {
        "admission_turns": [admitted[r] - arrived[r][0] for r in arrived],
        "first_token_turns": [first[r][0] - arrived[r][0] for r in arrived],
        "ttft_ms": [(first[r][1] - arrived[r][1]) * 1e3 for r in arrived],
    }


def main(out_path, name="churn", reps=3):
    workload = build_workload(
        name, num_requests=DEFAULT_NUM_REQUESTS[name], vocab_size=load_model_config("tiny-llama").vocab_size
    )
    seqs = DEFAULT_NUM_REQUESTS[name] if name == "steady" else 8
    config = {**batch_config(seqs), "device_time_ms": 0.0, "device_threads": 1, "device_cpu": 1, "seed": 0}
    engines = {m: LLM("tiny-llama", **kw, **config) for m, kw in MODES.items()}
    runs = {m: [] for m in MODES}
    try:
        for m in MODES:
            run(engines[m], workload, f"w-{m}")  # warm-up
        for rep in range(reps):
            for m in list(MODES) if rep % 2 == 0 else list(MODES)[::-1]:
                runs[m].append(run(engines[m], workload, f"r{rep}-{m}"))
    finally:
        for e in engines.values():
            e.close()
    summary = {"workload": name, "repetitions": reps, "load_avg_end": load_average(), "modes": {}}
    for m, rs in runs.items():
        adm = rs[0]["admission_turns"]  # the turn counts are the same in every repetition
        assert all(r["admission_turns"] == adm and r["first_token_turns"] == rs[0]["first_token_turns"] for r in rs)
        ftt = rs[0]["first_token_turns"]
        summary["modes"][m] = {
            "admitted_late": sum(a > 0 for a in adm),
            "admission_turns_mean": statistics.mean(adm),
            "first_token_turns_p50": statistics.median(ftt),
            "first_token_turns_mean": statistics.mean(ftt),
            "ttft_ms_p50_per_rep": [statistics.median(r["ttft_ms"]) for r in rs],
            # per request, first-token turns here minus in sync: {difference: requests}
            "first_token_turns_vs_sync": dict(
                sorted(Counter(a - b for a, b in zip(ftt, runs["sync"][0]["first_token_turns"], strict=True)).items())
            ),
        }
    json.dump(summary, open(out_path, "w"), indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3] or ["churn"]), *[int(a) for a in sys.argv[3:4]])
