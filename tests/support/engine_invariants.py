"""What the engine-level tests hold the async engine to: a per-request reference decode and the checks
they share (stateful engine machine, aborts, soak). Test-side only; reads engine internals, never changes them.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.model import TINY_LLAMA, TINY_LLAMA_CONFIG, ModelSpec, build_step_program
from neuron_async_sm.outputs import StepSnapshot
from neuron_async_sm.trace import StepObserver
from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.input_batch import POISON_TOKEN
from support.reference import generate_alone

TERMINAL = frozenset({"stop", "length", "abort", "error"})
EOS = frozenset(TINY_LLAMA_CONFIG.eos_token_ids)

# Small enough to hit every path quickly: 4 slots (waiting queue), a 16-token budget (chunked
# prefill), decode buckets 1/2/4 (bucket changes), 64 positions (max_model_len stops).
# float64: a request's tokens do not depend on the batch it ran in (see docs/design.md).
SMALL_ENGINE = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=64,
    max_num_batched_tokens=16,
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4),
)


class Reference:
    """Each request decoded alone (`generate_alone` on a private one-slot program): the tokens it must emit.

    Sampling is a pure function of (logits, seed, output index), so a request's tokens do not depend on
    its batch; `full()` ignores stops, `expected()` applies the scheduler's stop rules to it.
    """

    def __init__(self, max_model_len: int, dtype: str = "float64", seed: int = 0) -> None:
        self.max_model_len = max_model_len
        self.program = build_step_program(ModelSpec(TINY_LLAMA, dtype, 1, max_model_len, seed))
        self._cache: dict[tuple, tuple[int, ...]] = {}

    def full(self, prompt: list[int], params: SamplingParams, seed: int) -> tuple[int, ...]:
        """Every token the request may sample: up to max_tokens and max_model_len, stops ignored."""
        n = min(params.max_tokens, self.max_model_len - len(prompt))
        greedy = params.temperature == 0  # greedy ignores seed, top_k and top_p
        key = (tuple(prompt),) if greedy else (tuple(prompt), params.temperature, params.top_k, params.top_p, seed)
        cached = self._cache.get(key, ())
        if len(cached) < n:
            sampling = (
                {}
                if greedy
                else dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
            )
            # One torch thread: the device process computes at the same time, and two host threads
            # spinning at OpenMP barriers beside it made this ~7x slower on a 2-core machine.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cached = tuple(generate_alone(self.program, prompt, n, **sampling))
            finally:
                torch.set_num_threads(threads)
            self._cache[key] = cached
        return cached[:n]

    @staticmethod
    def expected(full: tuple[int, ...], params: SamplingParams) -> tuple[tuple[int, ...], str]:
        """The tokens and finish reason of a request that runs to its end (the scheduler's stop order)."""
        for i, token in enumerate(full):
            if (token in EOS and not params.ignore_eos) or token in params.stop_token_ids:
                return full[: i + 1], "stop"
        return full, "length"


@dataclass
class Tracked:
    """One request as the client saw it, next to what the reference says it must see."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    full: tuple[int, ...]  # reference tokens, stops ignored
    expected: tuple[int, ...]  # reference tokens up to and including the stop
    expected_reason: str
    emitted: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None

    def check(self) -> None:
        """Prefix of the reference, in order, never past a stop; a natural finish is exactly the reference."""
        rid, emitted = self.request_id, self.emitted
        assert emitted == list(self.full[: len(emitted)]), f"{rid}: {emitted} is not a prefix of {self.full}"
        assert len(emitted) <= len(self.expected), f"{rid}: tokens past the stop: {emitted} vs {self.expected}"
        if self.finish in ("stop", "length"):
            assert (tuple(self.emitted), self.finish) == (self.expected, self.expected_reason), (
                f"{rid} finished {self.finish} with {self.emitted}; reference {self.expected_reason} {self.expected}"
            )
        if self.finish == "error":
            assert self.error, f"{rid}: error without a message"


class Spy(StepObserver):
    """Records every step output the engine makes and materializes (from its trace events) and every
    token write-back, without changing them; on request, makes the write-back of one step raise (an
    output-thread fault).

    The engine's step observer (`Tracer.observe`) and a subscriber to its trace: both run inside the
    engine's own code paths, exactly the ones that run in production.
    """

    def __init__(self, llm: LLM) -> None:
        self.outputs: set[int] = set()  # steps whose output was made (reinstate) or materialized, not yet checked
        self.materialized: Counter[int] = Counter()  # step -> Materialize events (the output's transfers)
        self.write_backs: list[tuple[StepSnapshot, list[int]]] = []  # appended by whichever thread materializes
        self.explode_at_step: int | None = None  # this step's write-back raises, in whichever thread runs it
        llm.engine.tracer.observe(self)
        llm.engine.tracer.subscribe(self._on_event)

    def _on_event(self, record: dict) -> None:
        if record["event"] == "reinstate":  # the step's output was made: the runner's pending step
            self.outputs.add(record["step"])
        elif record["event"] == "Materialize":
            self.outputs.add(record["step"])
            self.materialized[record["step"]] += 1

    def write_back(self, snapshot: StepSnapshot, tokens: list[int]) -> None:
        if snapshot.step_id == self.explode_at_step:
            raise RuntimeError(f"write-back exploded at step {snapshot.step_id}")
        self.write_backs.append((snapshot, list(tokens)))

    def check_materialized(self, llm: LLM) -> None:
        """At most once for every output; exactly once for every step the engine core has applied."""
        queued = {step.scheduled.step_id for step in llm.engine.batch_queue or ()}
        still_open = set()
        for step_id in sorted(self.outputs):
            count = self.materialized[step_id]
            assert count <= 1, f"step {step_id} materialized {count} times"
            if step_id in queued:
                still_open.add(step_id)
            else:
                assert count == 1, f"step {step_id} left the batch queue but was materialized {count} times"
                del self.materialized[step_id]
        self.outputs = still_open  # checked for good: forget them (keeps long runs flat)

    def check_ownership(self, tracked: dict[str, Tracked]) -> None:
        """Every written-back token is the reference token of the request named in that row of its snapshot."""
        log, self.write_backs = self.write_backs, []
        for snapshot, tokens in log:
            for req_id, position, token in zip(snapshot.req_ids, snapshot.sample_positions, tokens, strict=True):
                if position is None:  # a partial prefill chunk's row samples nothing
                    continue
                request = tracked[req_id]
                index = position - len(request.prompt)
                assert 0 <= index < len(request.full), f"step {snapshot.step_id}: {req_id} sampled output #{index}"
                assert token == request.full[index], (
                    f"step {snapshot.step_id}: row of {req_id} got {token}, its reference #{index} is "
                    f"{request.full[index]} (a token of another request?)"
                )


def check_slots(llm: LLM) -> None:
    """KV slots: every slot is free or held by exactly one running request; never freed twice."""
    scheduler = llm.engine.scheduler
    held = [r.kv_slot for r in scheduler.running]
    assert sorted(scheduler._free_slots + held) == list(range(llm.config.max_num_seqs)), (
        f"free {scheduler._free_slots} + held {held}"
    )
    assert all(r.kv_slot is None for r in scheduler.waiting)
    worker_slots = [s.kv_slot for s in llm.engine.runner.batch.requests.values()]
    assert len(set(worker_slots)) == len(worker_slots), f"two worker rows share a KV slot: {worker_slots}"


def check_machine(llm: LLM) -> None:
    """Between steps the machine rests (Idle or Reinstate, matching the pending step) and the counters add up."""
    engine, runner = llm.engine, llm.engine.runner
    machine = runner.machine
    assert machine.state in (sm.IDLE, sm.REINSTATE), f"between steps in {machine.state}"
    assert (machine.state == sm.REINSTATE) == (runner.pending is not None), (machine.state, runner.pending)
    assert machine.async_steps + machine.sync_fallback_steps == engine.num_steps, (machine.counters(), engine.num_steps)
    assert sum(machine.state_counts.values()) == engine.num_steps, (machine.counters(), engine.num_steps)
    async_steps = sum(machine.state_counts[s] for s in sm.ASYNC_STATES)
    assert machine.async_steps == async_steps, f"only {sorted(sm.ASYNC_STATES)} are async: {machine.counters()}"
    if not llm.config.async_relay:
        assert machine.state_counts[sm.RELAY] == 0, f"relayed with the relay off: {machine.counters()}"


def check_worker_tokens(llm: LLM, tracked: dict[str, Tracked]) -> None:
    """The worker's host copy of every request is its prompt + reference tokens (or POISON while in a future)."""
    for req_id, state in llm.engine.runner.batch.requests.items():
        request = tracked.get(req_id)
        if request is None or (request.prompt, request.seed) != (state.prompt_token_ids, state.seed):
            continue  # a previous owner of a recycled id, removed at the next schedule
        assert state.token_ids[: len(request.prompt)] == request.prompt
        for index, token in enumerate(state.token_ids[len(request.prompt) :]):
            assert token in (POISON_TOKEN, request.full[index]), f"{req_id}: worker holds {token} at output #{index}"


def check_scheduler_bounded(llm: LLM) -> None:
    """The scheduler tracks a finished request only while a step in flight still mentions it."""
    scheduler = llm.engine.scheduler
    for req_id, request in scheduler.requests.items():
        assert not request.is_finished or scheduler.num_steps_in_flight(req_id) > 0, f"{req_id} lingers"
    for step in scheduler._unapplied:  # token ownership: a step in flight only mentions tracked requests
        assert set(step.num_scheduled_tokens) <= set(scheduler.requests), step.step_id


STEP_TIMEOUT_S = 60.0  # far above any step here: past it, the engine hangs


class EngineHung(AssertionError):
    """A step never returned; the engine is unusable (its stuck step still runs on a helper thread)."""


class _Driver:
    """One long-lived daemon thread that drives engine steps for the tests.

    Not a thread per step: every new thread that runs torch code gets its own OpenMP team, and with a
    few dozen of them spinning, steps on a 2-core machine took 10x longer.
    """

    NAME = "test-step-driver"

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=self.NAME, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append(fn())
            except BaseException as exc:  # handed to the caller
                box.append(exc)
            done.set()

    def call(self, fn, timeout: float) -> tuple[bool, list]:
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        return done.wait(timeout), box


_driver: _Driver | None = None


def step_or_hang(llm: LLM) -> list:
    """`llm.step()`, failing the test instead of hanging it when the step never returns (e.g. a lost output)."""
    global _driver
    if _driver is None:
        _driver = _Driver()
    returned, box = _driver.call(llm.step, STEP_TIMEOUT_S)
    if not returned:
        _driver = None  # abandoned with its stuck step: a daemon thread, it cannot hold up the exit
        raise EngineHung(f"llm.step() did not return within {STEP_TIMEOUT_S:.0f} s: the engine hangs")
    [result] = box
    if isinstance(result, BaseException):
        raise result
    return result


def engine_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since `before` was taken (an engine's output thread, device receiver, device loop)."""
    return {t for t in set(threading.enumerate()) - before if t.name != _Driver.NAME}
