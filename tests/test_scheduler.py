"""Scheduler policy: budget, chunked prefill, stop conditions, abort, async placeholders."""

import pytest

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.outputs import ModelRunnerOutput, RequestDelta
from neuron_async_sm.request import Request
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams
from neuron_async_sm.scheduler import Scheduler

EOS = 2


def make(async_scheduling=False, **kw):
    cfg = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, prefill_buckets=(16,))
    cfg.update(kw)
    return Scheduler(EngineConfig(async_scheduling=async_scheduling, **cfg), eos_token_ids=(EOS,), vocab_size=100)


def add(s, rid, n_prompt=4, **params):
    s.add_request(Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(**params), seed=0, arrival_order=0))


def run(s, so, token=50, per_req=None):
    ids = list(so.num_scheduled_tokens)
    toks = [(per_req or {}).get(r, token) for r in ids]
    return s.update_from_output(so, ModelRunnerOutput(so.step_id, ids, toks))


def test_decodes_and_prefill_share_the_token_budget():
    s = make(max_num_batched_tokens=16)
    add(s, "a", 10, max_tokens=5)
    add(s, "b", 10, max_tokens=5)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prefill is chunked by the budget
    assert so.sampling_req_ids == {"a"}
    run(s, so)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert so.num_computed_tokens == {"a": 10, "b": 6}
    assert so.sampling_req_ids == {"a", "b"}


def test_chunked_prefill_emits_no_token_until_the_prompt_is_done():
    s = make(max_num_batched_tokens=16, prefill_buckets=(16,))
    add(s, "a", 40, max_tokens=3)
    deltas = []
    for _ in range(3):
        so = s.schedule()
        deltas += run(s, so)
    assert [d.new_token_ids for d in deltas] == [[50]]  # only the third chunk (8 tokens) samples


def test_max_num_seqs_limits_running_requests():
    s = make(max_num_seqs=2)
    for r in "abc":
        add(s, r, 2, max_tokens=2)
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert [n.kv_slot for n in so.scheduled_new_reqs] == [0, 1]


@pytest.mark.parametrize(
    "params,tokens,reason,emitted",
    [
        ({"max_tokens": 3}, [50, 51, 52, 53], "length", 3),
        ({"max_tokens": 9}, [50, EOS, 52], "stop", 2),
        ({"max_tokens": 9, "ignore_eos": True}, [50, EOS, 52], None, 3),
        ({"max_tokens": 9, "stop_token_ids": (51,)}, [50, 51, 52], "stop", 2),
    ],
)
def test_stop_conditions(params, tokens, reason, emitted):
    s = make()
    add(s, "a", 4, **params)
    out = []
    for t in tokens:
        if not s.has_unfinished_requests():
            break
        out += run(s, s.schedule(), token=t)
    assert sum(len(d.new_token_ids) for d in out) == emitted
    assert out[-1].finish_reason == reason


def test_max_model_len_stops_with_length():
    s = make(max_model_len=8)
    add(s, "a", 6, max_tokens=50)
    out = []
    while s.has_unfinished_requests():
        out += run(s, s.schedule())
    assert sum(len(d.new_token_ids) for d in out) == 2 and out[-1].finish_reason == "length"


def test_abort_waiting_and_running_frees_the_slot_once():
    s = make(max_num_seqs=1)
    add(s, "a")
    add(s, "b")
    so = s.schedule()
    assert s.abort_request("b").finish_reason == "abort"  # waiting
    assert s.abort_request("a").finish_reason == "abort"  # running, step in flight
    assert s.abort_request("a") is None  # idempotent
    assert run(s, so) == []  # the in-flight token of an aborted request is discarded
    assert s._free_slots == [0]
    add(s, "c")
    assert s.schedule().finished_req_ids == {"a"}


def test_async_placeholders_close_the_max_tokens_gap():
    s = make(async_scheduling=True)
    add(s, "a", 4, max_tokens=2)
    add(s, "b", 4, max_tokens=5)
    s1 = s.schedule()  # prefill both: each has one token in flight
    s2 = s.schedule()  # one step ahead: a's second token is its last
    assert s2.num_scheduled_tokens == {"a": 1, "b": 1}
    run(s, s1)
    s3 = s.schedule()
    assert "a" not in s3.num_scheduled_tokens  # a reaches max_tokens with s2's token
    deltas = run(s, s2)
    assert [d.finish_reason for d in deltas if d.request_id == "a"] == ["length"]


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "no-relay"])
def test_async_relay_gives_the_slot_back_while_the_last_token_is_in_flight(relay):
    """Relay on: a request left out by the max_tokens gap frees its slot in that step, and a waiting
    request takes it at once (as in sync mode); its last token is still delivered. Relay off: the
    design, the slot waits for that token."""
    s = make(async_scheduling=True, async_relay=relay, max_num_seqs=1)
    add(s, "a", 4, max_tokens=2)
    add(s, "b", 4, max_tokens=2)
    s1 = s.schedule()  # a's prefill
    s2 = s.schedule()  # a's second (last) token
    run(s, s1)
    s3 = s.schedule()  # a is left out: its last token is in s2
    assert "a" not in s3.num_scheduled_tokens
    if relay:
        assert [n.request_id for n in s3.scheduled_new_reqs] == ["b"] and s3.scheduled_new_reqs[0].kv_slot == 0
        assert s3.finished_req_ids == {"a"}  # the worker drops a's row now
        assert s.has_unfinished_requests() and s._free_slots == []
    else:
        assert s3.is_empty
    deltas = run(s, s2)
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "length")]  # delivered all the same
    if not relay:
        assert [n.request_id for n in s.schedule().scheduled_new_reqs] == ["b"]  # one step later
    assert [r.request_id for r in s.running] == ["b"]
    assert sorted(s._free_slots + [r.kv_slot for r in s.running]) == [0] and not s.releasing


def test_async_relay_abort_of_a_request_whose_slot_was_released():
    """Aborted while its last token is in flight and its slot already taken: the slot is not freed a
    second time, the in-flight token is discarded, and the request is forgotten once it lands."""
    s = make(async_scheduling=True, max_num_seqs=1)
    add(s, "a", 4, max_tokens=2)
    add(s, "b", 4, max_tokens=2)
    s1, s2 = s.schedule(), s.schedule()
    run(s, s1)
    s3 = s.schedule()  # a released, b takes slot 0
    assert s.abort_request("a").finish_reason == "abort"
    assert not s.releasing and s._free_slots == [] and [r.kv_slot for r in s.running] == [0]
    assert [d.request_id for d in run(s, s2)] == []  # a's last token: discarded
    assert "a" not in s.requests
    run(s, s3)
    assert s._free_slots == [] and [r.request_id for r in s.running] == ["b"]


def test_async_stop_discards_the_in_flight_token():
    s = make(async_scheduling=True)
    add(s, "a", 4, max_tokens=10)
    s1 = s.schedule()
    s2 = s.schedule()
    assert run(s, s1, token=EOS)[0].finish_reason == "stop"
    assert run(s, s2, token=77) == []  # sampled after the stop: never emitted
    assert "a" not in s.requests


@pytest.mark.parametrize(
    "prompt,message",
    [([], "empty"), ([5, 100], "outside the vocabulary"), (list(range(64)), "max_model_len")],
)
def test_bad_prompts_are_rejected_with_the_field_named(prompt, message):
    s = make()
    with pytest.raises(InvalidRequestError, match="prompt_token_ids") as info:
        s.add_request(Request("x", prompt, SamplingParams(), 0, 0))
    assert message in str(info.value)
    assert not s.has_unfinished_requests()


def test_duplicate_request_id_is_rejected():
    s = make()
    add(s, "a")
    with pytest.raises(InvalidRequestError, match="request_id"):
        add(s, "a")


def test_all_decode_only_when_every_row_decodes_one_token():
    s = make(max_num_batched_tokens=16)
    add(s, "a", 4, max_tokens=5)
    so = s.schedule()
    assert not so.all_decode  # prefill
    run(s, so)
    so = s.schedule()
    assert so.all_decode
    run(s, so)
    add(s, "b", 1, max_tokens=5)  # a one-token prompt is still a prefill
    assert not s.schedule().all_decode


def test_update_from_output_gives_ordinary_request_deltas():
    s = make()
    add(s, "a", max_tokens=2)
    add(s, "b", max_tokens=5)
    first = run(s, s.schedule(), per_req={"a": 7, "b": 8})
    assert first == [RequestDelta("a", [7]), RequestDelta("b", [8])]
    last = run(s, s.schedule(), per_req={"a": 9, "b": EOS})
    assert last == [RequestDelta("a", [9], "length"), RequestDelta("b", [EOS], "stop")]


@pytest.mark.parametrize(
    "params,tokens,emitted",
    [
        ({"ignore_eos": True, "stop_token_ids": (EOS,)}, [50, EOS, 52], 2),  # a stop token, even if it is EOS
        ({"ignore_eos": True, "stop_token_ids": (51,)}, [50, EOS, 51, 52], 3),
        ({"stop_token_ids": (51, 52)}, [50, 52, 51], 2),
    ],
)
def test_stop_tokens_are_the_stop_ids_and_eos_unless_ignored(params, tokens, emitted):
    """The scheduler checks one set per request (stop_token_set, built on admission)."""
    s = make()
    add(s, "a", 4, max_tokens=9, **params)
    out = []
    for t in tokens:
        if not s.has_unfinished_requests():
            break
        out += run(s, s.schedule(), token=t)
    assert [t for d in out for t in d.new_token_ids] == tokens[:emitted]
    assert out[-1].finish_reason == "stop"


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_tokens,emitted", [(3, 3), (100, 4), (4, 4)])
def test_length_is_the_lower_of_max_tokens_and_max_model_len(async_scheduling, max_tokens, emitted):
    """max_outputs = min(max_tokens, max_model_len - prompt): the update's stop and the schedule's
    pipelining gap (max_computed_tokens) both follow it (async: never a step scheduled past it, and
    none missing before it)."""
    s = make(async_scheduling=async_scheduling, max_model_len=10)
    add(s, "a", 6, max_tokens=max_tokens)
    in_flight, out, steps = [], [], 0
    for _ in range(20):  # bounded: a request never scheduled for its last token would hang here
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        if not so.is_empty:
            steps += 1
            in_flight.append(so)
        if in_flight and (not async_scheduling or len(in_flight) == 2 or so.is_empty):
            out += run(s, in_flight.pop(0))
    assert sum(len(d.new_token_ids) for d in out) == emitted and out[-1].finish_reason == "length"
    assert steps == emitted  # the prefill samples the first token; no step past the limit


def test_a_finished_request_is_tracked_until_its_last_step_in_flight_is_applied():
    """Its id stays taken while a step that runs it is in flight (token ownership: the recycled id
    must not receive that step's token), and is free once that step is applied."""
    s = make(async_scheduling=True)
    add(s, "a", 4, max_tokens=9)
    first = s.schedule()  # the prefill
    second = s.schedule()  # the first decode, in flight while the prefill's token is applied
    assert s.num_steps_in_flight("a") == 2
    assert run(s, first, token=EOS)[-1].finish_reason == "stop"
    with pytest.raises(InvalidRequestError, match="duplicate"):
        add(s, "a", 2, max_tokens=3)
    assert run(s, second, token=77) == []  # the stale token is discarded
    assert s.num_steps_in_flight("a") == 0 and "a" not in s.requests
    add(s, "a", 2, max_tokens=3)  # the id is free again
    assert [d.new_token_ids for d in run(s, s.schedule(), token=5)] == [[5]]


def test_num_output_tokens_counts_the_tokens_of_the_deltas():
    """The engine's output_tokens stat: every token a delta carried, none of the discarded ones."""
    s = make(async_scheduling=True)
    add(s, "a", 4, max_tokens=3)
    add(s, "b", 4, max_tokens=9)
    add(s, "c", 4, max_tokens=9)
    delivered, in_flight = 0, []
    for turn in range(6):
        so = s.schedule()
        if not so.is_empty:
            in_flight.append(so)
        if turn == 2:
            delivered += len(s.abort_request("c").new_token_ids)
        if in_flight and (len(in_flight) == 2 or so.is_empty):
            deltas = run(s, in_flight.pop(0), per_req={"b": EOS} if turn == 3 else {})
            delivered += sum(len(d.new_token_ids) for d in deltas)
    assert s.num_output_tokens == delivered == 3 + 2 + 2, (s.num_output_tokens, delivered)  # then b stops
