"""One engine's start-up on --device xla in a fresh process: warm-up calls, programs compiled, seconds.

Usage: python docs/bench/xla_startup.py lane-off|lane-on|extras-off|extras-on|ngram-grammar [model_dir]
(xla_startup.sh runs it). Prints one JSON line: the LLM(...) call's seconds, and the warm-up report
summed: all of it, the sampling extras' calls, the masked calls, the relay's calls."""

import json
import sys
import time

from neuron_async_sm import LLM

EXTRAS_SHAPES = dict(  # tests/backends/test_engine_backends.py
    dtype="float64",
    max_num_seqs=1,
    max_model_len=32,
    max_num_batched_tokens=8,
    prefill_buckets=(8,),
    decode_buckets=(1,),
    async_relay=False,
)
SPEC_SHAPES = dict(  # tests/backends/test_spec_xla.py
    dtype="float64",
    max_num_seqs=2,
    max_model_len=64,
    max_num_batched_tokens=16,
    prefill_buckets=(16,),
    decode_buckets=(1, 2),
    async_scheduling=False,
)
LANE_SHAPES = dict(  # tests/backends/test_engine_backends.py, async (relay on)
    dtype="float64",
    max_num_seqs=4,
    max_model_len=128,
    max_num_batched_tokens=16,
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4, 8),
)
kind = sys.argv[1]
if kind.startswith("lane"):
    model, config = "tiny-llama", dict(LANE_SHAPES, sampling_extras=kind == "lane-on")
elif kind.startswith("extras"):
    model, config = "tiny-llama", dict(EXTRAS_SHAPES, sampling_extras=kind == "extras-on")
else:
    model = sys.argv[2]
    config = dict(
        SPEC_SHAPES, sampling_extras=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
start = time.perf_counter()
llm = LLM(model, device="xla", **config)
started = time.perf_counter() - start
report = llm.engine.runtime.warmup_report


def part(pred):
    chosen = [r for r in report if pred(r.label)]
    return {
        "calls": len(chosen),
        "programs": sum(r.compilations for r in chosen),
        "s": round(sum(r.seconds for r in chosen), 1),
    }


print(
    json.dumps(
        {
            "kind": kind,
            "startup_s": round(started, 1),
            "warmup": part(lambda label: True),
            "extras": part(lambda label: "sampling extras" in label),
            "mask": part(lambda label: label.endswith("a mask")),
            "relay": part(lambda label: label.startswith("relay")),
            "labels": [(r.label, r.compilations, round(r.seconds, 1)) for r in report],
        }
    ),
    flush=True,
)
llm.close()
