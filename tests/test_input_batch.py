"""The persistent input batch: arrays by KV slot, vectorized inputs equal to a per-request reference."""

import random

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model.inputs import INPUTS
from neuron_async_sm.outputs import SchedulerOutput, StepSnapshot
from neuron_async_sm.runtime import WireTensor
from neuron_async_sm.sampling_params import SamplingParams
from neuron_async_sm.worker.input_batch import (
    POISON_TOKEN,
    CachedRequestState,
    InputBatch,
    WrittenTokens,
    next_row_order,
    padded_input_shape,
)
from neuron_async_sm.worker.model_input import _follows, build_model_input

CONFIG = EngineConfig(
    max_num_seqs=6, max_model_len=48, max_num_batched_tokens=64, decode_buckets=(2, 4, 8), prefill_buckets=(8, 16, 64)
)


def reference_inputs(config: EngineConfig, scheduled: SchedulerOutput, batch: InputBatch) -> dict[str, list]:
    """The trivially correct builder: a Python loop over rows reading each request's token list."""
    shape = padded_input_shape(config, scheduled)
    width = 1 if scheduled.all_decode else shape[1]
    rows = [batch.requests[r] for r in batch.req_ids if r in scheduled.num_scheduled_tokens]
    out: dict[str, list] = {
        "ids": [[0] * width for _ in range(shape[0])],
        "pos": [[0] * width for _ in range(shape[0])],
        "query_lens": [0] * shape[0],
        "slot_ids": [config.max_num_seqs] * shape[0],
        "temperature": [0.0] * shape[0],
        "top_k": [0] * shape[0],
        "top_p": [1.0] * shape[0],
        "seeds": [0] * shape[0],
        "output_index": [0] * shape[0],
        "sample_positions": [],
    }
    for i, state in enumerate(rows):
        start = scheduled.num_computed_tokens[state.request_id]
        n = scheduled.num_scheduled_tokens[state.request_id]
        known = state.token_ids[start : start + n]
        out["ids"][i][:n] = known + [POISON_TOKEN] * (n - len(known))
        out["pos"][i][:n] = range(start, start + n)
        out["query_lens"][i], out["slot_ids"][i] = n, state.kv_slot
        p = state.sampling_params
        out["temperature"][i], out["top_k"][i], out["top_p"][i] = p.temperature, p.top_k, p.top_p
        out["seeds"][i] = state.seed
        out["output_index"][i] = max(start + n - state.num_prompt_tokens, 0)
        out["sample_positions"].append(start + n if start + n >= state.num_prompt_tokens else None)
    if scheduled.all_decode:
        out["ids"], out["pos"] = [r[0] for r in out["ids"]], [r[0] for r in out["pos"]]
    return out


def build(scheduled: SchedulerOutput, batch: InputBatch, config: EngineConfig = CONFIG):
    return build_model_input(config, scheduled, batch, batch.plan(scheduled, config))


def admit(batch: InputBatch, removed: frozenset[str], added: list[CachedRequestState]) -> None:
    """Requests leave and join the batch between steps (a step's rows, as `plan()` works them out)."""
    batch.update(batch.rows_after(removed, added))


def state(req_id: str, prompt: list[int], slot: int, **params) -> CachedRequestState:
    return CachedRequestState(req_id, prompt, SamplingParams(**params), seed=1000 + slot, kv_slot=slot)


def step(step_id, scheduled: dict[str, int], computed: dict[str, int], batch: InputBatch) -> SchedulerOutput:
    all_decode = all(n == 1 and computed[r] >= batch.requests[r].num_prompt_tokens for r, n in scheduled.items())
    return SchedulerOutput(step_id, scheduled, computed, [], frozenset(), frozenset(), all_decode)


def test_vectorized_inputs_equal_the_per_request_reference_through_adds_removes_and_write_backs():
    rng = random.Random(7)
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    computed: dict[str, int] = {}
    free = list(range(CONFIG.max_num_seqs))
    names = iter(f"r{i}" for i in range(10_000))
    for step_id in range(300):
        removed = frozenset(r for r in batch.req_ids if rng.random() < 0.15)
        free += [batch.requests[r].kv_slot for r in removed]
        added = []
        for _ in range(rng.randint(0, len(free))):
            req_id, slot = next(names), free.pop(rng.randrange(len(free)))
            params = {
                "temperature": rng.choice([0.0, 0.7]),
                "top_k": rng.choice([0, 5]),
                "top_p": rng.choice([1.0, 0.9]),
            }
            added.append(state(req_id, [rng.randrange(3, 90) for _ in range(rng.randint(1, 20))], slot, **params))
            computed[req_id] = 0
        rows = batch.rows_after(removed, added)
        assert rows.order == tuple(next_row_order(batch.req_ids, removed, [s.request_id for s in added]))
        batch.update(rows)
        assert batch.req_ids is rows.order
        decode = rng.random() < 0.5
        scheduled = {}
        for r in batch.req_ids:
            left = batch.requests[r].num_prompt_tokens - computed[r]
            if computed[r] + 1 >= CONFIG.max_model_len or rng.random() < 0.2:
                continue  # not scheduled this step (a pipelining gap, the budget)
            if left > 0 and not decode:
                scheduled[r] = rng.randint(1, left)
            elif left <= 0:
                scheduled[r] = 1
        if not scheduled:
            continue
        so = step(step_id, scheduled, {r: computed[r] for r in scheduled}, batch)
        got, want = build(so, batch), reference_inputs(CONFIG, so, batch)
        assert got.req_ids == tuple(r for r in batch.req_ids if r in scheduled)
        assert got.tensor("input_ids").tolist() == want["ids"] and got.tensor("positions").tolist() == want["pos"]
        assert got.sample_positions == tuple(want["sample_positions"])
        for name in ("query_lens", "slot_ids", "top_k", "seeds", "output_index"):
            assert got.tensor(name).tolist() == want[name], name
        for name in ("temperature", "top_p"):
            assert torch.allclose(got.tensor(name), torch.tensor(want[name], dtype=torch.float32)), name
        # What the runtime is sent: every declared input once, in its declared dtype and shape; a
        # decode step's all encoded already, a prefill's those its rows fix.
        assert got.inputs.keys() == INPUTS.keys()
        shape = padded_input_shape(CONFIG, so)
        for name, value in got.inputs.items():
            assert value.dtype == INPUTS[name].dtype, name
            assert tuple(value.shape) == (shape if INPUTS[name].per_token else shape[:1]), name
        encoded = {name for name, value in got.inputs.items() if isinstance(value, WireTensor)}
        assert encoded == (set(INPUTS) if so.all_decode else {"slot_ids", "temperature", "top_k", "top_p", "seeds"})
        for r, n in scheduled.items():
            computed[r] += n
        if rng.random() < 0.8:  # the step's write-back (sometimes late: the test never writes it)
            tokens = [rng.randrange(3, 90) for _ in got.req_ids]
            batch.write_tokens(got.req_ids, got.sample_positions, tokens)
            for r, p, t in zip(got.req_ids, got.sample_positions, tokens, strict=True):
                if p is not None:
                    assert batch.requests[r].token_ids[p] == t


def test_a_recycled_slot_holds_nothing_of_its_previous_owner():
    """Hazard: stale input ids. B takes A's KV slot; B's first decode input is B's own token, never
    one A wrote at the same position."""
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    admit(batch, frozenset(), [state("a", [5, 6, 7], slot=0)])
    first = build(step(0, {"a": 3}, {"a": 0}, batch), batch)
    batch.write_tokens(first.req_ids, first.sample_positions, [41])
    second = build(step(1, {"a": 1}, {"a": 3}, batch), batch)
    batch.write_tokens(second.req_ids, second.sample_positions, [42])
    assert batch.requests["a"].token_ids == [5, 6, 7, 41, 42]
    admit(batch, frozenset({"a"}), [state("b", [9, 9, 9], slot=0)])
    assert batch.requests["b"].token_ids == [9, 9, 9]
    so = step(1, {"b": 1}, {"b": 3}, batch)  # B decodes position 3 before its token there is known
    assert build(so, batch).tensor("input_ids").tolist()[0] == POISON_TOKEN


def test_a_late_write_back_for_a_removed_request_never_reaches_its_slots_new_owner():
    """Hazard: token ownership. A's step is materialized after A left and B took its slot."""
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    admit(batch, frozenset(), [state("a", [5, 6, 7], slot=2), state("c", [8], slot=1)])
    late = build(step(0, {"a": 3, "c": 1}, {"a": 0, "c": 0}, batch), batch)  # prefill, sampled, in flight
    admit(batch, frozenset({"a"}), [state("b", [9, 9, 9], slot=2)])
    batch.write_tokens(late.req_ids, late.sample_positions, [41, 43])  # A's late output: only C's row is written
    assert batch.requests["b"].token_ids == [9, 9, 9]
    assert batch.requests["c"].token_ids == [8, 43]


def test_a_step_that_changes_nothing_keeps_the_row_order_and_its_slot_map():
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    admit(batch, frozenset(), [state("a", [5], slot=3), state("b", [6], slot=1), state("c", [7], slot=0)])
    ids, slots = batch.req_ids, batch.row_slots
    admit(batch, frozenset(), [])
    assert batch.req_ids is ids and batch.row_slots is slots
    admit(batch, frozenset({"a"}), [])  # condense: the last row moves into the hole
    assert batch.req_ids == ("c", "b") and batch.row_slots.tolist() == [0, 1]


def test_a_large_write_back_lands_in_the_arrays_the_inputs_read():
    """The write-back goes through memoryviews of the batch's arrays: the tokens and counts it writes
    are what the next inputs gather, at a batch past the old scatter threshold (32 rows), with rows
    that are gone or sample nothing skipped."""
    slots = 40
    batch = InputBatch(slots, 16)
    admit(batch, frozenset(), [state(f"r{i}", [i % 7 + 1, 2], slot=i) for i in range(slots)])
    ids = tuple(f"r{i}" for i in range(slots)) + ("gone",)
    positions = tuple(None if i == 5 else 2 for i in range(slots)) + (2,)
    batch.write_tokens(ids, positions, [100 + i for i in range(slots)] + [999])
    for i in range(slots):
        assert batch.requests[f"r{i}"].token_ids == [i % 7 + 1, 2] + ([] if i == 5 else [100 + i])
    assert batch.token_ids[:, 2].tolist() == [POISON_TOKEN if i == 5 else 100 + i for i in range(slots)]
    assert batch.num_tokens.tolist() == [2 if i == 5 else 3 for i in range(slots)]
    scheduled = {f"r{i}": 1 for i in range(slots) if i != 5}
    so = SchedulerOutput(0, scheduled, dict.fromkeys(scheduled, 2), [], frozenset(), frozenset(), True)
    got = build(so, batch, EngineConfig(max_num_seqs=slots, max_model_len=16, decode_buckets=(64,)))
    assert got.tensor("input_ids").tolist()[: slots - 1] == [100 + i for i in range(slots) if i != 5]


def test_decode_ids_from_the_previous_steps_written_tokens_equal_the_gather():
    """A decode step right after a step on the same rows takes its ids from that step's written tokens
    (`written`); through random adds, removes, skipped rows and late or missing write-backs they must
    be the ids the gather reads (the step's inputs with and without `written` are equal), and the
    shortcut must be taken on the steady stretches."""
    rng = random.Random(11)
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    computed: dict[str, int] = {}
    free = list(range(CONFIG.max_num_seqs))
    names = iter(f"r{i}" for i in range(10_000))
    taken = 0
    for step_id in range(600):
        steady = rng.random() < 0.8  # most steps change nothing: the shortcut's case
        removed = frozenset() if steady else frozenset(r for r in batch.req_ids if rng.random() < 0.3)
        free += [batch.requests[r].kv_slot for r in removed]
        added = []
        for _ in range(0 if steady else rng.randint(0, len(free))):
            req_id, slot = next(names), free.pop(rng.randrange(len(free)))
            added.append(state(req_id, [rng.randrange(3, 90) for _ in range(rng.randint(1, 6))], slot))
            computed[req_id] = 0
        admit(batch, removed, added)
        scheduled = {}
        for r in batch.req_ids:
            if computed[r] + 1 >= CONFIG.max_model_len or (not steady and rng.random() < 0.2):
                continue
            left = batch.requests[r].num_prompt_tokens - computed[r]
            scheduled[r] = 1 if left <= 0 else rng.randint(1, left)
        if not scheduled:
            continue
        so = step(step_id, scheduled, {r: computed[r] for r in scheduled}, batch)
        rows = batch.plan(so, CONFIG)
        last, batch.last_written = batch.last_written, None
        plain = build_model_input(CONFIG, so, batch, rows)  # the gather alone
        batch.last_written = last
        got = build_model_input(CONFIG, so, batch, rows)
        assert got.tensor("input_ids").tolist() == plain.tensor("input_ids").tolist(), step_id
        assert got.sample_positions == plain.sample_positions
        start = tuple(plain.tensor("positions").tolist())
        if so.all_decode and last is not None and _follows(last, step_id, rows.req_ids, start):
            taken += 1
        for r, n in scheduled.items():
            computed[r] += n
        if rng.random() < 0.9:  # written back (else: never, as a late one would be)
            tokens = [rng.randrange(3, 90) for _ in got.req_ids]
            batch.write_back(StepSnapshot(step_id, got.req_ids, got.sample_positions), tokens)
    assert taken > 50, taken


def test_written_tokens_of_an_older_step_or_other_rows_are_never_the_ids():
    """Hazard: stale input ids. A recycled id decodes the position its previous owner sampled, its
    own token there not written yet: the ids are POISON_TOKEN (the gather), not the old owner's token,
    though the old step's rows and positions look the same; likewise for other rows or positions."""
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    admit(batch, frozenset(), [state("a", [5, 6, 7], slot=0)])
    first = build(step(4, {"a": 3}, {"a": 0}, batch), batch)
    batch.write_tokens(first.req_ids, first.sample_positions, [41])
    old = WrittenTokens(StepSnapshot(4, first.req_ids, first.sample_positions), [41])
    admit(batch, frozenset({"a"}), [state("a", [9, 9, 9], slot=0)])  # "a" again: a new request
    build(step(5, {"a": 3}, {"a": 0}, batch), batch)  # its prefill, in flight: never written
    so = step(6, {"a": 1}, {"a": 3}, batch)
    for written in [
        old,
        WrittenTokens(StepSnapshot(5, ("b",), (3,)), [41]),
        WrittenTokens(StepSnapshot(5, ("a",), (2,)), [41]),
    ]:
        batch.last_written = written
        assert build(so, batch).tensor("input_ids").tolist()[0] == POISON_TOKEN
    batch.last_written = WrittenTokens(StepSnapshot(5, ("a",), (3,)), [77])  # the step just before, as written
    assert build(so, batch).tensor("input_ids").tolist()[0] == 77


def test_ids_fed_from_a_future_are_not_built_and_poison_every_real_row():
    """cpu_ids=False (the plan feeds every input id from a future): the real rows' ids are POISON_TOKEN,
    which the device rejects if they ever reached it; every other input is the ordinary one."""
    batch = InputBatch(CONFIG.max_num_seqs, CONFIG.max_model_len)
    admit(batch, frozenset(), [state("a", [5, 6, 7], slot=0), state("b", [8], slot=3), state("c", [4, 4], slot=1)])
    so = step(0, {"a": 1, "b": 1, "c": 1}, {"a": 3, "b": 1, "c": 2}, batch)
    rows = batch.plan(so, CONFIG)
    plain = build_model_input(CONFIG, so, batch, rows)
    fed = build_model_input(CONFIG, so, batch, rows, cpu_ids=False)
    assert fed.tensor("input_ids").tolist() == [POISON_TOKEN] * 3 + [0]  # bucket 4: one padding row
    for name in plain.inputs:
        if name != "input_ids":
            assert torch.equal(plain.tensor(name), fed.tensor(name)), name
    assert fed.sample_positions == plain.sample_positions
