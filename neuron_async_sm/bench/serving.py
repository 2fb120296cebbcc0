"""The serving benchmark's client side: prompts, arrival times, streamed requests, and what they measured.

In the spirit of vLLM's `vllm bench serve`: requests arrive as a Poisson process (gamma intervals with
`burstiness` 1; `inf` sends all at once), each one streams a completion over HTTP, and the client
stamps every SSE chunk that carries tokens. Per request (client-side wall clock, `perf_counter`):

- TTFT: request sent -> first chunk with a token;
- E2EL: request sent -> the stream's end;
- TPOT: (E2EL - TTFT) / (output tokens - 1), requests with at least 2 tokens (vLLM's definition);
- ITL: every gap between consecutive token chunks (one chunk per engine step here).

A run is one rate against one server; `run_cells` alternates the servers within each (repetition,
rate) cell, ABBA, with the same prompts and arrival times for both. No torch here.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from neuron_async_sm.bench.metrics import percentile

LATENCIES = ("ttft", "tpot", "itl", "e2el")  # each reported as *_ms_mean, *_ms_p50, *_ms_p99
MAX_ERROR_KINDS = 8  # distinct failure messages kept per run (the rest are counted as "other")


@dataclass(frozen=True)
class LoadSpec:
    """What one serving run sends: validated once, at construction (errors name the field)."""

    num_prompts: int  # requests per run (per rate, per server, per repetition)
    input_len: int  # prompt tokens per request
    output_len: int  # output tokens per request (ignore_eos: every request decodes exactly this many)
    vocab_size: int  # prompt ids are drawn from [3, vocab_size): 0-2 are the checkpoints' special tokens
    burstiness: float = 1.0  # gamma shape of the arrival intervals: 1 is Poisson, < 1 burstier
    max_concurrency: int | None = None  # at most this many requests in flight (None: no limit)
    request_timeout_s: float = 120.0  # a request still open after this long fails as "timeout"

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size: must be >= 4, got {self.vocab_size}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if not 0 < self.request_timeout_s < math.inf:
            raise ValueError(f"request_timeout_s: must be > 0 and finite, got {self.request_timeout_s}")


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def make_prompts(spec: LoadSpec, seed: int) -> list[list[int]]:
    """`num_prompts` random prompts of `input_len` token ids; the same seed gives the same prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(3, spec.vocab_size) for _ in range(spec.input_len)] for _ in range(spec.num_prompts)]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the run starts) of n requests: the first at 0, then gamma intervals with mean
    1 / rate (shape `burstiness`; 1 is a Poisson process). rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(t)
    return offsets


@dataclass
class RequestRecord:
    """One request as the client saw it (perf_counter seconds)."""

    sent_s: float
    token_times: list[float] = field(default_factory=list)  # one stamp per chunk that carried tokens
    output_tokens: int = 0  # the server's usage.completion_tokens, else the token ids the chunks carried
    end_s: float = math.nan
    error: str | None = None  # None: completed


async def stream_one(client, model: str, prompt: list[int], spec: LoadSpec) -> RequestRecord:
    """Send one streamed completion and stamp its chunks; never raises (a failure is recorded)."""
    import openai

    record = RequestRecord(sent_s=time.perf_counter())
    body = {"ignore_eos": True, "return_token_ids": True}
    chunk_tokens = 0

    async def read() -> None:
        nonlocal chunk_tokens
        async with client.completions.with_streaming_response.create(
            model=model,
            prompt=prompt,
            max_tokens=spec.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=body,
        ) as response:
            # Bounded: the server sends at most output_len token chunks, a usage chunk and [DONE];
            # the whole request is under request_timeout_s (wait_for below).
            async for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:  # the server ended the stream (shutdown deadline, engine failure)
                    record.error = f"stream error: {event['error'].get('code') or event['error'].get('type')}"
                    return
                n = sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
                if n:
                    record.token_times.append(time.perf_counter())
                    chunk_tokens += n
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]

    try:
        await asyncio.wait_for(read(), timeout=spec.request_timeout_s)
    except asyncio.TimeoutError:
        record.error = "timeout"
    except openai.APIStatusError as exc:
        record.error = f"HTTP {exc.status_code}"
    except (openai.APIConnectionError, OSError) as exc:
        record.error = f"connection: {type(exc).__name__}"
    record.end_s = time.perf_counter()
    if record.error is None and not record.token_times:
        record.error = "no tokens"
    record.output_tokens = record.output_tokens or chunk_tokens
    return record


async def run_load(
    client, model: str, prompts: Sequence[list[int]], offsets: Sequence[float], spec: LoadSpec
) -> tuple[list[RequestRecord], float]:
    """Send prompts[i] at offsets[i] (s after start), all streamed at once; (records, duration_s).

    duration_s runs from the first send to the last request's end, as vLLM's benchmark measures it.
    Bounded: n requests, each under request_timeout_s after the last offset at the latest.
    """
    limit = asyncio.Semaphore(spec.max_concurrency or len(prompts))
    start = time.perf_counter()

    async def one(prompt: list[int], offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with limit:
            return await stream_one(client, model, prompt, spec)

    records = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets, strict=True)))
    first = min(r.sent_s for r in records)
    return list(records), max(r.end_s for r in records) - first


def summarize(records: Sequence[RequestRecord], duration_s: float, input_len: int) -> dict:
    """The flat, JSON-ready figures of one run (times in ms; throughputs over duration_s)."""
    done = [r for r in records if r.error is None]
    errors = Counter(r.error for r in records if r.error is not None)
    kept = dict(errors.most_common(MAX_ERROR_KINDS))
    if len(errors) > MAX_ERROR_KINDS:
        kept["other"] = sum(errors.values()) - sum(kept.values())
    series = {
        "ttft": [(r.token_times[0] - r.sent_s) * 1e3 for r in done],
        "e2el": [(r.end_s - r.sent_s) * 1e3 for r in done],
        "tpot": [(r.end_s - r.token_times[0]) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [(b - a) * 1e3 for r in done for a, b in zip(r.token_times[:-1], r.token_times[1:], strict=True)],
    }
    output_tokens = sum(r.output_tokens for r in done)
    out: dict = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": kept,
        "duration_s": duration_s,
        "input_tokens": input_len * len(done),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (output_tokens + input_len * len(done)) / duration_s if duration_s > 0 else math.nan,
        "itl_count": len(series["itl"]),
    }
    for name in LATENCIES:
        values = series[name]
        out[f"{name}_ms_mean"] = statistics.fmean(values) if values else math.nan
        out[f"{name}_ms_p50"] = percentile(values, 50)
        out[f"{name}_ms_p99"] = percentile(values, 99)
        out[f"{name}_ms_max"] = max(values) if values else math.nan
    return out


@dataclass(frozen=True)
class Target:
    """One server the benchmark sends to: a mode name ("sync", "async", or a label) and its client."""

    name: str
    client: object  # openai.AsyncOpenAI on base_url + /v1
    model: str  # the served model name requests carry
    other_pids: tuple[int, ...] = ()  # the server's processes: left out of `other_cpu`
    # The server's own counters (steps by path state), read before and after each run;
    # {} where /metrics has none. Blocking: called only between runs, when nothing is in flight.
    counters: Callable[[], dict[str, float]] = dict


def server_side(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server counted during one run: steps by path state and the Steady share.

    Not the device's idle time: its histogram's sum over a run includes the idle gap before the run's
    first program (the other server's run, in an alternating cell), which swamps the rest."""
    steps = {k.split(":", 1)[1]: after[k] - before.get(k, 0.0) for k in after if k.startswith("steps:")}
    total = sum(steps.values())
    return {
        "steps": {k: int(v) for k, v in steps.items() if v},
        "async_step_fraction": steps.get("Steady", 0.0) / total if total and "Sync" not in steps else math.nan,
    }


def mode_order(targets: Sequence[Target], repetition: int, rate_index: int) -> list[Target]:
    """The targets in the order cell (repetition, rate_index) runs them: flipped from one rate to the
    next and from one repetition to the next, so every rate sees each target first equally often
    (flipping by a running cell count would not: with an even number of rates, each rate would keep
    one order in every repetition)."""
    return list(targets) if (repetition + rate_index) % 2 == 0 else list(reversed(targets))


async def run_cells(
    targets: Sequence[Target],
    rates: Sequence[float],
    spec: LoadSpec,
    *,
    repetitions: int,
    seed: int,
    progress: Callable[[str], None],
    quiet: Callable[[], Awaitable[float]],
    other_load: Callable[[Sequence[int]], Callable[[], float]],
) -> list[dict]:
    """Every (repetition, rate) cell once per target, in `mode_order` (ABBA...).

    Both targets of a cell get the same prompts and arrival times (seeded by repetition and rate), so
    a cell is a paired comparison; repetitions draw new ones. `await quiet()` may wait for a quiet machine
    before each cell (returns the other processes' share it saw); `other_load(pids)` starts measuring
    the other processes' CPU share and returns the function that reads it at the end of the run.
    """
    runs = []
    cell = 0
    for rep in range(repetitions):
        for i, rate in enumerate(rates):
            cell_seed = seed + 1000 * rep + i
            prompts = make_prompts(spec, cell_seed)
            offsets = arrival_offsets(spec.num_prompts, rate, spec.burstiness, cell_seed)
            order = mode_order(targets, rep, i)
            before = await quiet()
            for target in order:
                share, counted = other_load(target.other_pids), target.counters()
                records, duration = await run_load(target.client, target.model, prompts, offsets, spec)
                server = server_side(counted, target.counters())
                run = {
                    "mode": target.name,
                    "request_rate": None if math.isinf(rate) else rate,
                    "rate_label": rate_label(rate),
                    "repetition": rep,
                    "cell": cell,
                    "arrival_span_s": offsets[-1],
                    "other_cpu_before": before,
                    "other_cpu": share(),
                    **summarize(records, duration, spec.input_len),
                    "server": server,
                }
                runs.append(run)
                progress(f"{target.name} @ {run['rate_label']}/s: {run['completed']} ok, {run['failed']} failed")
            cell += 1
    return runs


async def warm_up(targets: Sequence[Target], spec: LoadSpec, n: int, seed: int) -> None:
    """n requests at once per target, not recorded: first programs, connection pools, caches."""
    if n < 1:
        return
    prompts = make_prompts(LoadSpec(n, spec.input_len, spec.output_len, spec.vocab_size), seed - 1)
    for target in targets:
        await run_load(target.client, target.model, prompts, [0.0] * n, spec)


def aggregate(runs: Sequence[dict], modes: Sequence[str], rates: Sequence[float]) -> dict:
    """mode -> one row per rate: counts summed over repetitions, every other figure the median."""
    out = {}
    for mode in modes:
        rows = []
        for rate in rates:
            mine = [r for r in runs if r["mode"] == mode and r["rate_label"] == rate_label(rate)]
            row = {
                "request_rate": None if math.isinf(rate) else rate,
                "rate_label": rate_label(rate),
                "repetitions": len(mine),
            }
            for key, value in mine[0].items():
                if key in ("completed", "failed", "input_tokens", "output_tokens", "itl_count"):
                    row[key] = sum(r[key] for r in mine)
                elif key == "errors":
                    row[key] = dict(sum((Counter(r[key]) for r in mine), Counter()))
                elif isinstance(value, float) and key not in row:
                    row[key] = _median([r[key] for r in mine])
                elif key == "server":
                    steps = sum((Counter(r["server"]["steps"]) for r in mine), Counter())
                    row[key] = {"steps": dict(steps)}
                    row[key]["async_step_fraction"] = _median([r["server"]["async_step_fraction"] for r in mine])
            rows.append(row)
        out[mode] = rows
    return out


def _median(values: Sequence[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan
