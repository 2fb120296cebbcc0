"""Host cost of one decode forward on --device xla: lazy tracing (today) against dynamo's `openxla` backend.

Run from the XLA venv under the bench lock: `PJRT_DEVICE=CPU flock /tmp/bench.lock $(.ci/xla-env | tail -1)/bin/python
docs/bench/xla_dynamo_trace.py`. tiny-llama float32, 8 decode rows, max_model_len 512, 30 steps at growing
positions (each step's K/V written into the cache and read by the next); host CPU time (time.thread_time)
and wall time of `forward + torch_xla.sync()` per step, medians after 5 steps; then the largest difference
between the two ways' logits over every step (the cache writes inside the compiled graph included).
"""

from __future__ import annotations

import time

import torch
import torch_xla

from neuron_async_sm.model.llama import ForwardBatch
from neuron_async_sm.model.program import build_step_program
from neuron_async_sm.model.spec import ModelSpec

ROWS, MAX_LEN, STEPS = 8, 512, 30


def main() -> None:
    dev = torch_xla.device()
    logits: dict[str, list[torch.Tensor]] = {}
    for way in ("lazy tracing", "dynamo openxla"):
        program = build_step_program(ModelSpec("tiny-llama", "float32", ROWS, MAX_LEN), dev)
        torch_xla.sync()

        def forward(ids, pos, write_slots, slots, last, program=program):
            batch = ForwardBatch(ids, pos, write_slots, slots, last, context_len=MAX_LEN)
            return program.model.forward(batch, program.kv_cache)

        if way == "dynamo openxla":
            forward = torch.compile(forward, backend="openxla", fullgraph=True, dynamic=False)
        outs, cpu, wall = [], [], []
        for step in range(STEPS):
            ids = torch.randint(0, 900, (ROWS, 1), generator=torch.Generator().manual_seed(step)).to(dev)
            slots = torch.arange(ROWS).to(dev)
            pos = torch.full((ROWS, 1), 40 + step).to(dev)
            args = (ids, pos, slots.unsqueeze(1), slots, torch.zeros(ROWS, dtype=torch.long).to(dev))
            torch_xla.sync()
            t, w = time.thread_time(), time.perf_counter()
            with torch.no_grad():
                out = forward(*args)
            torch_xla.sync()
            cpu.append(time.thread_time() - t)
            wall.append(time.perf_counter() - w)
            outs.append(out.cpu())
        logits[way] = outs
        cpu, wall = sorted(cpu[5:]), sorted(wall[5:])
        print(f"{way}: host CPU {cpu[len(cpu) // 2] * 1e3:.2f} ms, wall {wall[len(wall) // 2] * 1e3:.2f} ms per step")
    a, b = logits.values()
    print("largest logit difference:", max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)))


if __name__ == "__main__":
    main()
