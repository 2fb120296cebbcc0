"""The worker's persistent batch: per-request CPU state in preallocated arrays, and the row order.

Rows are batch positions; KV slots are separate and stable for a request's lifetime (Neuron's
sequence ids), so `condense()` may reorder rows without moving any KV cache. The arrays are indexed
by KV slot (the request's index while it lives here), so a condense moves no data either: only the
row order (`req_ids`) and its slot map (`row_slots`) change, and only on steps that add or remove
requests. Building a step's inputs is then a few vectorized gathers (`model_input.build_model_input`).

A step's rows are worked out once, before anything changes (`plan()` -> `StepRows`): the step
machine observes them, and the batch takes them on when the step's inputs are built (`update()`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.outputs import SchedulerOutput, StepSnapshot
from neuron_async_sm.sampling_params import SamplingParams

POISON_TOKEN = -1
"""Stands in for a token that exists only in a device future. A CPU-built input holding it is stale;
the device rejects it, so a stale input can never be computed on silently."""


@dataclass
class CachedRequestState:
    """What the worker knows of one request besides its tokens, which live in `InputBatch.token_ids`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    kv_slot: int  # the request's index into the batch's arrays while it lives there
    num_output_tokens: int = 0  # outputs already in prompt_token_ids (a restarted request): NewRequestData's
    _batch: InputBatch | None = field(default=None, repr=False, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt plus materialized outputs (a copy); a token still only in a future is POISON_TOKEN."""
        assert self._batch is not None, "the request is not in a batch"
        return self._batch.token_ids[self.kv_slot, : self._batch.num_tokens[self.kv_slot]].tolist()


def next_row_order(rows: Sequence[str], removed: frozenset[str], added: list[str]) -> list[str]:
    """Row order after one update, as vLLM's persistent batch does it (pure; no state).

    Removed requests leave holes; new requests fill the lowest holes, then append; `condense()` closes
    the remaining holes by moving the last rows into the earliest holes. That last move is what
    reorders rows while the request set stays the same.
    """
    if not removed and not added:
        return list(rows)  # the common decode step: O(1) work beyond the copy
    slots: list[str | None] = [None if r in removed else r for r in rows]
    holes = [i for i, r in enumerate(slots) if r is None]  # ascending
    for req_id in added:
        if holes:
            slots[holes.pop(0)] = req_id
        else:
            slots.append(req_id)
    # condense()
    while slots and slots[-1] is None:
        slots.pop()
    hole = 0
    while hole < len(slots):
        if slots[hole] is None:
            slots[hole] = slots.pop()
            while slots and slots[-1] is None:
                slots.pop()
        hole += 1
    return [r for r in slots if r is not None]


def scheduled_order(order: tuple[str, ...], scheduled: Collection[str]) -> tuple[str, ...]:
    """The rows of `order` that run this step, in order. Every scheduled request is in the batch, so
    equal sizes mean every row runs (the common step: no per-request work)."""
    if len(order) == len(scheduled):
        return order
    return tuple(r for r in order if r in scheduled)


def padded_input_shape(config: EngineConfig, scheduled: SchedulerOutput) -> tuple[int, ...]:
    """Shape of the step's input_ids: [decode bucket] for decode, [rows, prefill bucket] otherwise.

    A prefill step is not padded in rows, so its output is [num_reqs]; the first decode after it
    pads to a bucket, which is the shape mismatch the design describes.
    """
    num_rows = len(scheduled.num_scheduled_tokens)
    if scheduled.all_decode:
        return (config.decode_bucket(num_rows),)
    return (num_rows, config.prefill_bucket(max(scheduled.num_scheduled_tokens.values())))


@dataclass(frozen=True)
class StepRows:
    """One step's rows, worked out once before the batch changes: the step machine observes them,
    the batch takes them on (`InputBatch.update`) and the step's inputs are built on them."""

    order: tuple[str, ...]  # every row after the step's removals, additions and condense()
    req_ids: tuple[str, ...]  # the rows that run this step, in order (those of `order` scheduled)
    removed: frozenset[str]  # requests the batch holds that leave it
    added: tuple[CachedRequestState, ...]  # requests that join it, in admission order
    shape: tuple[int, ...]  # the step's padded input_ids (`padded_input_shape`); () outside a step


@dataclass(slots=True)
class WrittenTokens:
    """The last step's tokens the write-back put into the batch: row i's `tokens[i]` at position
    `snapshot.sample_positions[i]` of request `snapshot.req_ids[i]`. Never written after it is built
    (not frozen: one is built on every step, and a frozen dataclass's __init__ costs three times more)."""

    snapshot: StepSnapshot
    tokens: list[int]  # [num_rows]


class InputBatch:
    """The requests the worker holds, their tokens and sampling parameters by KV slot, and their row order."""

    def __init__(self, max_num_seqs: int, max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # the model's: min_tokens holds them back
        # Guards the token state against the async output thread's write-back. Lock order: an
        # output's lock may be held while taking this one, never the reverse (no deadlock).
        self.lock = threading.Lock()
        self.last_written: WrittenTokens | None = None  # the last write-back (under `lock`)
        self.requests: dict[str, CachedRequestState] = {}
        self.req_ids: tuple[str, ...] = ()  # row order, always condensed
        self.row_slots = np.zeros(0, dtype=np.int64)  # [num_rows] KV slot of each row
        # Per KV slot. A slot's row is reset when a request takes it: nothing of its previous owner
        # survives (hazard: stale input ids from a recycled slot).
        self.token_ids = np.full((max_num_seqs, max_model_len), POISON_TOKEN, dtype=np.int32)  # [slots, L]
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # [slots] prompt + outputs written so far
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # [slots]
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)  # [slots]
        self.top_k = np.zeros(max_num_seqs, dtype=np.int32)  # [slots]
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)  # [slots]
        self.seeds = np.zeros(max_num_seqs, dtype=np.int64)  # [slots]
        self.output_base = np.zeros(max_num_seqs, dtype=np.int64)  # [slots] outputs already in the prompt
        # [slots] top tokens each request's logprobs / prompt logprobs ask for; -1: none
        self.logprob_counts = np.full(max_num_seqs, -1, dtype=np.int64)
        self.prompt_logprob_counts = np.full(max_num_seqs, -1, dtype=np.int64)
        # [slot] -> the drafts the draft model proposed after the slot's last accepted token (the
        # materialized next_input's columns 1..k, -1 dropped); the next spec row verifies them.
        self.drafts: dict[int, list[int]] = {}
        # The write-back's views of the same memory: a memoryview item write is plain Python (tens of
        # ns), where a numpy scalar write or a scatter's dozen calls cost microseconds each on the
        # engine's threads, whose caches the device's program has just evicted (measured in the engine
        # at 64 rows: the scatter 86 µs of CPU, numpy scalar writes 34 µs).
        self.token_view = memoryview(self.token_ids)  # [slots, L]
        self.token_flat = memoryview(self.token_ids.reshape(-1))  # [slots * L]: the decode step's inputs read it
        self._count_view = memoryview(self.num_tokens)  # [slots]
        # The padded per-row inputs of the last rows built (model_input.RowInputs), reused while the
        # same requests run in the same rows at the same padding; dropped on every add or remove.
        self.row_inputs_cache: object | None = None

    def plan(self, scheduled: SchedulerOutput, config: EngineConfig) -> StepRows:
        """The rows `scheduled` leads to, and its padded input shape, without changing anything."""
        added = [
            CachedRequestState(
                n.request_id, list(n.prompt_token_ids), n.sampling_params, n.seed, n.kv_slot, n.num_output_tokens
            )
            for n in scheduled.scheduled_new_reqs
        ]
        shape = padded_input_shape(config, scheduled)
        return self.rows_after(scheduled.finished_req_ids, added, scheduled.num_scheduled_tokens, shape)

    def rows_after(
        self,
        removed: Collection[str],
        added: list[CachedRequestState],
        scheduled: Collection[str] | None = None,
        shape: tuple[int, ...] = (),
    ) -> StepRows:
        """The rows after removing `removed` and adding `added` (condensed); of them, `scheduled` run
        (default: all). O(1) when nothing joins or leaves."""
        gone = frozenset(r for r in removed if r in self.requests)
        if gone or added:
            order = tuple(next_row_order(self.req_ids, gone, [s.request_id for s in added]))
        else:
            order = self.req_ids  # the common decode step: the same tuple, no work
        req_ids = order if scheduled is None else scheduled_order(order, scheduled)
        return StepRows(order, req_ids, gone, tuple(added), shape)

    def update(self, rows: StepRows) -> None:
        """Take on a step's rows: remove its finished requests, add its new ones, condense. Nothing to
        do when the batch has them already (a step that adds and removes nothing). Under `lock`."""
        if rows.order is self.req_ids:
            return
        self.row_inputs_cache = None
        for req_id in rows.removed:
            self.requests.pop(req_id)._batch = None
        for state in rows.added:
            self._add(state)
        self.req_ids = rows.order
        requests = self.requests
        self.row_slots = np.fromiter((requests[r].kv_slot for r in rows.order), np.int64, len(rows.order))

    def slots(self, req_ids: tuple[str, ...]) -> np.ndarray:
        """The KV slots of `req_ids` (rows of the batch, in order), [num_rows]."""
        if len(req_ids) == len(self.req_ids):  # every row runs: the cached map, no work
            return self.row_slots
        return np.fromiter((self.requests[r].kv_slot for r in req_ids), np.int64, len(req_ids))

    def _add(self, state: CachedRequestState) -> None:
        slot, num_prompt = state.kv_slot, len(state.prompt_token_ids)
        self.token_ids[slot, :] = POISON_TOKEN
        self.token_ids[slot, :num_prompt] = state.prompt_token_ids
        self.num_tokens[slot] = self.num_prompt_tokens[slot] = num_prompt
        self.drafts.pop(slot, None)  # hazard: stale drafts from a recycled slot's previous owner
        params = state.sampling_params
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.seeds[slot] = state.seed
        self.output_base[slot] = state.num_output_tokens
        self.logprob_counts[slot] = -1 if params.logprobs is None else params.logprobs
        self.prompt_logprob_counts[slot] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        state._batch = self
        self.requests[state.request_id] = state

    def write_tokens(self, req_ids: tuple[str, ...], positions: tuple[int | None, ...], tokens: list[int]) -> None:
        """Record sampled tokens: row i's at positions[i] of request req_ids[i].

        Hazard: token ownership. Addressed by request id, never by row: rows move between steps. A
        request no longer here (finished, aborted) is skipped, so its recycled KV slot never receives
        a token sampled for the slot's previous owner. None positions (partial prefill) sample nothing.
        Idempotent: rewriting the same positions is harmless. Row by row through memoryviews of the
        arrays: at every batch size cheaper in the engine than a numpy scatter (see __init__).
        """
        n = len(req_ids)
        assert len(positions) == len(tokens) == n, (n, len(positions), len(tokens))
        requests, token_ids, num_tokens = self.requests, self.token_view, self._count_view
        for req_id, at, token in zip(req_ids, positions, tokens, strict=True):
            state = requests.get(req_id)
            if state is None or at is None:  # gone (token ownership), or a partial prefill
                continue
            slot = state.kv_slot
            token_ids[slot, at] = token
            if num_tokens[slot] <= at:
                num_tokens[slot] = at + 1

    def write_back(self, snapshot: StepSnapshot, tokens: list[int]) -> None:
        """Apply one step's sampled tokens, by the snapshot's request ids (never by current row); on
        whichever thread materialized them (`AsyncModelRunnerOutput`)."""
        with self.lock:
            # Hazard: token ownership after condense(). Addressed by the snapshot's request ids; the
            # rows may have moved or left since this step was sampled.
            self.write_tokens(snapshot.req_ids, snapshot.sample_positions, tokens)
            self.last_written = WrittenTokens(snapshot, tokens)

    def write_runs(
        self, snapshot: StepSnapshot, runs: list[list[int]], next_input: list[list[int]] | None = None
    ) -> None:
        """Apply one speculative step's tokens: row i's run (accepted drafts, then one more) after
        the request's tokens so far, by request id as `write_back` does; with `next_input`
        (draft_model: per row the last accepted token, then the drafts after it), keep each row's
        drafts for its next spec row.

        After the tokens so far, not at `snapshot.sample_positions[i]`: a row the device placed
        (SpecSteady, SpecExit) has the host's optimistic position there, which counts the drafts in
        flight as accepted (an upper bound, asserted). Steps are written back in order (the engine
        applies step N - 1 before it schedules step N + 1), so the count is the run's start."""
        with self.lock:
            # Hazard: token ownership after condense(): by the snapshot's request ids, never by row.
            for i, (req_id, at, run) in enumerate(zip(snapshot.req_ids, snapshot.sample_positions, runs, strict=True)):
                state = self.requests.get(req_id)
                if state is None or at is None:  # gone (token ownership), or a partial prefill
                    continue
                slot = state.kv_slot
                if next_input is not None:
                    row = next_input[i]
                    # Hazard: wrong draft column. Column 0 is the last accepted token, the drafts follow it.
                    assert row[0] == run[-1], (req_id, row, run)
                    self.drafts[slot] = [d for d in row[1:] if d >= 0]
                # Hazard: optimistic positions. The host's position of a device-placed row is an upper bound.
                start = int(self.num_tokens[slot])
                assert at >= start, (req_id, at, start)
                at = start
                self.token_ids[slot, at : at + len(run)] = run
                # Drafts rejected since the last write may lie past the run: the count is the run's end.
                self.num_tokens[slot] = at + len(run)
            # Decode inputs never follow a speculative step's tokens (`_follows`): none kept.
            self.last_written = None
