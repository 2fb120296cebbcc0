"""The step program alone, in process, between two source trees (issue 15: what the device computes).

One fresh process per (tree, repetition), trees alternating ABBA; each process builds tiny-llama's
program (float32, 1 torch thread, 64 slots, max_model_len 168 as in the transformers comparison, or
$PROGRAM_AB_MAX_MODEL_LEN) and times whole program calls
(prepare, forward, sampling) for each shape, median of 100 calls after 10 warm ones:

- decode at batch 1, 8, 64: one token per row at position 100, rows on slots 0..B-1;
- mixed 8 x 64: a 32-token prompt chunk (positions 0-31) beside 7 decode rows, padded to 64;
- mixed 16 x 512: the same chunk beside 15 decode rows, padded to 512 (the `mixed` workload's
  budget bucket at max_num_seqs 16).

    git archive <commit> neuron_async_sm | tar -x -C /tmp/before
    python docs/bench/program_ab.py --before /tmp/before --after . --cycles 2 --out docs/bench/program_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MAX_MODEL_LEN = int(os.environ.get("PROGRAM_AB_MAX_MODEL_LEN", "168"))  # 168: the transformers comparison's engine
SHAPES = {
    "decode 1": (1, 1),
    "decode 8": (8, 1),
    "decode 64": (64, 1),
    "mixed 8 x 64": (8, 64),
    "mixed 16 x 512": (16, 512),
}


def measure() -> dict:
    """Runs inside the tree under test: median µs per program call for each shape."""
    import time

    import torch

    from neuron_async_sm.model.program import build_step_program
    from neuron_async_sm.model.spec import ModelSpec

    torch.set_num_threads(1)
    program = build_step_program(ModelSpec("tiny-llama", "float32", 64, MAX_MODEL_LEN))
    out = {}
    for name, (rows, length) in SHAPES.items():
        ids = torch.full((rows, length), 5, dtype=torch.int32)
        pos = torch.zeros(rows, length, dtype=torch.int32)
        lens = [1] * rows
        if length == 1:
            pos[:, 0] = 100
        else:
            lens[0] = 32
            pos[0, :32] = torch.arange(32)
            pos[1:, 0] = 100
        step = dict(
            input_ids=ids[:, 0] if length == 1 else ids,
            positions=pos[:, 0] if length == 1 else pos,
            query_lens=torch.tensor(lens, dtype=torch.int32),
            slot_ids=torch.arange(rows, dtype=torch.int32),
            temperature=torch.zeros(rows),
            top_k=torch.zeros(rows, dtype=torch.int32),
            top_p=torch.ones(rows),
            seeds=torch.zeros(rows, dtype=torch.int64),
            output_index=torch.zeros(rows, dtype=torch.int64),
        )
        times = []
        for i in range(110):
            started = time.perf_counter()
            program(**step)
            if i >= 10:
                times.append(time.perf_counter() - started)
        out[name] = statistics.median(times) * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path)
    p.add_argument("--after", type=Path)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--measure", action="store_true", help="internal: measure in this process")
    args = p.parse_args()
    if args.measure:
        print("RESULT " + json.dumps(measure()))
        return
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for cycle in range(args.cycles):
        for name in ("before", "after") if cycle % 2 == 0 else ("after", "before"):
            env = {**os.environ, "PYTHONPATH": str(trees[name].resolve())}
            cmd = ["nice", "-n", "-10", sys.executable, __file__, "--measure"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1800)
            result = json.loads(proc.stdout.split("RESULT ", 1)[1])
            runs[name].append(result)
            print(name, {k: round(v) for k, v in result.items()}, flush=True)
    medians = {name: {s: statistics.median(r[s] for r in rs) for s in SHAPES} for name, rs in runs.items()}
    for shape in SHAPES:
        b, a = medians["before"][shape], medians["after"][shape]
        print(f"{shape}: before {b:.0f} us, after {a:.0f} us, {b / a:.2f}x")
    if args.out:
        args.out.write_text(
            json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "medians": medians}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
