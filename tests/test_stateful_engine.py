"""The real async engine (threads, device process, tiny-llama in float64) against a per-request reference.

A hypothesis state machine whose rules are what a client and the world can do between engine steps:
add a request, abort one (running, waiting, or already finished), step, run until idle, force a
`condense()` reorder, send invalid input, recycle a finished request id, make a device program or an
output's write-back fail, and replace the engine that fault killed. After every rule the invariants
of docs/testing.md hold.

The reference is each request decoded alone (`tests/engine_invariants.py::Reference`): sampling is a
pure function of (logits, seed, output index), so the tokens a request must emit do not depend on
what ran beside it. The engine is reused across examples (a device process costs ~1 s to start):
each example leaves it idle, and only a dead or tainted one is replaced.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
from collections import Counter

import pytest
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.engine_invariants import (
    SMALL_ENGINE,
    TERMINAL,
    EngineHung,
    Reference,
    Spy,
    Tracked,
    check_machine,
    check_scheduler_bounded,
    check_slots,
    check_worker_tokens,
    engine_threads,
    step_or_hang,
)
from support.faulty_runtime import faulty_runtime

from neuron_async_sm import LLM, EngineDeadError, InvalidRequestError, SamplingParams
from neuron_async_sm.worker import async_machine as sm

VOCAB = 1024
MAX_MODEL_LEN = SMALL_ENGINE["max_model_len"]
MAX_STEPS_TO_IDLE = 2_000  # far above any example's need: reaching it means the engine stopped making progress


def _prompt(length: int, seed: int) -> list[int]:
    return [random.Random(seed * 131 + i).randrange(VOCAB) for i in range(length)]


# A prompt is drawn as (length, seed), not token by token: dozens of requests per example would
# otherwise overrun hypothesis's per-example data budget. The length shrinks; contents barely matter.
PROMPTS = st.builds(_prompt, st.integers(1, MAX_MODEL_LEN - 1), st.integers(0, 2**16))
SHORT_PROMPTS = st.builds(_prompt, st.integers(1, 8), st.integers(0, 2**16))
SAMPLING = st.fixed_dictionaries(
    dict(
        max_tokens=st.integers(1, 16),
        temperature=st.sampled_from([0.0, 0.7, 1.3]),
        top_k=st.sampled_from([0, 1, 5, 50]),
        top_p=st.sampled_from([1.0, 0.9, 0.5]),
        seed=st.integers(0, 2**31),
        unseeded=st.booleans(),
        ignore_eos=st.booleans(),
    )
)


def _params(sampling: dict, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """Only greedy requests go unseeded. The engine draws a missing seed from how many requests it has
    accepted so far, and the engine outlives examples: a sampled unseeded request would draw other
    tokens in a replay, so hypothesis would see a different run (FlakyStrategyDefinition)."""
    fields = dict(sampling)
    if fields.pop("unseeded") and fields["temperature"] == 0:
        fields["seed"] = None
    return SamplingParams(**fields, stop_token_ids=stop_token_ids)


STOP_PICK = st.none() | st.integers(0, 15)  # make the reference's n-th token a stop token (when it is known)
EXTRA_STOPS = st.lists(st.integers(3, VOCAB - 1), max_size=3)

_REFERENCE: Reference | None = None
_ENGINES: dict[str, tuple[LLM, Spy, set[threading.Thread]]] = {}  # device -> engine reused across examples
_EXAMPLES = itertools.count()  # request ids are unique across examples: the engine outlives them
COVERAGE: Counter[str] = Counter()  # path states and events over every example of this session
# Set to a folder, every engine started from then on writes its trace there (`--trace`), one file per
# engine; model_check/test_trace_validation.py runs this machine so and has TLC validate the traces.
TRACE_DIR: str | None = None
_TRACES = itertools.count()


def reference() -> Reference:
    global _REFERENCE
    if _REFERENCE is None:
        _REFERENCE = Reference(MAX_MODEL_LEN)
    return _REFERENCE


def _new_engine(key: str) -> tuple[LLM, Spy, set[threading.Thread]]:
    """The engine of `key` (a device, or a name whose ENGINE_EXTRA names its device)."""
    before = set(threading.enumerate())
    extra = dict(ENGINE_EXTRA[key])
    device = extra.pop("device", key)
    llm = LLM(
        "tiny-llama",
        device=device,
        async_scheduling=True,
        runtime_factory=faulty_runtime,  # the inject_failure rule's seam
        **SMALL_ENGINE,
        **extra,
        **({} if TRACE_DIR is None else {"trace_path": f"{TRACE_DIR}/{device}-engine{next(_TRACES)}.ndjson"}),
    )
    COVERAGE["engines started"] += 1
    return llm, Spy(llm), engine_threads(before)


def _discard_engine(device: str, *, check: bool = True) -> None:
    llm, _, threads = _ENGINES.pop(device)
    llm.close()
    for thread in threads:
        thread.join(timeout=10)
        assert not check or not thread.is_alive(), f"{thread.name} outlived its engine"


def _reusable(llm: LLM, spy: Spy) -> bool:
    """Alive, idle and passing every engine-wide check. Otherwise a failed example left it tainted, and
    reusing it would make the replay of that failure fail at once, with a story that explains nothing."""
    if llm.engine.dead_reason or llm.has_unfinished_requests() or llm.engine.scheduler.requests:
        return False
    try:
        check_slots(llm)
        check_machine(llm)
        check_scheduler_bounded(llm)
        spy.check_materialized(llm)
    except AssertionError:
        return False
    return not spy.outputs


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for device in list(_ENGINES):
        _discard_engine(device)


class EngineVsReference(RuleBasedStateMachine):
    """Rules: the client and the world between steps. Invariants: docs/testing.md, checked after each rule."""

    DEVICE = "cpu"
    FAULT_PERCENT = 10  # examples in which the fault rules may fire (each death costs a new engine)

    def __init__(self) -> None:
        super().__init__()
        entry = _ENGINES.get(self.DEVICE)
        if entry is not None and not _reusable(entry[0], entry[1]):
            _discard_engine(self.DEVICE, check=False)
            entry = None
        if entry is None:
            entry = _ENGINES[self.DEVICE] = _new_engine(self.DEVICE)
        self.llm, self.spy, self.threads = entry
        self.spy.write_backs.clear()  # all checked by the previous example, or by a discarded engine
        self.example, self.ids_made = next(_EXAMPLES), 0
        self.tracked: dict[str, Tracked] = {}  # request id -> its latest incarnation (creation order)
        self.retired: list[Tracked] = []  # earlier incarnations of recycled ids, and requests of dead engines
        self.faults_allowed = False
        self.armed: str | None = None  # a fault is injected and has not fired yet: what the death will say
        self.hung = False  # a step never returned: the engine is abandoned, not closed (close would wait on it)
        self.steps_at_start = self.llm.engine.num_steps
        self.counts_at_start = dict(self.llm.engine.runner.machine.state_counts)

    # -- helpers ------------------------------------------------------------------------------------

    def _new_id(self) -> str:
        # Candidates for a draw are listed in creation order, never sorted by id: ids differ between a
        # run and its replay, and a sorted order would make the same draw pick another request (flaky).
        self.ids_made += 1
        return f"x{self.example}-r{self.ids_made}"

    @property
    def alive(self) -> bool:
        return self.llm.engine.dead_reason is None

    @property
    def dead(self) -> bool:
        return not self.alive

    def _add(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        rid = self.llm.add_request(prompt, params, request_id or self._new_id())
        seed = self.llm.engine.scheduler.requests[rid].seed  # the effective seed (drawn if params.seed is None)
        full = reference().full(prompt, params, seed)
        expected, reason = Reference.expected(full, params)
        if rid in self.tracked:
            self.retired.append(self.tracked[rid])
        self.tracked[rid] = Tracked(rid, list(prompt), params, seed, full, expected, reason)
        stops = f" stops={list(params.stop_token_ids)}" if params.stop_token_ids else ""
        note(
            f"add {rid}: prompt[{len(prompt)}] max_tokens={params.max_tokens} T={params.temperature} "
            f"top_k={params.top_k} top_p={params.top_p} seed={params.seed}{stops} ignore_eos={params.ignore_eos}"
            f" -> reference {reason} after {len(expected)}"
        )
        return rid

    def _apply(self, deltas) -> None:
        for delta in deltas:
            request = self.tracked[delta.request_id]
            assert request.finish is None, f"{delta.request_id} got {delta} after it finished {request.finish}"
            assert delta.finish_reason is None or delta.finish_reason in TERMINAL, delta
            request.emitted.extend(delta.new_token_ids)
            request.finish, request.error = delta.finish_reason, delta.error

    def _step(self) -> None:
        machine = self.llm.engine.runner.machine
        before = dict(machine.state_counts)
        try:
            deltas = step_or_hang(self.llm)
        except EngineHung:
            self.hung = True
            raise
        self._apply(deltas)
        paths = [s for s, n in machine.state_counts.items() if n > before[s]]
        told = ", ".join(
            f"{d.request_id}+{d.new_token_ids}" + (f" {d.finish_reason}" if d.finish_reason else "") for d in deltas
        )
        note(f"step {self.llm.engine.num_steps}: {paths[0] if paths else 'nothing enqueued'}; {told or 'no output'}")
        if self.dead:
            note(f"engine died: {self.llm.engine.dead_reason}")
            assert self.armed and self.armed in self.llm.engine.dead_reason, "the engine died on its own"
            COVERAGE["engine deaths"] += 1
            COVERAGE[f"deaths by {self.armed}"] += 1
            self.armed = None
            self._check_died_cleanly()

    def _until_idle(self) -> None:
        for _ in range(MAX_STEPS_TO_IDLE):
            if self.dead or not self.llm.has_unfinished_requests():
                return
            self._step()
        raise AssertionError(f"not idle after {MAX_STEPS_TO_IDLE} steps: the engine stopped making progress")

    def _check_died_cleanly(self) -> None:
        """After a fault: every in-flight request ended in error, nothing pending, no thread left behind."""
        engine = self.llm.engine
        assert not engine.batch_queue and engine.runner.pending is None
        assert engine.runner.machine.state == sm.IDLE  # drained
        assert not self.llm.has_unfinished_requests()
        for thread in self.threads:
            thread.join(timeout=10)
            assert not thread.is_alive(), f"{thread.name} still runs after the engine died"

    def _live_ids(self) -> set[str]:
        scheduler = self.llm.engine.scheduler
        return {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}

    # -- rules --------------------------------------------------------------------------------------

    @initialize(roll=st.integers(0, 99))
    def choose_faults(self, roll: int) -> None:
        self.faults_allowed = roll < self.FAULT_PERCENT
        note(f"engine on device={self.DEVICE!r}, faults {'allowed' if self.faults_allowed else 'off'}")

    @rule(prompt=PROMPTS, sampling=SAMPLING, stop_pick=STOP_PICK, extra_stops=EXTRA_STOPS)
    def add_request(self, prompt: list[int], sampling: dict, stop_pick: int | None, extra_stops: list[int]) -> None:
        params = _params(sampling, tuple(extra_stops))
        if self.dead:  # a later call gets a clear error, and changes nothing
            note("add to the dead engine")
            with pytest.raises(EngineDeadError, match="engine is dead: "):
                self.llm.add_request(prompt, params)
            return
        if stop_pick is not None:  # a stop the request really reaches
            full = reference().full(prompt, params, params.seed or 0)  # greedy ignores the seed
            if stop_pick < len(full):
                params = _params(sampling, (*extra_stops, full[stop_pick]))
        self._add(prompt, params)

    @precondition(lambda self: self.alive and self.llm.engine.scheduler.running)
    @rule(data=st.data())
    def abort_running(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([r.request_id for r in self.llm.engine.scheduler.running]))
        self._abort(rid)

    @precondition(lambda self: self.alive and self.llm.engine.scheduler.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([r.request_id for r in self.llm.engine.scheduler.waiting]))
        self._abort(rid)

    def _abort(self, rid: str) -> None:
        delta = self.llm.abort(rid)
        note(f"abort {rid} -> {delta}")
        assert delta is not None and delta.finish_reason == "abort" and not delta.new_token_ids
        self._apply([delta])
        assert rid not in self._live_ids()
        COVERAGE["aborts"] += 1

    @precondition(lambda self: any(r.finish for r in self.tracked.values()))
    @rule(data=st.data())
    def abort_finished(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([r for r, t in self.tracked.items() if t.finish]))
        note(f"abort finished {rid}")
        assert self.llm.abort(rid) is None  # no second finish, nothing else changes

    @rule()
    def advance_step(self) -> None:
        if self.dead:
            note("step the dead engine")
            with pytest.raises(EngineDeadError, match="engine is dead: "):
                self.llm.step()
            return
        self._step()

    @precondition(lambda self: self.alive)
    @rule()
    def advance_until_idle(self) -> None:
        self._until_idle()

    @precondition(lambda self: self.alive)
    @rule(prompt=SHORT_PROMPTS, short=st.integers(1, 3), extra=st.integers(2, 6))
    def finish_middle_slot(self, prompt: list[int], short: int, extra: int) -> None:
        """Three requests side by side; the middle one stops first, so condense() moves the last into its row."""
        long_params = SamplingParams(max_tokens=short + extra, ignore_eos=True)
        ids = [
            self._add(prompt, long_params),
            self._add(prompt, SamplingParams(max_tokens=short, ignore_eos=True)),
            self._add(prompt, long_params),
        ]
        middle = self.tracked[ids[1]]
        for _ in range(MAX_STEPS_TO_IDLE):
            if middle.finish or self.dead:
                break
            self._step()
        for _ in range(2):  # the step that drops it from the set, then the one after condense()
            if self.alive and self.llm.has_unfinished_requests():
                self._step()

    @precondition(lambda self: self.alive)
    @rule(kind=st.sampled_from(["vocab", "empty", "too_long", "duplicate"]), prompt=PROMPTS)
    def add_invalid_request(self, kind: str, prompt: list[int]) -> None:
        """Rejected with a message naming the field; nothing else changes."""
        scheduler = self.llm.engine.scheduler
        before = (list(scheduler.requests), [r.request_id for r in scheduler.running], len(scheduler.waiting))
        live = [r for r in self.tracked if r in self._live_ids()]
        request_id, field = None, "prompt_token_ids"
        if kind == "vocab":
            prompt = [*prompt[:-1], VOCAB]
        elif kind == "empty":
            prompt = []
        elif kind == "too_long":
            prompt = (prompt * MAX_MODEL_LEN)[:MAX_MODEL_LEN]
        elif live:
            request_id, field = live[0], "request_id"
        else:
            prompt = [-1]
        note(f"add invalid ({kind}) id={request_id} prompt[{len(prompt)}]")
        with pytest.raises(InvalidRequestError, match=f"^{field}: "):
            self.llm.add_request(prompt, SamplingParams(), request_id or self._new_id())
        after = (list(scheduler.requests), [r.request_id for r in scheduler.running], len(scheduler.waiting))
        assert after == before

    @precondition(lambda self: self.alive and any(r.finish for r in self.tracked.values()))
    @rule(data=st.data(), prompt=PROMPTS, sampling=SAMPLING)
    def recycle_finished_id(self, data: st.DataObject, prompt: list[int], sampling: dict) -> None:
        """A finished request's id is reused: refused while a step in flight still mentions it, then accepted."""
        rid = data.draw(st.sampled_from([r for r, t in self.tracked.items() if t.finish]))
        self.spy.check_ownership(self.tracked)  # every write-back so far belongs to the old incarnation
        params = _params(sampling)
        if rid in self.llm.engine.scheduler.requests:
            note(f"recycle {rid}: refused, a step in flight still mentions it")
            with pytest.raises(InvalidRequestError, match="^request_id: duplicate"):
                self.llm.add_request(prompt, params, rid)
        else:
            note(f"recycle {rid}")
            self._add(prompt, params, rid)
            COVERAGE["recycled ids"] += 1

    @precondition(lambda self: self.alive and self.faults_allowed and not self.armed)
    @rule(after=st.integers(0, 3))
    def inject_failure(self, after: int) -> None:
        note(f"the program enqueued {after} programs from now will fail")
        self.llm.engine.runtime.inject_failure(after=after)
        self.armed = "injected failure"
        COVERAGE["failures injected"] += 1

    @precondition(lambda self: self.alive and self.faults_allowed and not self.armed)
    @rule(after=st.integers(0, 3))
    def fail_write_back(self, after: int) -> None:
        """The materialization of a coming step raises: in the async output thread, or in the main thread
        when a break materializes it first. Surfaced to the client as errors, never swallowed, never a hang."""
        step = self.llm.engine.scheduler._next_step_id + after
        note(f"the write-back of step {step} will raise")
        self.spy.explode_at_step = step
        self.armed = "write-back exploded"
        COVERAGE["write-back faults"] += 1

    @precondition(lambda self: self.dead)
    @rule()
    def replace_dead_engine(self) -> None:
        """A new engine in the same process works (the invariants hold for it from here on)."""
        self.retired.extend(self.tracked.values())
        self.tracked = {}
        _discard_engine(self.DEVICE)
        self.llm, self.spy, self.threads = _ENGINES[self.DEVICE] = _new_engine(self.DEVICE)
        self.steps_at_start, self.counts_at_start = 0, dict(self.llm.engine.runner.machine.state_counts)
        note("replaced the dead engine")

    # -- invariants (docs/testing.md) ---------------------------------------------------------------

    @invariant()
    def tokens_are_reference_prefixes(self) -> None:
        COVERAGE["invariant checks"] += 1  # once after initialization and after every rule
        for request in [*self.tracked.values(), *self.retired]:
            request.check()

    @invariant()
    def outputs_materialized_once(self) -> None:
        self.spy.check_materialized(self.llm)

    @invariant()
    def tokens_owned_by_snapshot_rows(self) -> None:
        self.spy.check_ownership(self.tracked)
        check_worker_tokens(self.llm, self.tracked)

    @invariant()
    def machine_legal_and_counters_add_up(self) -> None:
        check_machine(self.llm)

    @invariant()
    def requests_that_left_have_terminal_results(self) -> None:
        live = self._live_ids()
        for rid, request in self.tracked.items():
            if rid in live:
                assert request.finish is None, f"{rid} still runs but the client saw {request.finish}"
            else:
                assert request.finish in TERMINAL, f"{rid} left the engine without a terminal result"
        assert all(r.finish in TERMINAL for r in self.retired)

    @invariant()
    def released_requests_end_within_their_turn(self) -> None:
        # The relay's early release (`Scheduler._release_slot`) gives a request's KV slot back while its
        # last token is in flight in the step popped later in the same turn: between turns no request
        # is left released-but-unfinished (invisible to `running`, so to an abort or a running gauge).
        released = [r.request_id for r in self.llm.engine.scheduler.releasing]
        assert not released, f"released requests still unfinished between turns: {released}"

    @invariant()
    def kv_slots_and_scheduler_bounded(self) -> None:
        check_slots(self.llm)
        check_scheduler_bounded(self.llm)

    def teardown(self) -> None:
        """Leave the shared engine idle for the next example; retire it if a failure is still armed."""
        if self.hung:
            _ENGINES.pop(self.DEVICE, None)
            return
        if self.alive and not self.armed:
            self._until_idle()
        if self.alive and not self.armed:
            self.spy.check_materialized(self.llm)
            assert not self.spy.outputs, "idle, yet an output was never applied"
            assert self.llm.engine.scheduler.requests == {}, "idle, yet the scheduler still tracks requests"
            assert len(self.llm.engine.runner.batch.requests) <= self.llm.config.max_num_seqs
            for request in self.tracked.values():
                request.check()
                assert request.finish in TERMINAL
        elif self.DEVICE in _ENGINES and _ENGINES[self.DEVICE][0] is self.llm:
            _discard_engine(self.DEVICE)  # dead, or a failure armed that would fire in the next example
        counts = self.llm.engine.runner.machine.state_counts
        reached = [s for s in sm.PATH_STATES if counts[s] > self.counts_at_start.get(s, 0)]
        for state in reached:
            event(f"reached {state}")
            COVERAGE[state] += 1
        COVERAGE["examples"] += 1
        COVERAGE["steps"] += self.llm.engine.num_steps - self.steps_at_start


class EngineOnDeviceProcess(EngineVsReference):
    DEVICE = "cpu"  # the default backend: the device is a separate process, host and device overlap
    FAULT_PERCENT = 10


class EngineInProcess(EngineVsReference):
    DEVICE = "cpu-inprocess"  # the device loop on a thread: a dead engine is cheap to replace, so more faults
    FAULT_PERCENT = 25


class EngineWithSpeculation(EngineVsReference):
    """n-gram speculation (k = 3) on the device process. Greedy requests only: with speculation a
    sampled request draws from the target's distribution, not the reference's tokens
    (docs/spec-decode.md §8); greedy ones must give the reference's tokens exactly."""

    DEVICE = "cpu-spec"  # an engine key (ENGINE_EXTRA): the device process, with speculation
    FAULT_PERCENT = 0  # the fault seam fails the plain step program, which a spec engine does not run

    def _add(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        greedy = dataclasses.replace(params, temperature=0.0, seed=None)
        rid = super()._add(prompt, greedy, request_id)
        # A row scheduled while earlier rows' drafts are in flight may verify drafts past max_tokens
        # (docs/spec-decode.md §5): computed and written into the worker's batch, never emitted. What
        # the worker may hold is the greedy continuation up to max_model_len; what the client sees
        # stays `expected`.
        to_the_limit = dataclasses.replace(greedy, max_tokens=MAX_MODEL_LEN - len(prompt))
        self.tracked[rid].full = reference().full(prompt, to_the_limit, self.tracked[rid].seed)
        return rid

    @invariant()
    def host_drafts_break_every_step_with_a_pending_future(self) -> None:
        """n-gram drafts need the newest token on the host: no step but the first after a drain overlaps
        (HostDraftBreak, docs/spec-decode.md §6), and each is counted as a sync fallback."""
        machine = self.llm.engine.runner.machine
        others = {
            s: n for s, n in machine.state_counts.items() if n and s not in (sm.NO_PENDING_FUTURE, sm.HOST_DRAFT_BREAK)
        }
        assert not others and machine.async_steps == 0, machine.counters()

    @invariant()
    def placeholders_are_the_rows_in_flight(self) -> None:
        """SpecDecode.tla's PlaceholderInv on the real scheduler: a request's placeholders are the
        1 + drafts of its sampling rows in flight, and, its prompt computed, its optimistic computed
        count is its prompt + outputs received + placeholders - 1 (the newest token is not computed)."""
        scheduler = self.llm.engine.scheduler
        reserved: Counter[str] = Counter()
        for step in scheduler._unapplied:
            for req_id in step.sampling_req_ids:
                reserved[req_id] += 1 + step.num_draft_tokens.get(req_id, 0)
        for req_id, request in scheduler.requests.items():
            assert request.num_output_placeholders == reserved[req_id], (req_id, request.num_output_placeholders)
            if not request.is_finished and request.num_computed_tokens >= request.num_prompt_tokens:
                received = request.num_prompt_tokens + len(request.output_token_ids)
                assert request.num_computed_tokens == received + request.num_output_placeholders - 1, req_id


class EngineWithDraftModel(EngineWithSpeculation):
    """draft_model speculation (k = 3) in process: tiny-llama drafting for itself, so greedy drafts are
    all accepted and a batch that keeps its rows runs on the device's rows (SpecSteady, SpecExit)."""

    DEVICE = "cpu-draft"

    @invariant()
    def host_drafts_break_every_step_with_a_pending_future(self) -> None:
        """Not n-gram: no row breaks for host drafts, and a drafted future never feeds a plain Steady."""
        counts = self.llm.engine.runner.machine.state_counts
        assert counts[sm.HOST_DRAFT_BREAK] == counts[sm.STEADY] == 0, counts


# The in-process engine also runs under back-pressure: with a runtime queue of one program, every
# enqueue of the two-deep pipeline waits for the device. The device-process engine runs with the relay
# (the default), the in-process one without it (the design's breaks, rebuilds and remaps).
ENGINE_EXTRA: dict[str, dict] = {
    "cpu": {"async_relay": True},
    "cpu-inprocess": {"runtime_queue_depth": 1, "async_relay": False},
    "cpu-spec": {"device": "cpu", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "cpu-draft": {
        "device": "cpu-inprocess",
        "speculative_config": {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3},
    },
}


_SHARE = {"cpu": 0.5, "cpu-inprocess": 0.5, "cpu-spec": 0.25, "cpu-draft": 0.05}  # of the profile's max_examples


def _settings(device: str) -> settings:
    return settings(max_examples=max(1, int(settings.default.max_examples * _SHARE[device])))


TestEngineOnDeviceProcess = EngineOnDeviceProcess.TestCase
TestEngineOnDeviceProcess.settings = _settings("cpu")
TestEngineInProcess = EngineInProcess.TestCase
TestEngineInProcess.settings = _settings("cpu-inprocess")
TestEngineWithSpeculation = EngineWithSpeculation.TestCase
TestEngineWithSpeculation.settings = _settings("cpu-spec")
TestEngineWithDraftModel = EngineWithDraftModel.TestCase
TestEngineWithDraftModel.settings = _settings("cpu-draft")


def test_stateful_runs_reach_every_path_state_and_fault():
    """Coverage of the runs above (this session): every path state, aborts, recycled ids and a failure."""
    if COVERAGE["examples"] == 0:
        pytest.skip("the stateful engine tests did not run in this session")
    print(f"stateful engine coverage: {dict(COVERAGE)}")
    # SpecExit needs every row of a step to have turned speculation off at once: drawn examples reach it
    # now and then, tests/test_spec_draft_model.py builds it on purpose.
    missing = [s for s in sm.PATH_STATES if COVERAGE[s] == 0 and s != sm.SPEC_EXIT]
    if COVERAGE["examples"] < 100:  # a short (dev) run draws the draft-model machine twice: SpecSteady is luck
        missing = [s for s in missing if s != sm.SPEC_STEADY]
    assert not missing, f"no example reached {missing}: {dict(COVERAGE)}"
    assert COVERAGE["aborts"] and COVERAGE["recycled ids"], dict(COVERAGE)
    if COVERAGE["examples"] >= 100:  # faults are drawn per example: a short (dev) run may miss them
        assert COVERAGE["engine deaths"], dict(COVERAGE)
