"""Speculative decoding (k=4) against none, sync and async, at high and low acceptance.

`python docs/bench/spec_decode.py` (n-gram): the targets are tiny-llama with its layers scaled
(`write_checkpoint(..., layer_scale=s)`): 0.02 repeats (high acceptance), 0.1 less.
`python docs/bench/spec_decode.py draft_model`: the target is the 0.02 one; the high-acceptance
draft is its first layer alone (`write_noisy_copy(..., noise=0, num_layers=1)`), the low one that
layer with noise of 0.3 times each weight's std. `... draft_model high` runs the high setting alone.
The four configurations alternate within each repetition; prints one dict per run, with the timed
run's steps counted by the machine row each took (async; docs/benchmarks.md, "Speculative decoding").
"""

import random
import sys
import time

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint, write_noisy_copy

SCALES = (0.02, 0.1)
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
REQUESTS, TOKENS = 8, 160
ENGINE = dict(
    dtype="float32", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64, prefill_buckets=(8, 16, 32, 64)
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def settings(method: str) -> list[tuple[str, str, dict]]:
    """(label, target, speculative_config) per acceptance setting."""
    if method == "ngram":
        return [(f"scale {s}", str(write_checkpoint(f"/tmp/spec-bench-{s}", layer_scale=s)), NGRAM) for s in SCALES]
    target = str(write_checkpoint("/tmp/spec-bench-0.02", layer_scale=0.02))
    spec = {"method": "draft_model", "num_speculative_tokens": 4}
    return [  # (label, noise): the target's first layer alone, and with noise as large as its weights' std x 0.3
        (
            label,
            target,
            {**spec, "model": str(write_noisy_copy(target, f"/tmp/spec-bench-{label}", noise, num_layers=1))},
        )
        for label, noise in (("high", 0.0), ("low", 0.3))
    ]


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "ngram"
    only = sys.argv[2] if len(sys.argv) > 2 else None
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(2, 20))] for _ in range(REQUESTS)]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    for label, target, speculative in settings(method):
        if only is not None and label != only:
            continue
        for rep in range(REPS):
            for async_scheduling in (False, True):
                for spec in (None, speculative):
                    with LLM(target, **ENGINE, async_scheduling=async_scheduling, speculative_config=spec) as llm:
                        llm.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up, unrecorded
                        before = llm.stats().get("state_counts", {})
                        started = time.perf_counter()
                        llm.generate(prompts, params)
                        elapsed = time.perf_counter() - started
                        stats = llm.stats()
                    row = dict(setting=label, rep=rep, async_scheduling=async_scheduling, spec=spec is not None)
                    row.update(tok_s=REQUESTS * TOKENS / elapsed, steps=stats["steps"], **stats.get("spec_decode", {}))
                    counts = {s: n - before.get(s, 0) for s, n in stats.get("state_counts", {}).items()}
                    if sum(counts.values()):  # the timed run's steps, by the row each took
                        row["rows"] = {s: n for s, n in counts.items() if n}
                    print(row, flush=True)


if __name__ == "__main__":
    main()
