"""Soak: thousands of short requests with random aborts through the async engine on the device process.

Every request is accounted for (exactly one terminal result, no token after it, never more than
max_tokens), and memory stays flat: at every checkpoint the engine is brought to idle and the live
device futures, the scheduler's and the worker's request tables, the async outputs and device futures
alive on the host, the threads and the resident memory are measured; none may grow. The figures are
printed (`pytest -s tests/test_soak.py`). The request count follows the hypothesis profile
(conftest.py: `soak_requests`).
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections import Counter

from support.engine_invariants import TERMINAL, check_machine, check_scheduler_bounded, check_slots

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.runtime.host_future import HostFuture
from neuron_async_sm.worker.async_output import AsyncModelRunnerOutput

CHECKPOINTS = 8
ENGINE = dict(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64, prefill_buckets=(16, 32, 64))
LIVE_FUTURES_BOUND = 8  # buffer + two steps in flight + releases not yet flushed: a small constant, not a trend
RSS_GROWTH_BOUND_MB = 64.0  # allocator noise allowed between the first and the last checkpoint


def _rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _count(kind: type) -> int:
    return sum(type(o) is kind for o in gc.get_objects())  # type(): isinstance() trips torch deprecation shims


def _random_request(rng: random.Random) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(3, 1024) for _ in range(rng.randint(1, 12))]
    params = SamplingParams(
        max_tokens=rng.randint(1, 4) if rng.random() < 0.8 else rng.randint(8, 24),
        temperature=rng.choice([0.0, 0.8]),
        top_k=rng.choice([0, 20]),
        seed=rng.choice([None, rng.randrange(2**31)]),
        stop_token_ids=tuple(rng.sample(range(3, 1024), rng.choice([0, 0, 100]))),
        ignore_eos=rng.random() < 0.5,
    )
    return prompt, params


def _measure(llm: LLM) -> dict:
    engine = llm.engine
    gc.collect()
    return {
        "device_futures_live": engine.runtime.stats().device_futures_live,
        "scheduler_requests": len(engine.scheduler.requests),
        "steps_in_flight": len(engine.scheduler._unapplied),
        "free_slots": len(engine.scheduler._free_slots),
        "worker_requests": len(engine.runner.batch.requests),
        "output_queue": engine.executor._output_queue.qsize(),
        "async_outputs_alive": _count(AsyncModelRunnerOutput),
        "host_futures_alive": _count(HostFuture),
        "threads": threading.active_count(),
        "rss_mb": round(_rss_mb(), 1),
        "device_rss_mb": round(_rss_mb(engine.runtime.device_pid), 1),
    }


def test_soak_thousands_of_short_requests_with_random_aborts(soak_requests):
    rng = random.Random(2024)
    threads_before = set(threading.enumerate())
    started = time.perf_counter()
    finish: dict[str, str] = {}
    tokens: Counter[str] = Counter()
    max_tokens: dict[str, int] = {}
    live: list[str] = []
    samples: list[dict] = []
    per_checkpoint = soak_requests // CHECKPOINTS
    with LLM("tiny-llama", device="cpu", **ENGINE) as llm:
        engine_pid = llm.engine.runtime.device_pid
        submitted = turns = 0
        for checkpoint in range(CHECKPOINTS):
            target = per_checkpoint * (checkpoint + 1)
            while submitted < target or llm.has_unfinished_requests():
                burst = rng.randint(1, 8) if rng.random() < 0.25 else 0  # bursts, then decode runs (Steady)
                for _ in range(min(burst, target - submitted)):
                    prompt, params = _random_request(rng)
                    rid = llm.add_request(prompt, params, f"s{submitted}")
                    max_tokens[rid] = params.max_tokens
                    live.append(rid)
                    submitted += 1
                if live and rng.random() < 0.15:  # abort a random live request: waiting, running or in flight
                    rid = live.pop(rng.randrange(len(live)))
                    delta = llm.abort(rid)
                    assert delta is not None and delta.finish_reason == "abort"
                    finish[rid] = "abort"
                for delta in llm.step() if llm.has_unfinished_requests() else []:
                    rid = delta.request_id
                    assert rid not in finish, f"{rid}: {delta} after it finished {finish[rid]}"
                    tokens[rid] += len(delta.new_token_ids)
                    if delta.finish_reason is not None:
                        finish[rid] = delta.finish_reason
                        live.remove(rid)
                turns += 1
            check_slots(llm)
            check_machine(llm)
            check_scheduler_bounded(llm)
            samples.append(_measure(llm))
        stats = llm.stats()
    elapsed = time.perf_counter() - started

    # Every request accounted for: one terminal result each, never more tokens than it asked for.
    assert set(finish) == set(max_tokens) and len(finish) == submitted == per_checkpoint * CHECKPOINTS
    assert set(finish.values()) <= TERMINAL - {"error"}
    assert all(tokens[rid] <= max_tokens[rid] for rid in max_tokens)
    assert stats["async_steps"] > 0.1 * stats["steps"], stats  # the device-to-device feed was soaked too
    reasons = Counter(finish.values())
    assert reasons["abort"] and reasons["length"] and reasons["stop"], reasons

    # Flat: idle checkpoints are equal (or bounded by a constant), not growing with the requests served.
    first, last = samples[0], samples[-1]
    for sample in samples:
        assert sample["scheduler_requests"] == sample["steps_in_flight"] == sample["output_queue"] == 0, sample
        assert sample["free_slots"] == ENGINE["max_num_seqs"], sample
        assert sample["worker_requests"] <= ENGINE["max_num_seqs"], sample
        assert sample["device_futures_live"] <= LIVE_FUTURES_BOUND, sample
        assert sample["async_outputs_alive"] <= 2 and sample["host_futures_alive"] <= LIVE_FUTURES_BOUND, sample
        assert sample["threads"] == first["threads"], sample
    assert last["rss_mb"] - first["rss_mb"] < RSS_GROWTH_BOUND_MB, (first, last)
    assert last["device_rss_mb"] - first["device_rss_mb"] < RSS_GROWTH_BOUND_MB, (first, last)

    # No thread leaks: the engine's threads and its device process are gone after close().
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not leaked, leaked
    assert not os.path.exists(f"/proc/{engine_pid}") or _zombie(engine_pid), "device process outlived close()"

    print(
        f"\nsoak: {submitted} requests, {turns} loop turns, {stats['steps']} steps "
        f"({stats['async_steps']} async, {stats['sync_fallback_steps']} sync fallback: {stats['state_counts']}), "
        f"{sum(tokens.values())} tokens, finishes {dict(reasons)}, {elapsed:.1f} s"
    )
    for i, sample in enumerate(samples):
        print(f"  checkpoint {i + 1} ({per_checkpoint * (i + 1)} requests): {sample}")


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] in ("Z", "X")
