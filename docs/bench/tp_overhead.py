"""TP=2 against TP=1 on one machine: the same tokens, and what the split costs (not a speedup here).

Four engines at once (TP=1 / TP=2, sync / async, `--device cpu`, the `mp` backend, float64), one
workload (8 requests, 16-token prompts, 64 tokens each, greedy and sampled mixed), run on each engine
in turn, `--pairs` times, alternating, in one invocation. Reports tokens/s per run, medians, the
TP=2 / TP=1 ratio per pair, and whether every run's tokens equal TP=1's.

    .venv/bin/python docs/bench/tp_overhead.py --pairs 5 --json docs/bench/tp_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from neuron_async_sm import LLM, PromptRequest, SamplingParams

ENGINE = dict(dtype="float64", max_num_seqs=8, max_model_len=128)


def workload() -> list[PromptRequest]:
    return [
        PromptRequest(
            [3 + (i * 37 + j * 11) % 1000 for j in range(16)],
            SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i),
            f"r{i}",
        )
        for i in range(8)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    requests = workload()
    names = [(mode, tp) for mode in ("sync", "async") for tp in (1, 2)]
    engines = {
        (mode, tp): LLM("tiny-llama", async_scheduling=mode == "async", tensor_parallel_size=tp, **ENGINE)
        for mode, tp in names
    }
    runs: dict[str, list[float]] = {f"{mode} tp{tp}": [] for mode, tp in names}
    same = True
    load = [os.getloadavg()]
    try:
        for llm in engines.values():
            llm.generate(requests[:2])  # warm: first-step allocations, thread start-up
        for _ in range(args.pairs):
            reference = None
            for mode, tp in names:
                started = time.perf_counter()
                outputs = engines[(mode, tp)].generate(requests)
                elapsed = time.perf_counter() - started
                tokens = [o.output_token_ids for o in outputs]
                reference = tokens if reference is None else reference
                same &= tokens == reference
                runs[f"{mode} tp{tp}"].append(sum(map(len, tokens)) / elapsed)
            load.append(os.getloadavg())
    finally:
        for llm in engines.values():
            llm.close()
    report = {
        "tokens_per_s": runs,
        "median_tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "tp2_over_tp1_per_pair": {
            mode: [b / a for a, b in zip(runs[f"{mode} tp1"], runs[f"{mode} tp2"], strict=True)]
            for mode in ("sync", "async")
        },
        "tokens_identical_in_every_run": same,
        "load_average_1_5_15": load,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
