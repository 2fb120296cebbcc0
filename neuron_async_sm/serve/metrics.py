"""Prometheus metrics of the server: vLLM's names where vLLM has the metric (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ...: dashboards built for vLLM work unchanged), our own prefix
(`neuron_async_sm_`) for what vLLM has not (steps by path state, materializations by thread, device
idle time, KV slots, refusals); every series has the `model_name` label. The process metrics
(`process_*`, `python_*`) are there too.

Fed from three places, each on its own thread, all through prometheus_client's thread-safe types:
- `observe_turn`: the engine thread, once per turn (`EngineTurn`): queue gauges, tokens, finishes,
  TTFT / inter-token / end-to-end latency and each request's queue / prefill / decode / inference
  time (all measured on the engine thread, from the time the front end received the request), the
  device's idle time before each program;
- `on_engine_event`: the engine's tracer (`Tracer.subscribe`): each step's path state (engine
  thread) and each materialization with the thread that ran it (engine or async-output thread);
- the front end: requests refused before they reached the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from neuron_async_sm.engine.async_llm import EngineTurn
from neuron_async_sm.engine.llm import LLM
from neuron_async_sm.worker.async_machine import ASYNC_STATES, PATH_STATES

PREFIX = "neuron_async_sm_"  # ours
VLLM = "vllm:"  # vLLM's names
SYNC_STATE = "Sync"  # steps_total's label in sync mode: no machine runs, every step blocks on its tokens
DEVICE_STATS_INTERVAL_S = 0.25  # how often the engine thread copies the runtime's per-program stats

# vLLM's bucket bounds, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# vLLM's request-phase bounds (queue, prefill, decode, inference), in seconds.
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
IDLE_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class _Timing:
    """One open request's clock, on the engine thread."""

    arrival_s: float
    scheduled_s: float | None = None  # left the waiting queue
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    """Every metric of one server, in its own registry (`scrape()` is the /metrics body)."""

    def __init__(self, llm: LLM, model_name: str) -> None:
        self.llm = llm
        disable_created_metrics()  # no `*_created` series (process-wide; vLLM does the same)
        self.registry = r = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        labels = ("model_name",)
        self.model_name = model_name

        def gauge(name: str, doc: str, prefix: str = PREFIX) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = (), prefix: str = PREFIX) -> Counter:
            return Counter(prefix + name, doc, (*labels, *extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], prefix: str = PREFIX) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=r)

        def vllm_histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return histogram(name, doc, buckets, VLLM).labels(model_name)  # type: ignore[return-value]

        m = model_name
        self.running = gauge("num_requests_running", "Requests holding a KV slot.", VLLM).labels(m)
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a KV slot.", VLLM).labels(m)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV slots in use (0-1).", VLLM).labels(m)
        self.free_slots = gauge("kv_slots_free", "KV slots no request holds (max_num_seqs at idle).").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens of accepted requests.", prefix=VLLM).labels(m)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.", prefix=VLLM).labels(m)
        self._success = counter(
            "request_success",
            "Finished requests by finish reason (abort and error included).",
            ("finished_reason",),
            VLLM,
        )
        self._rejected = counter("requests_rejected", "Requests refused before the engine ran them.", ("reason",))
        self.ttft = vllm_histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = vllm_histogram("inter_token_latency_seconds", "Time between a request's tokens.", ITL_BUCKETS)
        self.e2e = vllm_histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = vllm_histogram("request_queue_time_seconds", "Arrival to first scheduled.", PHASE_BUCKETS)
        self.inference_time = vllm_histogram(
            "request_inference_time_seconds", "First scheduled to finish.", PHASE_BUCKETS
        )
        self.prefill_time = vllm_histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", PHASE_BUCKETS
        )
        self.decode_time = vllm_histogram("request_decode_time_seconds", "First token to finish.", PHASE_BUCKETS)
        token_buckets = one_two_five(llm.config.max_model_len)
        self.request_prompt_tokens = vllm_histogram("request_prompt_tokens", "Prompt tokens a request.", token_buckets)
        self.request_generation_tokens = vllm_histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        )
        self._steps = counter("steps", "Forward steps by the worker's path state.", ("state",))
        fraction = gauge("async_step_fraction", "Share of forward steps that took the Steady path.")
        self.async_fraction = fraction.labels(m)
        self.device_idle = histogram(
            "device_idle_seconds", "Device idle time before each program (per step).", IDLE_BUCKETS
        ).labels(m)
        self._materializations = counter(
            "materializations", "Step outputs brought to the host, by thread.", ("thread",)
        )
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(m, reason)
        for state in PATH_STATES if llm.config.async_scheduling else (SYNC_STATE,):
            self._steps.labels(m, state)
        self._steps_by_state = dict.fromkeys(PATH_STATES, 0)
        self._sync_steps = 0
        self._timings: dict[str, _Timing] = {}
        self._programs_seen = 0
        self._next_device_read = 0.0
        self._max_num_seqs = llm.config.max_num_seqs

    # -- the engine thread --------------------------------------------------------------------------

    def observe_turn(self, turn: EngineTurn) -> None:
        m = self.model_name
        stats = turn.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.free_slots.set(stats.num_free_slots)
        self.kv_usage.set(1 - stats.num_free_slots / self._max_num_seqs)
        for request_id, (num_prompt, arrival_s) in turn.arrivals.items():
            self.prompt_tokens.inc(num_prompt)
            self.request_prompt_tokens.observe(num_prompt)
            self._timings[request_id] = _Timing(arrival_s)
        for request_id, scheduled_s in turn.scheduled.items():
            timing = self._timings.get(request_id)
            if timing is not None and timing.scheduled_s is None:
                timing.scheduled_s = scheduled_s
                self.queue_time.observe(scheduled_s - timing.arrival_s)
        finished = False
        for delta in turn.deltas:
            timing = self._timings.get(delta.request_id)
            if delta.new_token_ids:
                self.generation_tokens.inc(len(delta.new_token_ids))
                if timing is not None:
                    if timing.last_token_s is None:
                        self.ttft.observe(turn.now_s - timing.arrival_s)
                        timing.first_token_s = turn.now_s
                    else:
                        self.itl.observe(turn.now_s - timing.last_token_s)
                    timing.last_token_s = turn.now_s
                    timing.num_tokens += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                finished = True
                self._success.labels(m, delta.finish_reason).inc()
                if timing is not None:
                    self._finished(timing, turn.now_s)
                self._timings.pop(delta.request_id, None)
        if stats.sync_steps > self._sync_steps:
            self._steps.labels(m, SYNC_STATE).inc(stats.sync_steps - self._sync_steps)
            self._sync_steps = stats.sync_steps
            self.async_fraction.set(0.0)
        # Throttled (the stats copy is not free), but fresh whenever a request ends: a turn may be the
        # last before the engine goes idle and stops posting turns.
        if finished or time.monotonic() >= self._next_device_read:
            self._read_device_idle()

    def _finished(self, timing: _Timing, now_s: float) -> None:
        self.e2e.observe(now_s - timing.arrival_s)
        self.request_generation_tokens.observe(timing.num_tokens)
        if timing.scheduled_s is not None:
            self.inference_time.observe(now_s - timing.scheduled_s)
            if timing.first_token_s is not None:
                self.prefill_time.observe(timing.first_token_s - timing.scheduled_s)
        if timing.first_token_s is not None:
            self.decode_time.observe(now_s - timing.first_token_s)

    def _read_device_idle(self) -> None:
        """Each program's idle time since the last read."""
        now = time.monotonic()
        self._next_device_read = now + DEVICE_STATS_INTERVAL_S
        stats = self.llm.engine.runtime.stats()
        programs = stats.programs_completed + stats.programs_failed
        new = min(programs - self._programs_seen, len(stats.recent_device_idle_s))
        self._programs_seen = programs
        for idle_s in stats.recent_device_idle_s[len(stats.recent_device_idle_s) - new :] if new > 0 else ():
            self.device_idle.observe(idle_s)

    def on_engine_event(self, record: dict) -> None:
        """A tracer event: `step` (its path state) or `Materialize` (the thread that ran it)."""
        event = record.get("event")
        if event == "step" and record.get("state") in self._steps_by_state:
            state = record["state"]
            self._steps.labels(self.model_name, state).inc()
            self._steps_by_state[state] += 1  # engine thread only: steps are begun there
            total = sum(self._steps_by_state.values())
            self.async_fraction.set(sum(self._steps_by_state[s] for s in ASYNC_STATES) / total)
        elif event == "Materialize":
            self._materializations.labels(self.model_name, str(record.get("thread"))).inc()

    # -- the front end ------------------------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
