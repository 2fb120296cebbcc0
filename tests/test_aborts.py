"""Aborts at every point of the two-deep async pipeline, on the device-process backend.

The points: before the request is scheduled (waiting, or not yet stepped), while a step that holds it
is in flight on the device, and while the async output thread is materializing that step's output.
Whatever the point, the request ends with `abort`, its KV slot is freed exactly once, none of its
tokens reaches the client after the abort, and the requests beside it still get exactly their
reference tokens.
"""

from __future__ import annotations

import threading

import pytest
from support.engine_invariants import (
    SMALL_ENGINE,
    Reference,
    Tracked,
    check_machine,
    check_scheduler_bounded,
    check_slots,
    step_or_hang,
)

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.outputs import StepSnapshot
from neuron_async_sm.trace import StepObserver
from neuron_async_sm.worker import async_machine as sm

DEVICE_TIME_MS = 10  # each program runs at least this long: a step just enqueued is really in flight
LONG = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(SMALL_ENGINE["max_model_len"])


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", device="cpu", device_time_ms=DEVICE_TIME_MS, **SMALL_ENGINE) as engine:
        yield engine


class Client:
    """Adds requests, steps, aborts; records what the client sees and checks it after every call."""

    def __init__(self, llm: LLM, reference: Reference) -> None:
        self.llm, self.reference = llm, reference
        self.requests: dict[str, Tracked] = {}
        self.aborted_at: dict[str, int] = {}  # request id -> tokens it had when aborted

    def add(self, rid: str, prompt: list[int], params: SamplingParams = LONG) -> None:
        self.llm.add_request(prompt, params, rid)
        seed = self.llm.engine.scheduler.requests[rid].seed
        full = self.reference.full(prompt, params, seed)
        self.requests[rid] = Tracked(rid, prompt, params, seed, full, *Reference.expected(full, params))

    def step(self) -> None:
        for delta in step_or_hang(self.llm):
            request = self.requests[delta.request_id]
            assert request.finish is None, f"{delta.request_id}: {delta} after it finished {request.finish}"
            request.emitted.extend(delta.new_token_ids)
            request.finish = delta.finish_reason
        self.check()

    def abort(self, rid: str) -> None:
        delta = self.llm.abort(rid)
        assert delta is not None and delta.finish_reason == "abort" and delta.new_token_ids == []
        self.requests[rid].finish = "abort"
        self.aborted_at[rid] = len(self.requests[rid].emitted)
        assert self.llm.abort(rid) is None  # a second abort changes nothing
        self.check()

    def run_until_idle(self) -> None:
        for _ in range(500):
            if not self.llm.has_unfinished_requests():
                break
            self.step()
        assert not self.llm.has_unfinished_requests()
        assert self.llm.engine.scheduler.requests == {}, "an aborted request is still tracked at idle"
        for rid, request in self.requests.items():
            request.check()
            assert request.finish is not None, rid
        for rid, count in self.aborted_at.items():
            assert len(self.requests[rid].emitted) == count, f"{rid} got tokens after its abort"

    def check(self) -> None:
        check_slots(self.llm)
        check_machine(self.llm)
        check_scheduler_bounded(self.llm)
        for request in self.requests.values():
            request.check()


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 37 + i * 11) % 1000 + 3 for i in range(n)]


def test_abort_before_first_step(llm, reference):
    client = Client(llm, reference)
    client.add("early-a", prompt(5, 1))
    client.add("early-b", prompt(6, 2))
    client.abort("early-a")
    client.run_until_idle()
    assert client.requests["early-a"].emitted == []
    assert client.requests["early-b"].finish == "length"


def test_abort_of_a_request_whose_token_the_next_step_would_relay(llm, reference):
    """b's newest token is only in the pending future when it is aborted. The next step relays a's
    and c's tokens out of that future (c moved into b's row by condense()) and never reads b's."""
    assert llm.config.async_relay
    client = Client(llm, reference)
    for i, rid in enumerate(("relay-a", "relay-b", "relay-c")):
        client.add(rid, prompt(4 + i, 20 + i))
    for _ in range(3):  # the prefill, then decodes: the pending step samples b's next token
        client.step()
    runner = llm.engine.runner
    assert runner.pending is not None and "relay-b" in runner.pending.snapshot.req_ids
    relays = runner.machine.state_counts[sm.RELAY]
    client.abort("relay-b")
    client.step()
    client.step()
    assert runner.machine.state_counts[sm.RELAY] > relays, runner.machine.counters()
    client.run_until_idle()
    assert client.requests["relay-b"].finish == "abort"
    assert client.requests["relay-a"].finish == client.requests["relay-c"].finish == "length"


def test_abort_while_waiting_for_a_slot(llm, reference):
    client = Client(llm, reference)
    for i in range(llm.config.max_num_seqs):
        client.add(f"full-{i}", prompt(4, i))
    client.add("queued", prompt(4, 9))
    client.step()
    client.step()
    assert [r.request_id for r in llm.engine.scheduler.waiting] == ["queued"]
    client.abort("queued")
    client.run_until_idle()
    assert client.requests["queued"].emitted == []
    assert all(client.requests[f"full-{i}"].finish == "length" for i in range(llm.config.max_num_seqs))


@pytest.mark.parametrize("turns", range(1, 7))
def test_abort_while_its_step_is_in_flight(llm, reference, turns):
    """After `turns` loop turns the newest step (and the one before it) holding the request are enqueued."""
    client = Client(llm, reference)
    client.add(f"t{turns}-a", prompt(5, turns))
    client.add(f"t{turns}-b", prompt(7, turns + 1))
    client.add(f"t{turns}-c", prompt(3, turns + 2))
    for _ in range(turns):
        client.step()
    queue = llm.engine.batch_queue
    in_flight = [s for s in queue if f"t{turns}-b" in s.scheduled.num_scheduled_tokens and not s.output.done()]
    assert in_flight, "the middle request has no step in flight: the test lost its point"
    client.abort(f"t{turns}-b")
    client.run_until_idle()
    assert client.requests[f"t{turns}-a"].finish == client.requests[f"t{turns}-c"].finish == "length"


def test_abort_while_its_output_is_being_materialized(llm, reference):
    """The output thread is inside the write-back of a step holding the request when the client aborts it."""
    entered, release = threading.Event(), threading.Event()
    target: list[int] = []  # the step id to hold

    class GatedWriteBack(StepObserver):
        def write_back(self, snapshot: StepSnapshot, tokens: list[int]) -> None:
            if target and snapshot.step_id == target[0] and threading.current_thread().name == "async-output":
                entered.set()
                assert release.wait(timeout=30), "the test never released the gated write-back"

    llm.engine.tracer.observe(GatedWriteBack())
    try:
        client = Client(llm, reference)
        client.add("mat-a", prompt(4, 5))
        client.add("mat-b", prompt(4, 6))
        client.step()
        client.step()
        target.append(llm.engine.scheduler._next_step_id)  # the step the next turn enqueues: hold it halfway
        client.step()
        [step] = llm.engine.batch_queue
        assert step.scheduled.step_id == target[0] and "mat-b" in step.scheduled.num_scheduled_tokens
        assert entered.wait(timeout=30), "the output thread never materialized the step"
        assert not step.output.done()
        client.abort("mat-b")
        release.set()
        client.run_until_idle()
    finally:
        release.set()
        llm.engine.tracer.observe(StepObserver())
    # Tokens of steps 0 and 1 reached the client; the one of the step held halfway never does.
    assert len(client.requests["mat-b"].emitted) == client.aborted_at["mat-b"] == 2
    assert client.requests["mat-a"].finish == "length"


def test_abort_every_request_at_once_mid_run(llm, reference):
    client = Client(llm, reference)
    ids = [f"all-{i}" for i in range(6)]  # more than the slots: some wait
    for i, rid in enumerate(ids):
        client.add(rid, prompt(3 + i, i))
    for _ in range(4):
        client.step()
    for rid in ids:
        client.abort(rid)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    client.run_until_idle()  # the steps still in flight drain; their tokens are dropped
    assert sorted(llm.engine.scheduler._free_slots) == list(range(llm.config.max_num_seqs))
