"""The checker's verdict rests on TLC's invariant result, not on how many events it matched.

A hand-made trace (two requests, five steps, relay off; written after a real run of the engine)
is a behaviour of the spec. Cut after step 3's `reinstate` and with that last event corrupted,
every event still matches: only the invariant TLC checks on the state after it can reject the
trace. Each corruption is what a real bug would log there: the host holding another request's
token (a write-back in the step before that went to the wrong request), a token the host does not
have yet (`POISON_TOKEN`), a break counted as an async step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trace_check import POISON_TOKEN, check_trace, main

MAIN, OUTPUT = "MainThread", "async-output"
CONFIG = {
    "event": "config",
    "thread": MAIN,
    "max_num_seqs": 2,
    "max_model_len": 32,
    "decode_buckets": [1, 2],
    "async_scheduling": True,
    "async_relay": False,
    "engine_thread": MAIN,
    "output_thread": OUTPUT,
}
A_TOKENS, B_TOKENS = [273, 972, 201], [822, 679, 44, 272]  # a: prompt of 3, max_tokens 3; b: 2 and 4


def _machine(event: str, step: int, source: str, state: str, req_ids: list[str], **fields: object) -> dict:
    return {"event": event, "thread": MAIN, "step": step, "source": source, "state": state, "req_ids": req_ids} | fields


def step(n: int, source: str, state: str, req_ids: list[str], new: dict[str, tuple[int, int]] | None = None) -> dict:
    """A `step` event; `new`: request -> (max_tokens, prompt length) of those it admits."""
    new = new or {}
    return _machine(
        "step",
        n,
        source,
        state,
        req_ids,
        new=list(new),
        max_tokens=[m for m, _ in new.values()],
        prompt_lens=[p for _, p in new.values()],
    )


def reinstate(n: int, source: str, req_ids: list[str], inputs: list[list], counters: list[int]) -> dict:
    return _machine("reinstate", n, source, "Reinstate", req_ids, relay_from=[], inputs=inputs, counters=counters)


def materialize(n: int, req_ids: list[str], positions: list[int], tokens: list[int]) -> dict:
    return {
        "event": "Materialize",
        "thread": OUTPUT,
        "step": n,
        "req_ids": req_ids,
        "positions": positions,
        "ok": True,
        "count": 1,
        "tokens": tokens,
    }


def advance(n: int, delivered: list[str], finished: list[list[str]] = ()) -> dict:
    return {"event": "AdvanceStep", "thread": MAIN, "step": n, "delivered": delivered, "finished": list(finished)}


def hand_made_trace() -> list[dict]:
    """a joins alone, b joins (a break), a Steady step, a leaves (a break: b's input is CPU-built),
    a Steady step; every output applied."""
    events = [
        CONFIG,
        step(0, "Idle", "NoPendingFuture", ["a"], {"a": (3, 3)}),
        reinstate(0, "NoPendingFuture", ["a"], [["prompt"]], [0, 1]),
        step(1, "Reinstate", "CompositionBreak", ["a", "b"], {"b": (4, 2)}),
        materialize(0, ["a"], [3], A_TOKENS[:1]),
        reinstate(1, "CompositionBreak", ["a", "b"], [["host", A_TOKENS[0], 3], ["prompt"]], [0, 2]),
        advance(0, ["a"]),
        step(2, "Reinstate", "Steady", ["a", "b"]),
        reinstate(2, "Steady", ["a", "b"], [["future", 0], ["future", 1]], [1, 2]),
        materialize(1, ["a", "b"], [4, 2], [A_TOKENS[1], B_TOKENS[0]]),
        advance(1, ["a", "b"]),
        step(3, "Reinstate", "CompositionBreak", ["b"]),
        materialize(2, ["a", "b"], [5, 3], [A_TOKENS[2], B_TOKENS[1]]),
        reinstate(3, "CompositionBreak", ["b"], [["host", B_TOKENS[1], 3]], [1, 3]),
        advance(2, ["a", "b"], [["a", "length"]]),
        step(4, "Reinstate", "Steady", ["b"]),
        reinstate(4, "Steady", ["b"], [["future", 0]], [2, 3]),
        materialize(3, ["b"], [4], B_TOKENS[2:3]),
        advance(3, ["b"]),
        materialize(4, ["b"], [5], B_TOKENS[3:]),
        advance(4, ["b"], [["b", "length"]]),
    ]
    return [dict(e, seq=i) for i, e in enumerate(events)]


LAST_REINSTATE = 13  # index of step 3's reinstate: b's CPU-built input, b's first output (679) at position 3


def ending_at_step_3() -> list[dict]:
    """The trace up to step 3's reinstate: a prefix of a behaviour, so a behaviour too."""
    events = hand_made_trace()[: LAST_REINSTATE + 1]
    assert events[-1]["event"] == "reinstate" and events[-1]["step"] == 3
    return events


def with_last_input(events: list[dict], token: int) -> list[dict]:
    last = dict(events[-1], inputs=[["host", token, 3]])
    return [*events[:-1], last]


CORRUPTIONS = {
    # a's token at that step: the write-back of step 2 put it into b's row
    "TokenOwnershipInv": lambda events: with_last_input(events, A_TOKENS[2]),
    "NoStaleInputInv": lambda events: with_last_input(events, POISON_TOKEN),
    # the break counted as an async step
    "EngineCountersInv": lambda events: [*events[:-1], dict(events[-1], counters=[2, 2])],
}


def test_the_hand_made_trace_and_its_prefix_are_behaviours_of_the_spec(tlc_available):
    for events in (hand_made_trace(), ending_at_step_3()):
        verdict = check_trace(events)
        assert verdict.accepted, verdict.describe()
        assert verdict.violated_invariant is None and verdict.matched == len(events) - 1  # the header is no event


@pytest.mark.parametrize("invariant", sorted(CORRUPTIONS))
def test_a_trace_broken_at_its_last_event_is_rejected_though_every_event_matched(tlc_available, invariant):
    events = CORRUPTIONS[invariant](ending_at_step_3())
    verdict = check_trace(events)
    print(verdict.describe())
    # Every event matched: a verdict counting matched events would accept this trace.
    assert verdict.matched == len(verdict.events) == len(events) - 1, verdict.describe()
    assert verdict.violated_invariant == invariant, verdict.describe()
    assert verdict.rejected_event == events[-1], verdict.describe()
    assert not verdict.accepted, verdict.describe()
    assert verdict.describe().startswith(f"rejected: {invariant} fails after event {len(events) - 2} ")


def test_the_command_exits_1_on_a_trace_broken_at_its_last_event_and_0_on_the_intact_one(
    tlc_available, tmp_path: Path, capsys
):
    for name, events, code in (
        ("intact", ending_at_step_3(), 0),
        ("broken", CORRUPTIONS["TokenOwnershipInv"](ending_at_step_3()), 1),
    ):
        path = tmp_path / f"{name}.ndjson"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        assert main([str(path)]) == code, capsys.readouterr().out
        out = capsys.readouterr().out
        assert out.startswith("accepted" if code == 0 else "rejected: TokenOwnershipInv"), out


def test_an_event_on_a_thread_the_header_does_not_name_is_an_error_not_a_guess():
    """Thread identity comes from the header. A materialization on any other thread is no behaviour the
    checker can judge (it would pass for the output thread's): refused before TLC runs."""
    events = hand_made_trace()
    i = next(i for i, e in enumerate(events) if e["event"] == "Materialize")
    events[i] = dict(events[i], thread="worker-3")
    with pytest.raises(ValueError, match="thread 'worker-3' is not the header's engine or output thread"):
        check_trace(events)


def test_an_abort_of_a_request_no_step_admitted_is_left_out(tlc_available):
    """A client may abort a request still waiting for a slot: no step names it, the spec never sees it
    arrive, and its abort (logged on the client's thread) is left out; the trace is still accepted."""
    events = hand_made_trace()
    i = next(i for i, e in enumerate(events) if e["event"] == "AdvanceStep")
    waiting = {"event": "Abort", "thread": "ThreadPoolExecutor-0_0", "req_id": "c", "seq": -1}
    events.insert(i, waiting)
    verdict = check_trace(events)
    assert verdict.accepted, verdict.describe()
    assert waiting not in verdict.events and len(verdict.events) == len(events) - 2
