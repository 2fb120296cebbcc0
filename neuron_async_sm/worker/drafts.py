"""Speculative decoding on the worker: n-gram drafts from the host's token history, and a step's inputs.

The n-gram drafter reads a request's whole history, whose newest token is in the pending step's
output under async scheduling, so every step with a pending future materializes it first (the
machine's HostDraftBreak, docs/spec-decode.md §6). So when `build_spec_model_input` runs, the
output rank's batch holds every accepted token, and a decode row's true start is the batch's count,
not the scheduler's (which counted every draft in flight as accepted, docs/spec-decode.md §3).

Tensor parallelism: a non-output rank never brings a token to the host, so its batch has no history
to draft from nor a count of accepted tokens. The output rank's `DraftedRows` (each decode row's start
and drafts) is handed to the other ranks by the executor, which builds their inputs from it: the same
rows, lengths, positions and drafts as the output rank's. The one id they lack, each row's last
accepted token, is POISON_TOKEN there and comes from the output rank's ids, broadcast on the device
as every step's input ids are (`model/parallel.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from neuron_async_sm.config import EngineConfig, SpeculativeConfig
from neuron_async_sm.outputs import SchedulerOutput
from neuron_async_sm.worker.input_batch import InputBatch, StepRows, padded_input_shape
from neuron_async_sm.worker.model_input import ModelInput, build_model_input

SPEC_STEP_PROGRAM = "spec_step"  # forward + verification -> accepted tokens [B, 1 + k] int32, -1 after


@dataclass(frozen=True)
class DraftedRows:
    """One spec step's decode rows as the output rank built them, for the other ranks to build theirs."""

    step_id: int
    start: Mapping[str, int]  # per decode row: the position of its last accepted token
    drafts: Mapping[str, tuple[int, ...]]  # per decode row: the drafts it verifies (n-gram; may be none)


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (max_n..min_n long) found earlier in them; up to k
    tokens after its latest earlier occurrence. [] when no suffix recurs."""
    history = np.asarray(tokens, dtype=np.int64)
    size = history.size
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = history[size - n :]
        windows = np.lib.stride_tricks.sliding_window_view(history[: size - 1], n)  # starts 0 .. size - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start : start + k].tolist()
    return []


def build_spec_model_input(
    config: EngineConfig,
    scheduled: SchedulerOutput,
    batch: InputBatch,
    rows: StepRows,
    drafted: DraftedRows | None = None,
    *,
    fed: bool = False,
    one_extras_variant: bool = False,
) -> tuple[ModelInput, DraftedRows]:
    """The spec step's inputs (`[B, L]`, every row a chunk: prompt chunks, and decode rows of their last
    accepted token and its drafts), with `num_drafts` `[B]`; and its decode rows' starts and drafts.

    The output rank (`drafted` None) drafts: a decode row's budget is what the scheduler reserved for
    it (1 + k, or 1 once its speculation is off); n-gram may find fewer drafts. The caller holds
    `batch.lock`; every accepted token is in the batch (the plan materialized first). Another rank
    passes the output rank's `drafted` for this step and builds the same rows from it.

    `fed` (the machine's SpecSteady and SpecExit, draft_model): the pending output is not on the
    host, and the spec program takes each decode row's ids from its `next_input` and its positions
    from the device's count (`SpecStepProgram`, `drafted_input`). The host builds the rows' shape
    alone: the scheduler's counts and positions (optimistic), placeholder ids; every rank the same.
    `one_extras_variant`: as `build_model_input` takes it (a device that compiles per shape).
    """
    spec = config.speculative_config
    assert spec is not None
    assert drafted is None or drafted.step_id == scheduled.step_id, "another step's drafts"
    counts = dict(scheduled.num_scheduled_tokens)
    computed = dict(scheduled.num_computed_tokens)
    starts: dict[str, int] = {}
    drafts: dict[str, tuple[int, ...]] = {}
    for req_id in rows.req_ids:
        state = batch.requests.get(req_id)
        if state is None or computed[req_id] < state.num_prompt_tokens:
            continue  # a prompt chunk: its positions are the scheduler's, exact
        if fed:  # placeholders: the device supplies the ids and the positions (docs/spec-decode.md §2)
            start, proposed = computed[req_id], (0,) * (counts[req_id] - 1)
            if drafted is None and req_id in scheduled.draft_token_ids:  # the output rank: it has the drafts
                # Hazard: an unvalidated draft. Under a grammar the row verifies the first drafts of its
                # next_input: they must be the ones the scheduler cut (its step was applied, so the
                # pending future is the output whose drafts the scheduler read).
                cut = scheduled.draft_token_ids[req_id]
                assert tuple(batch.drafts.get(state.kv_slot, ())[: len(cut)]) == cut, (req_id, cut)
        elif drafted is not None:  # a non-output rank: its batch holds neither the history nor the count
            start, proposed = drafted.start[req_id], drafted.drafts[req_id]
        elif req_id in scheduled.draft_token_ids:  # under a grammar: the scheduler's, cut to the valid prefix
            # Hazard: an unvalidated draft. The mask's rows follow exactly these drafts.
            start, proposed = int(batch.num_tokens[state.kv_slot]) - 1, scheduled.draft_token_ids[req_id]
        else:
            # Hazard: stale positions. The scheduler's count is optimistic (drafts in flight counted
            # as accepted); the batch's count after materialization is the truth.
            start = int(batch.num_tokens[state.kv_slot]) - 1  # the last accepted token's position
            history = batch.token_ids[state.kv_slot, : start + 1]
            proposed = tuple(_propose(spec, batch, state.kv_slot, history, counts[req_id] - 1))
        starts[req_id], drafts[req_id] = start, proposed
        counts[req_id] = 1 + len(proposed)
        computed[req_id] = start
    corrected = dataclasses.replace(
        scheduled, num_scheduled_tokens=counts, num_computed_tokens=computed, all_decode=False
    )
    rows = dataclasses.replace(rows, shape=padded_input_shape(config, corrected))
    model_input = build_model_input(config, corrected, batch, rows, one_extras_variant=one_extras_variant)
    ids, output_index = model_input.tensor("input_ids"), model_input.tensor("output_index")  # [B, L], [B]
    num_drafts = torch.zeros(model_input.num_rows, dtype=torch.int32)  # [B]
    positions = list(model_input.sample_positions)
    for i, req_id in enumerate(model_input.req_ids):
        proposed = drafts.get(req_id)
        if not proposed:
            continue
        n = len(proposed)
        ids[i, 1 : 1 + n] = torch.tensor(proposed, dtype=ids.dtype)
        num_drafts[i] = n
        output_index[i] -= n  # the token sampled at the row's first position, x0's successor
        positions[i] -= n  # x0's successor's position: the run is written from there
    inputs = {**model_input.inputs, "input_ids": ids, "output_index": output_index, "num_drafts": num_drafts}
    logprobs = model_input.logprobs
    if logprobs is not None and logprobs.layout.sample_top >= 0:  # a block per verified position (1 + k)
        logprobs = dataclasses.replace(logprobs, layout=dataclasses.replace(logprobs.layout, sampled=spec.width))
    model_input = dataclasses.replace(model_input, sample_positions=tuple(positions), inputs=inputs, logprobs=logprobs)
    return model_input, DraftedRows(scheduled.step_id, starts, drafts)


def host_drafts(spec: SpeculativeConfig, batch: InputBatch, req_ids: Collection[str]) -> dict[str, list[int]]:
    """Per request (those the batch still holds), the drafts its next row would verify, from what the
    host has after a synchronous step: n-gram's lookup over its history, or the drafter's (draft_model).
    vLLM's scheduler takes them after each step (the plugin's `take_draft_token_ids`)."""
    spec_k, drafts = spec.num_speculative_tokens, {}
    with batch.lock:
        for req_id in sorted(req_ids):
            state = batch.requests.get(req_id)
            if state is None:
                continue
            slot = state.kv_slot
            history = batch.token_ids[slot, : int(batch.num_tokens[slot])]
            drafts[req_id] = _propose(spec, batch, slot, history, spec_k)
    return drafts


def _propose(spec: SpeculativeConfig, batch: InputBatch, slot: int, history: np.ndarray, budget: int) -> list[int]:
    if budget <= 0:
        return []
    if spec.method == "draft_model":  # proposed on the device by the step that gave the last accepted token
        return batch.drafts.get(slot, [])[:budget]
    return propose_ngram(history, budget, spec.prompt_lookup_min, spec.prompt_lookup_max)
