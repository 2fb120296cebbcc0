"""The packed forward (model/packed.py) computes what the padded forward computes, row for row.

An eager program runs only a step's real tokens: one-token rows attend through a window of the KV
cache (slots close together) or a gather (slots apart), prompt chunks as their own group. Random
steps over a shared KV cache history, float64, compared with the same program run padded.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from neuron_async_sm.model.packed import pack_step
from neuron_async_sm.model.program import build_step_program
from neuron_async_sm.model.spec import ModelSpec

SLOTS, MAX_LEN = 16, 168


def random_steps(seed: int, count: int):
    """(input_ids, positions, query_lens, slot_ids) of steps that extend each slot's history."""
    rng = random.Random(seed)
    lens = [0] * SLOTS
    for _ in range(count):
        rows, length = rng.choice([1, 2, 3, 5, 8, 13, 16]), rng.choice([1, 1, 4, 16, 32])
        slots = rng.sample(range(SLOTS), rows)
        query_lens = []
        for slot in slots:
            if lens[slot] >= MAX_LEN - 40 or rng.random() < 0.05:
                lens[slot] = 0  # the slot's request finished; a new one starts over
            query_lens.append(rng.choice([0, 1, 1, 1, rng.randint(1, length)]) if length > 1 else rng.choice([0, 1, 1]))
        ids = torch.randint(3, 1000, (rows, length), dtype=torch.int32)
        pos = torch.zeros(rows, length, dtype=torch.int32)
        for row, slot in enumerate(slots):
            pos[row, : query_lens[row]] = torch.arange(lens[slot], lens[slot] + query_lens[row])
            lens[slot] += query_lens[row]
        slot_ids = torch.tensor([s if q else SLOTS for s, q in zip(slots, query_lens, strict=True)], dtype=torch.int32)
        query = torch.tensor(query_lens, dtype=torch.int32)
        if length == 1:
            ids, pos = ids[:, 0], pos[:, 0]
        yield ids, pos, query, slot_ids


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_forward_matches_padded(seed: int) -> None:
    spec = ModelSpec("tiny-llama", "float64", SLOTS, MAX_LEN)
    packed, padded = build_step_program(spec), build_step_program(spec)
    padded.packed = False
    assert packed.packed
    kinds = set()
    for ids, pos, query, slots in random_steps(seed, 60):
        step = dict(input_ids=ids, positions=pos, query_lens=query, slot_ids=slots)
        plan = pack_step(
            ids.view(len(query), -1).long(),
            pos.view(len(query), -1).long().numpy(),
            query.long().numpy(),
            slots.long().numpy(),
            torch.device("cpu"),
            MAX_LEN,
            torch.float64,
        )
        kinds |= {("window" if g.window_start is not None else "gather", g.query_len > 1) for g in plan.groups}
        ours, theirs = packed.forward_logits(**step), padded.forward_logits(**step)
        real = query > 0
        torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=1e-9)
    # every attention path was taken: windows and gathers of one-token rows, chunks
    assert {("window", False), ("gather", False), ("gather", True)} <= kinds
    torch.testing.assert_close(packed.kv_cache.k[:, :SLOTS], padded.kv_cache.k[:, :SLOTS], rtol=0, atol=1e-9)


def test_all_padding_step_touches_no_real_slot() -> None:
    program = build_step_program(ModelSpec("tiny-llama", "float32", 4, 32))
    before = program.kv_cache.k.clone()
    rows = torch.full((3,), 4, dtype=torch.int32)
    zeros = torch.zeros(3, 16, dtype=torch.int32)
    logits = program.forward_logits(
        input_ids=zeros, positions=zeros, query_lens=torch.zeros(3, dtype=torch.int32), slot_ids=rows
    )
    assert logits.shape == (3, 1024)
    assert torch.equal(program.kv_cache.k, before)


def test_packed_mixed_step_runs_only_real_tokens() -> None:
    """A chunk of 5 beside two decode rows, padded to 64: the packed batch holds 7 tokens."""
    ids = torch.zeros(3, 64, dtype=torch.int64)
    pos = torch.zeros(3, 64, dtype=torch.int64)
    pos[0, :5] = torch.arange(5)
    pos[1, 0], pos[2, 0] = 9, 12
    plan = pack_step(ids, pos.numpy(), np.array([5, 1, 1]), np.array([3, 0, 1]), torch.device("cpu"), 64, torch.float32)
    assert plan.input_ids.shape == (7,)
    assert plan.last_token.tolist() == [4, 5, 6]
    decode, chunk = plan.groups
    assert (decode.window_start, decode.rows, decode.context_len) == (0, 2, 13)
    assert (chunk.rows, chunk.query_len, chunk.context_len) == (1, 5, 5)


def test_steady_decode_on_consecutive_slots_matches_padded() -> None:
    """The steady decode step (every row one token, slots consecutive and in order) takes pack_step's
    short path: one window group, nothing picked or placed; it computes what the padded forward does."""
    spec = ModelSpec("tiny-llama", "float64", SLOTS, MAX_LEN)
    packed, padded = build_step_program(spec), build_step_program(spec)
    padded.packed = False
    first, rows = 3, 6
    slots = torch.arange(first, first + rows, dtype=torch.int32)
    prompt = [7, 1, 4, 9, 2, 5]  # each slot's own prompt length, so the rows' positions differ
    for row, length in enumerate(prompt):  # fill each slot's history with a prompt of its own
        step = dict(
            input_ids=torch.randint(3, 1000, (1, length), dtype=torch.int32),
            positions=torch.arange(length, dtype=torch.int32)[None],
            query_lens=torch.tensor([length], dtype=torch.int32),
            slot_ids=slots[row : row + 1],
        )
        packed.forward_logits(**step), padded.forward_logits(**step)
    pos = torch.tensor(prompt, dtype=torch.int32)
    for _ in range(5):
        ids = torch.randint(3, 1000, (rows,), dtype=torch.int32)
        plan = pack_step(
            ids.view(rows, 1).long(),
            pos.view(rows, 1).long().numpy(),
            np.ones(rows, dtype=np.int64),
            slots.long().numpy(),
            torch.device("cpu"),
            MAX_LEN,
            torch.float64,
        )
        (group,) = plan.groups
        assert (group.window_start, group.rows, group.query_index, plan.last_token) == (first, rows, None, None)
        assert group.context_len == int(pos.max()) + 1
        step = dict(input_ids=ids, positions=pos, query_lens=torch.ones(rows, dtype=torch.int32), slot_ids=slots)
        torch.testing.assert_close(packed.forward_logits(**step), padded.forward_logits(**step), rtol=0, atol=1e-9)
        pos = pos + 1
    torch.testing.assert_close(packed.kv_cache.k, padded.kv_cache.k, rtol=0, atol=1e-9)
