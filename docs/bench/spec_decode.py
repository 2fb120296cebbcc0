"""Speculative decoding (ngram, k=4) against none, sync and async, at high and low acceptance.

The targets are tiny-llama with its layers scaled (`write_checkpoint(..., layer_scale=s)`): 0.02
repeats (high acceptance), 0.1 less. The four configurations alternate within each repetition;
prints one dict per run (docs/benchmarks.md, "Speculative decoding").
"""

import random
import time

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.bench.checkpoint import write_checkpoint

SCALES = (0.02, 0.1)
REPS = 2
REQUESTS, TOKENS = 8, 160
ENGINE = dict(
    dtype="float32", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64, prefill_buckets=(8, 16, 32, 64)
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(2, 20))] for _ in range(REQUESTS)]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    for scale in SCALES:
        target = str(write_checkpoint(f"/tmp/spec-bench-{scale}", layer_scale=scale))
        for rep in range(REPS):
            for async_scheduling in (False, True):
                for spec in (None, NGRAM):
                    with LLM(target, **ENGINE, async_scheduling=async_scheduling, speculative_config=spec) as llm:
                        llm.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up, unrecorded
                        started = time.perf_counter()
                        llm.generate(prompts, params)
                        elapsed = time.perf_counter() - started
                        stats = llm.stats()
                    row = dict(scale=scale, rep=rep, async_scheduling=async_scheduling, spec=spec is not None)
                    row.update(tok_s=REQUESTS * TOKENS / elapsed, steps=stats["steps"], **stats.get("spec_decode", {}))
                    print(row, flush=True)


if __name__ == "__main__":
    main()
