"""Tokens/s against `transformers` `generate()` on the same checkpoint and the same prompts.

Both sides load one directory written by `write_checkpoint` (tiny-llama's weights as a Hugging Face
checkpoint), get B prompts of equal length (no padding needed) and decode greedily for exactly N new
tokens (our `ignore_eos`; theirs with `eos_token_id` unset). Runs alternate (ours, theirs at each
thread count) and medians are reported. transformers runs in this process, once per torch intra-op
thread count (1, and torch's default: all cores); the ratio is taken against its best. Our engine
runs as configured by default: the device process computes on one thread while the host schedules.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.bench.runner import OtherLoad, Progress, batch_config, load_average
from neuron_async_sm.engine.llm import LLM
from neuron_async_sm.model import TINY_LLAMA_CONFIG
from neuron_async_sm.sampling_params import SamplingParams

DEFAULT_PEER_BATCHES = (1, 8, 32, 64)


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_LLAMA_CONFIG.vocab_size) for _ in range(length)] for _ in range(batch)]


def _ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return time.perf_counter() - started, [o.output_token_ids for o in outputs]


def _theirs(model: object, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[float, list[list[int]]]:
    input_ids = torch.tensor(prompts)  # [B, L]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(  # type: ignore[attr-defined]
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )  # fmt: skip
        elapsed = time.perf_counter() - started
    finally:
        torch.set_num_threads(previous)
    return elapsed, out[:, input_ids.shape[1] :].tolist()


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of positions where both decoded the same greedy token."""
    pairs = [(a, b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def vs_transformers(
    batch_sizes: tuple[int, ...] = DEFAULT_PEER_BATCHES,
    *,
    prompt_len: int = 32,
    new_tokens: int = 128,
    repetitions: int = 3,
    thread_counts: tuple[int, ...] | None = None,
    checkpoint_dir: str | None = None,
    progress: Progress | None = None,
    engine_options: dict | None = None,
    max_other_cpu: float | None = None,
) -> dict:
    """Our async engine and transformers on one checkpoint; JSON-ready rows per batch size.

    `max_other_cpu`: wait for a quiet second (see `OtherLoad.wait_for_quiet`) before each repetition.
    """
    try:
        import transformers
    except ImportError as exc:  # a dev extra, not a runtime dependency
        raise RuntimeError("--vs-transformers needs transformers (pip install -e '.[dev]')") from exc
    threads = thread_counts or tuple(sorted({1, torch.get_num_threads()}))
    rows = []
    with tempfile.TemporaryDirectory(prefix="neuron-async-sm-tiny-") as tmp:
        path = write_checkpoint(Path(checkpoint_dir or tmp) / "tiny-llama-hf")
        theirs = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        theirs.generation_config.eos_token_id = None  # decode exactly new_tokens, like ignore_eos
        config = {**batch_config(max(batch_sizes)), **(engine_options or {})}
        with LLM(str(path), max_model_len=prompt_len + new_tokens + 8, **config) as ours:  # type: ignore[arg-type]
            for batch in batch_sizes:
                prompts = _prompts(batch, prompt_len, seed=batch)
                _ours(ours, prompts, 8)  # warm-up
                for n in threads:
                    _theirs(theirs, prompts, 8, n)
                times: dict[str, list[float]] = {"ours": [], **{f"transformers_{n}t": [] for n in threads}}
                agreement = 1.0
                other = OtherLoad([ours.engine.runtime.device_pid])  # type: ignore[attr-defined]
                for _ in range(repetitions):
                    OtherLoad.wait_for_quiet(max_other_cpu)
                    elapsed, our_tokens = _ours(ours, prompts, new_tokens)
                    times["ours"].append(elapsed)
                    for n in threads:
                        time.sleep(0.2)  # let the previous run's spinning OpenMP workers go to sleep
                        elapsed, their_tokens = _theirs(theirs, prompts, new_tokens, n)
                        times[f"transformers_{n}t"].append(elapsed)
                        agreement = min(agreement, _agreement(our_tokens, their_tokens))
                    time.sleep(0.2)
                row: dict = {"batch": batch}
                for name, samples in times.items():
                    row[f"{name}_tokens_per_s"] = batch * new_tokens / statistics.median(samples)
                best = max(row[f"transformers_{n}t_tokens_per_s"] for n in threads)
                row.update(transformers_tokens_per_s=best, ratio=row["ours_tokens_per_s"] / best,
                           token_agreement=agreement, load_avg=load_average()[0], other_cpu=other.share())  # fmt: skip
                rows.append(row)
                if progress is not None:
                    progress(f"batch {batch}: ours {row['ours_tokens_per_s']:.0f} tok/s, transformers {best:.0f}")
    return {
        "checkpoint": "tiny-llama weights saved as a Hugging Face checkpoint",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "transformers_version": transformers.__version__,
        "transformers_threads": list(threads),
        "rows": rows,
    }
