"""Compiled programs per bucket against eager (issue 15, item 3): one invocation, alternating runs.

Two engines live side by side on the same config (async, the emulated device process): `enforce_eager`
True and False. For each batch size, B prompts of 32 tokens decode 64 greedy tokens; the engines
alternate (eager, compiled, eager, ...) so a slow spell of the shared machine hits both. Reported:
medians of tokens/s, of the device time per program (D: what compiling can shorten) and their
ratios; the compiled engine's start-up (compile) time and its compilations while serving.

    python docs/bench/compiled_ab.py --batches 1,8,64 --repetitions 5 --out docs/bench/compiled_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from neuron_async_sm import LLM, SamplingParams

PROMPT, NEW = 32, 64


def config(max_batch: int) -> dict:
    # One prefill length (32, the prompt) and a budget of one prompt per step: the prefill graphs are
    # rows 1 and symbolic rows at that length; decode buckets 1, 8, .., max_batch.
    buckets = tuple(sorted({1, 8, max_batch}))
    return dict(
        max_num_seqs=max_batch,
        decode_buckets=buckets,
        prefill_buckets=(PROMPT,),
        max_num_batched_tokens=PROMPT,
        max_model_len=PROMPT + NEW + 8,
    )


def run(llm: LLM, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
    llm.engine.runtime.reset_stats()
    started = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
    elapsed = time.perf_counter() - started
    stats = llm.engine.runtime.stats()
    return elapsed, stats.device_time_s / max(1, stats.programs_completed), [o.output_token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = config(max(batches))
    t0 = time.perf_counter()
    eager = LLM("tiny-llama", **cfg)
    eager_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = LLM("tiny-llama", enforce_eager=False, **cfg)
    compiled_start = time.perf_counter() - t0
    print(f"start-up: eager {eager_start:.1f} s, compiled {compiled_start:.1f} s, load {os.getloadavg()}", flush=True)
    rows = []
    try:
        for batch in batches:
            rng = random.Random(batch)
            prompts = [[rng.randrange(3, 1024) for _ in range(PROMPT)] for _ in range(batch)]
            run(eager, prompts[:2])
            run(compiled, prompts[:2])  # warm
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            device: dict[str, list[float]] = {"eager": [], "compiled": []}
            same = True
            for _ in range(args.repetitions):
                e, de, te = run(eager, prompts)
                c, dc, tc = run(compiled, prompts)
                times["eager"].append(e)
                times["compiled"].append(c)
                device["eager"].append(de)
                device["compiled"].append(dc)
                same = same and te == tc
            row = {
                "batch": batch,
                "eager_tokens_per_s": batch * NEW / statistics.median(times["eager"]),
                "compiled_tokens_per_s": batch * NEW / statistics.median(times["compiled"]),
                "eager_device_ms_per_program": 1e3 * statistics.median(device["eager"]),
                "compiled_device_ms_per_program": 1e3 * statistics.median(device["compiled"]),
                "pair_ratios_tokens_per_s": [e / c for e, c in zip(times["eager"], times["compiled"], strict=True)],
                "same_tokens_float32": same,
                "load_avg": list(os.getloadavg()),
            }
            row["ratio_tokens_per_s"] = row["compiled_tokens_per_s"] / row["eager_tokens_per_s"]
            row["ratio_device_time"] = row["eager_device_ms_per_program"] / row["compiled_device_ms_per_program"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        serving_compilations = compiled.stats()["compilations"]
    finally:
        eager.close()
        compiled.close()
    report = {
        "config": cfg,
        "prompt_len": PROMPT,
        "new_tokens": NEW,
        "repetitions": args.repetitions,
        "startup_s": {"eager": eager_start, "compiled": compiled_start},
        "compilations_while_serving": serving_compilations,
        "rows": rows,
    }
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
