"""Tokens/s against `transformers` `generate()` on the same checkpoint and the same prompts.

Both sides load one directory written by `write_checkpoint` (tiny-llama's weights as a Hugging Face
checkpoint), get B prompts of equal length (no padding needed) and decode greedily for exactly N new
tokens (our `ignore_eos`; theirs with `eos_token_id` unset). Runs alternate (ours, theirs at each
thread count) and medians are reported. transformers runs in this process, once per torch intra-op
thread count (1, and torch's default: all cores); the ratio is taken against its best. Our engine
runs as configured by default: the device process computes on one thread while the host schedules.

A second peer is transformers' own continuous batching (`ContinuousBatchingManager`, what
`generate_batch` drives) on the `mixed` workload (48 requests, prompts 8-320 tokens, outputs 16-192):
every request is submitted at once on both sides (mixed's arrival turns have no meaning in theirs),
greedy, each request its own max_new_tokens; tokens/s is total output tokens over wall time.
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
from neuron_async_sm.bench.workloads import build_workload
from neuron_async_sm.engine.llm import LLM, PromptRequest
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
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
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
                row.update(
                    transformers_tokens_per_s=best,
                    ratio=row["ours_tokens_per_s"] / best,
                    token_agreement=agreement,
                    load_avg=load_average()[0],
                    other_cpu=other.share(),
                )
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


def _mixed_requests(max_model_len: int) -> list[tuple[list[int], int]]:
    """The `mixed` workload's (prompt, output length) pairs; sampled or not there, greedy here."""
    workload = build_workload("mixed", max_model_len=max_model_len)
    return [(list(r.prompt_token_ids), r.sampling_params.max_tokens) for r in workload.requests]


def _ours_mixed(llm: LLM, requests: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    batch = [
        PromptRequest(p, SamplingParams(max_tokens=n, ignore_eos=True), f"m{i}") for i, (p, n) in enumerate(requests)
    ]
    started = time.perf_counter()
    outputs = llm.generate(batch)
    return time.perf_counter() - started, [o.output_token_ids for o in outputs]


def _theirs_mixed(manager: object, requests: list[tuple[list[int], int]], tag: str) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    ids = [
        manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=n)  # type: ignore[attr-defined]
        for i, (p, n) in enumerate(requests)
    ]
    results = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=600)  # type: ignore[attr-defined]
        if out is None:
            raise RuntimeError("transformers continuous batching returned no result within 600 s")
        results[out.request_id] = list(out.generated_tokens)
    return time.perf_counter() - started, [results[i] for i in ids]


def vs_transformers_continuous(
    *,
    repetitions: int = 3,
    thread_counts: tuple[int, ...] | None = None,
    max_num_seqs: int = 16,
    checkpoint_dir: str | None = None,
    progress: Progress | None = None,
    engine_options: dict | None = None,
) -> dict:
    """Our async engine against transformers' continuous batching on `mixed`; alternating runs, medians."""
    try:
        import transformers
        from transformers import GenerationConfig
    except ImportError as exc:
        raise RuntimeError("--vs-transformers needs transformers (pip install -e '.[dev]')") from exc
    threads = thread_counts or tuple(sorted({1, torch.get_num_threads()}))
    max_model_len = 512
    requests = _mixed_requests(max_model_len)
    output_tokens = sum(n for _, n in requests)
    times: dict[str, list[float]] = {"ours": [], **{f"transformers_cb_{n}t": [] for n in threads}}
    agreement = 1.0
    previous = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="neuron-async-sm-tiny-") as tmp:
        path = write_checkpoint(Path(checkpoint_dir or tmp) / "tiny-llama-hf")
        theirs = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        theirs = theirs.eval()
        generation = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=192)
        config = {**batch_config(max_num_seqs), **(engine_options or {})}
        manager = theirs.init_continuous_batching(generation_config=generation)
        manager.start()
        try:
            with LLM(str(path), max_model_len=max_model_len, **config) as ours:  # type: ignore[arg-type]
                _ours_mixed(ours, requests[:4])  # warm-up, both
                _theirs_mixed(manager, requests[:4], "warm")
                for rep in range(repetitions):
                    elapsed, our_tokens = _ours_mixed(ours, requests)
                    times["ours"].append(elapsed)
                    for n in threads:
                        torch.set_num_threads(n)
                        time.sleep(0.2)  # let the previous run's spinning OpenMP workers go to sleep
                        elapsed, their_tokens = _theirs_mixed(manager, requests, f"r{rep}t{n}")
                        torch.set_num_threads(previous)
                        times[f"transformers_cb_{n}t"].append(elapsed)
                        agreement = min(agreement, _agreement(our_tokens, their_tokens))
                    if progress is not None:
                        progress(f"mixed, repetition {rep + 1}: ours {output_tokens / times['ours'][-1]:.0f} tok/s")
        finally:
            torch.set_num_threads(previous)
            manager.stop(block=True, timeout=30)
    row: dict = {name: output_tokens / statistics.median(samples) for name, samples in times.items()}
    best = max(row[f"transformers_cb_{n}t"] for n in threads)
    return {
        "workload": "mixed (every request at once, greedy)",
        "num_requests": len(requests),
        "output_tokens": output_tokens,
        "transformers_version": transformers.__version__,
        "transformers_threads": list(threads),
        "engine": config,
        "tokens_per_s": row,
        "seconds": times,
        "ratio": row["ours"] / best,
        "token_agreement": agreement,
        "load_avg": load_average()[0],
    }
