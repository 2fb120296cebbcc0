"""The write-back's two forms (row by row for a few rows, one scatter for more) write the same tokens:
same token arrays, same lengths, the same rows skipped (a request gone, a partial prefill)."""

import random

import numpy as np
import pytest

from neuron_async_sm.sampling_params import SamplingParams
from neuron_async_sm.worker.input_batch import SCALAR_WRITE_MAX_ROWS, CachedRequestState, InputBatch


def _batch(num_requests: int) -> InputBatch:
    batch = InputBatch(32, 40)
    states = [CachedRequestState(f"r{i}", [1, 2, 3], SamplingParams(), i, i) for i in range(num_requests)]
    batch.update(frozenset(), states)
    return batch


@pytest.mark.parametrize("seed", range(20))
def test_row_by_row_and_scatter_write_the_same(seed):
    rng = random.Random(seed)
    rows = rng.randint(1, 24)
    live = rng.randint(1, 24)
    req_ids = tuple(f"r{rng.randrange(live + 4)}" for _ in range(rows))  # some are gone (never added)
    req_ids = tuple(dict.fromkeys(req_ids))  # one row per request, as in a step
    positions = tuple(None if rng.random() < 0.2 else rng.randrange(3, 40) for _ in req_ids)
    tokens = [rng.randrange(1000) for _ in req_ids]
    one, other = _batch(live), _batch(live)
    one._write_rows(req_ids, positions, tokens)
    other._scatter(req_ids, positions, tokens)
    assert np.array_equal(one.token_ids, other.token_ids)
    assert np.array_equal(one.num_tokens, other.num_tokens)
    for req_id, at, token in zip(req_ids, positions, tokens, strict=True):  # and what they wrote is right
        if at is not None and req_id in one.requests:
            slot = one.requests[req_id].kv_slot
            assert one.token_ids[slot, at] == token and one.num_tokens[slot] > at


def test_write_tokens_takes_each_form_by_size(monkeypatch):
    taken = []
    batch = _batch(16)
    monkeypatch.setattr(batch, "_write_rows", lambda *a: taken.append("rows"))
    monkeypatch.setattr(batch, "_scatter", lambda *a: taken.append("scatter"))
    for n in (1, SCALAR_WRITE_MAX_ROWS, SCALAR_WRITE_MAX_ROWS + 1):
        ids = tuple(f"r{i}" for i in range(n))
        batch.write_tokens(ids, tuple(range(3, 3 + n)), list(range(n)))
    assert taken == ["rows", "rows", "scatter"]
