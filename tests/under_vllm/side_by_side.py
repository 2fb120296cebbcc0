"""The same workload through vLLM's engine with our worker and through our own engine (docs/benchmarks.md).

Run in the vLLM lane's environment: `VLLM_PLUGINS=neuron_async_sm HF_HUB_OFFLINE=1 $venv/bin/python
tests/under_vllm/side_by_side.py [--reps 3] [--device-time-ms 0]`. Four engines are built once (vLLM async,
vLLM sync, ours async, ours sync), all on tiny-llama written as a checkpoint, the emulated device
process, the same max_num_seqs, and take turns on the workload (alternating runs, after one warm-up
each); prints one JSON line per run and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REQUESTS, PROMPT_LEN, NEW_TOKENS, MAX_NUM_SEQS = 32, 32, 64, 8


def prompts() -> list[list[int]]:
    return [[1, *[3 + (17 * i + 7 * k) % 900 for k in range(PROMPT_LEN - 1)]] for i in range(REQUESTS)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device-time-ms", type=float, default=0.0)
    args = parser.parse_args()

    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams

    from neuron_async_sm import LLM, PromptRequest, SamplingParams
    from neuron_async_sm.bench.checkpoint import write_checkpoint

    ckpt = str(write_checkpoint(Path(tempfile.mkdtemp()) / "tiny-llama"))
    engines = {}
    for mode in ("async", "sync"):
        engines[f"vllm-{mode}"] = VllmLLM(
            model=ckpt,
            skip_tokenizer_init=True,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=PROMPT_LEN + NEW_TOKENS,
            async_scheduling=mode == "async",
            additional_config={"neuron_async_sm": {"device_time_ms": args.device_time_ms}},
            disable_log_stats=True,
        )
        engines[f"ours-{mode}"] = LLM(
            ckpt,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=PROMPT_LEN + NEW_TOKENS,
            async_scheduling=mode == "async",
            device_time_ms=args.device_time_ms,
        )
    vllm_params = VllmParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    ours_requests = [PromptRequest(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts()]

    def run(name: str) -> tuple[float, int]:
        engine = engines[name]
        started = time.perf_counter()
        if name.startswith("vllm"):
            outs = engine.generate([{"prompt_token_ids": p} for p in prompts()], vllm_params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            tokens = sum(len(o.output_token_ids) for o in engine.generate(ours_requests))
        return time.perf_counter() - started, tokens

    for name in engines:
        run(name)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.reps):
        for name in engines:
            seconds, tokens = run(name)
            rates[name].append(tokens / seconds)
            print(json.dumps({"rep": rep, "engine": name, "seconds": round(seconds, 3), "tokens": tokens}), flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    summary = {
        "tokens_per_s": {name: round(rate, 1) for name, rate in medians.items()},
        "async_speedup": {
            side: round(medians[f"{side}-async"] / medians[f"{side}-sync"], 3) for side in ("vllm", "ours")
        },
        "device_time_ms": args.device_time_ms,
    }
    print(json.dumps(summary), flush=True)
    for name, engine in engines.items():
        if name.startswith("vllm"):
            engine.llm_engine.engine_core.shutdown()
        else:
            engine.close()


if __name__ == "__main__":
    main()
