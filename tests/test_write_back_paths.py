"""The write-back (row by row through memoryviews of the batch's arrays, at every batch size) writes
what a trivially correct reference writes: same token arrays, same lengths, the same rows skipped (a
request gone, a partial prefill). It replaced a row form for a few rows and a numpy scatter for more."""

import random

import numpy as np
import pytest

from neuron_async_sm.sampling_params import SamplingParams
from neuron_async_sm.worker.input_batch import CachedRequestState, InputBatch


def _batch(num_requests: int, slots: int = 32) -> InputBatch:
    batch = InputBatch(slots, 40)
    states = [CachedRequestState(f"r{i}", [1, 2, 3], SamplingParams(), i, i) for i in range(num_requests)]
    batch.update(batch.rows_after(frozenset(), states))
    return batch


def _reference_write(batch: InputBatch, req_ids, positions, tokens) -> None:
    """numpy indexing, one row at a time, by the request's KV slot."""
    for req_id, at, token in zip(req_ids, positions, tokens, strict=True):
        state = batch.requests.get(req_id)
        if state is None or at is None:
            continue
        batch.token_ids[state.kv_slot, at] = token
        batch.num_tokens[state.kv_slot] = max(int(batch.num_tokens[state.kv_slot]), at + 1)


@pytest.mark.parametrize("seed", range(20))
def test_the_write_back_writes_what_the_reference_writes(seed):
    rng = random.Random(seed)
    slots = rng.choice([32, 80])  # past the old scatter threshold (32 rows) too
    rows = rng.randint(1, slots - 4)
    live = rng.randint(1, slots - 4)
    req_ids = tuple(f"r{rng.randrange(live + 4)}" for _ in range(rows))  # some are gone (never added)
    req_ids = tuple(dict.fromkeys(req_ids))  # one row per request, as in a step
    positions = tuple(None if rng.random() < 0.2 else rng.randrange(3, 40) for _ in req_ids)
    tokens = [rng.randrange(1000) for _ in req_ids]
    one, other = _batch(live, slots), _batch(live, slots)
    one.write_tokens(req_ids, positions, tokens)
    _reference_write(other, req_ids, positions, tokens)
    assert np.array_equal(one.token_ids, other.token_ids)
    assert np.array_equal(one.num_tokens, other.num_tokens)
    for req_id, at, token in zip(req_ids, positions, tokens, strict=True):  # and what they wrote is right
        if at is not None and req_id in one.requests:
            slot = one.requests[req_id].kv_slot
            assert one.token_ids[slot, at] == token and one.num_tokens[slot] > at
    one.write_tokens(req_ids, positions, tokens)  # idempotent: a second write changes nothing
    assert np.array_equal(one.token_ids, other.token_ids)
    assert np.array_equal(one.num_tokens, other.num_tokens)
