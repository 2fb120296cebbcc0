"""The worker's persistent batch: per-request CPU state and the row order of the batch.

Rows are batch positions; KV slots are separate and stable for a request's lifetime (Neuron's
sequence ids), so `condense()` may reorder rows without moving any KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_async_sm.sampling_params import SamplingParams

POISON_TOKEN = -1
"""Stands in for a token that exists only in a device future. A CPU-built input holding it is stale;
the device rejects it, so a stale input can never be computed on silently."""


@dataclass
class CachedRequestState:
    """What the worker knows of one request: its tokens on the host and where its KV lives."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    kv_slot: int
    # Prompt plus materialized outputs. In async mode the newest tokens may still live only in a
    # device future; they are written here by request id when their step is materialized.
    token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def write_token(self, position: int, token: int) -> None:
        """Record the token sampled for `position` (idempotent: rewriting the same position is harmless)."""
        while len(self.token_ids) <= position:
            self.token_ids.append(POISON_TOKEN)
        self.token_ids[position] = token

    def token_ids_for(self, start: int, count: int) -> list[int]:
        """Tokens [start, start+count) as known on the host; unknown ones are POISON_TOKEN."""
        known = self.token_ids[start : start + count]
        return known + [POISON_TOKEN] * (count - len(known))


def next_row_order(rows: list[str], removed: frozenset[str], added: list[str]) -> list[str]:
    """Row order after one update, as vLLM's persistent batch does it (pure; no state).

    Removed requests leave holes; new requests fill the lowest holes, then append; `condense()` closes
    the remaining holes by moving the last rows into the earliest holes. That last move is what
    reorders rows while the request set stays the same.
    """
    slots: list[str | None] = [None if r in removed else r for r in rows]
    for req_id in added:
        if None in slots:
            slots[slots.index(None)] = req_id
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


class InputBatch:
    """The requests the worker holds and their row order."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.req_ids: list[str] = []  # row order, always condensed

    def update(self, removed: frozenset[str], added: list[CachedRequestState]) -> None:
        """Remove finished requests, add new ones, condense."""
        removed = frozenset(r for r in removed if r in self.requests)
        self.req_ids = next_row_order(self.req_ids, removed, [s.request_id for s in added])
        for req_id in removed:
            del self.requests[req_id]
        for state in added:
            self.requests[state.request_id] = state

    def preview_order(self, removed: frozenset[str], added: list[str]) -> list[str]:
        """The row order `update()` would produce, without changing anything."""
        return next_row_order(self.req_ids, frozenset(r for r in removed if r in self.requests), added)
