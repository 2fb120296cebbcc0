"""Prometheus metrics of the server, named after vLLM's where one exists (prefix `neuron_async_sm_`).

Fed from three places, each on its own thread, all through prometheus_client's thread-safe types:
- `observe_turn`: the engine thread, once per turn (`EngineTurn`): queue gauges, tokens, finishes,
  TTFT / inter-token / end-to-end latency (all measured on the engine thread, from the time the front
  end received the request), the device's idle time before each program;
- `on_engine_event`: the engine's tracer (`Tracer.subscribe`): each step's path state (engine
  thread) and each materialization with the thread that ran it (engine or async-output thread);
- the front end: requests refused before they reached the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from neuron_async_sm.engine.async_llm import EngineTurn
from neuron_async_sm.engine.llm import LLM
from neuron_async_sm.worker.async_machine import ASYNC_STATES, PATH_STATES

PREFIX = "neuron_async_sm_"
SYNC_STATE = "Sync"  # steps_total's label in sync mode: no machine runs, every step blocks on its tokens
DEVICE_STATS_INTERVAL_S = 0.25  # how often the engine thread copies the runtime's per-program stats

# vLLM's bucket bounds, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
IDLE_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0)


@dataclass
class _Timing:
    """One open request's clock, on the engine thread."""

    arrival_s: float
    last_token_s: float | None = None


class ServerMetrics:
    """Every metric of one server, in its own registry (`scrape()` is the /metrics body)."""

    def __init__(self, llm: LLM, model_name: str) -> None:
        self.llm = llm
        disable_created_metrics()  # no `*_created` series (process-wide; vLLM does the same)
        self.registry = r = CollectorRegistry()
        labels = ("model_name",)
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, (*labels, *extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        m = model_name
        self.running = gauge("num_requests_running", "Requests holding a KV slot.").labels(m)
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a KV slot.").labels(m)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV slots in use (0-1).").labels(m)
        self.free_slots = gauge("kv_slots_free", "KV slots no request holds (max_num_seqs at idle).").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens of accepted requests.").labels(m)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(m)
        self._success = counter(
            "request_success", "Finished requests by finish reason (abort and error included).", ("finished_reason",)
        )
        self._rejected = counter("requests_rejected", "Requests refused before the engine ran them.", ("reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS).labels(m)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's tokens.", ITL_BUCKETS).labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS).labels(m)
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
            self._timings[request_id] = _Timing(arrival_s)
        finished = False
        for delta in turn.deltas:
            timing = self._timings.get(delta.request_id)
            if delta.new_token_ids:
                self.generation_tokens.inc(len(delta.new_token_ids))
                if timing is not None:
                    if timing.last_token_s is None:
                        self.ttft.observe(turn.now_s - timing.arrival_s)
                    else:
                        self.itl.observe(turn.now_s - timing.last_token_s)
                    timing.last_token_s = turn.now_s
            if delta.finish_reason is not None:
                finished = True
                self._success.labels(m, delta.finish_reason).inc()
                if timing is not None:
                    self.e2e.observe(turn.now_s - timing.arrival_s)
                self._timings.pop(delta.request_id, None)
        if stats.sync_steps > self._sync_steps:
            self._steps.labels(m, SYNC_STATE).inc(stats.sync_steps - self._sync_steps)
            self._sync_steps = stats.sync_steps
            self.async_fraction.set(0.0)
        # Throttled (the stats copy is not free), but fresh whenever a request ends: a turn may be the
        # last before the engine goes idle and stops posting turns.
        if finished or time.monotonic() >= self._next_device_read:
            self._read_device_idle()

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
