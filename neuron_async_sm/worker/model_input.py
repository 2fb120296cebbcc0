"""Building one step's padded program inputs from the worker's CPU state."""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from operator import add

import numpy as np
import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model import sample_tokens
from neuron_async_sm.model.inputs import FORWARD_INPUT_NAMES, INPUTS
from neuron_async_sm.model.logits_processors import PROCESSING, parts_used, process_logits, tokens_so_far
from neuron_async_sm.model.logprobs import LogprobsLayout
from neuron_async_sm.outputs import SchedulerOutput
from neuron_async_sm.runtime import WireTensor
from neuron_async_sm.worker.input_batch import POISON_TOKEN, InputBatch, StepRows, WrittenTokens
from neuron_async_sm.worker.processing_inputs import processing_inputs
from neuron_async_sm.worker.step_logprobs import NONE, StepLogprobs, count_input, top_count

_plus_one = (1).__add__
SAMPLED_DTYPE = INPUTS["input_ids"].dtype  # the program's output: it feeds the next step as its input_ids
_NUMPY_DTYPE = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


@dataclass(frozen=True)
class ModelInput:
    """One program call's padded inputs. B = padded rows, L = padded tokens per row."""

    req_ids: tuple[str, ...]  # real rows in order; rows past len(req_ids) are padding
    sample_positions: tuple[int | None, ...]  # per real row: position of the token it samples
    is_decode: bool  # every row computes one decode token: input_ids is 1-D
    # The step program's inputs by name (`model/inputs.py` declares them: dtypes, shapes, padding),
    # each kept once, as the runtime is sent it: a host tensor, or the bytes of one already encoded
    # (every input of a decode step; a prefill's inputs fixed by its rows, see RowInputs).
    inputs: Mapping[str, torch.Tensor | WireTensor]
    logprobs: StepLogprobs | None = None  # None: no row asks, the output is the tokens alone

    @property
    def num_rows(self) -> int:
        return int(self.inputs["query_lens"].shape[0])

    def tensor(self, name: str) -> torch.Tensor:
        """Input `name` as a host tensor (an encoded one decoded: a copy)."""
        value = self.inputs[name]
        return value.decode() if isinstance(value, WireTensor) else value

    def forward_inputs(self) -> dict[str, torch.Tensor | WireTensor]:
        """Inputs of the logits-only program (host sampling)."""
        return {name: self.inputs[name] for name in FORWARD_INPUT_NAMES}

    def sample_on_host(self, logits: torch.Tensor, token_ids: np.ndarray) -> torch.Tensor:
        """Host sampling (sync mode): the same pure processing and sampler the device runs, on logits
        [B, vocab]; `token_ids` `[slots, max_model_len]`: the batch's, every token so far written."""
        sampling = {name: self.tensor(name) for name in ("temperature", "top_k", "top_p", "seeds", "output_index")}
        if "prompt_len" not in self.inputs:  # no row processes its logits
            return sample_tokens(logits, **sampling)
        processing = {name: self.tensor(name) for name in PROCESSING}
        counts = tokens_so_far(self.tensor("positions").numpy(), self.tensor("query_lens").numpy())  # [B]
        slots = np.minimum(self.tensor("slot_ids").numpy(), len(token_ids) - 1)  # padding rows count nothing
        history = torch.from_numpy(token_ids[slots, : max(int(counts.max()), 1)])  # [B, T]
        parts = parts_used(processing)
        logits = process_logits(logits, processing, history, torch.from_numpy(counts), sampling["output_index"], parts)
        return sample_tokens(logits, **sampling, min_p=processing["min_p"] if "min_p" in parts else None)


def logits_dtype(dtype: str) -> torch.dtype:
    """dtype of the logits program's output: float64 models keep float64, others give float32."""
    return torch.float64 if dtype == "float64" else torch.float32


@dataclass(frozen=True)
class RowInputs:
    """The padded inputs fixed by which request runs in which row: the same on every step until a
    request joins or leaves (sampling parameters and KV slots never change during a request's life).
    Shared by consecutive steps' ModelInputs: never written after it is built (every runtime copies
    its inputs at enqueue)."""

    req_ids: tuple[str, ...]  # the rows it was built for
    num_padded: int  # B
    num_prompt: np.ndarray  # int64 [R]
    # The decode step's per-row constants, as Python ints (it is built with map(), no numpy):
    token_offsets: tuple[int, ...]  # [R] where each row's tokens start in InputBatch.token_flat
    output_index_offsets: tuple[int, ...]  # [R] 1 - num_prompt + output_base: a decode's output index is start + this
    output_base: np.ndarray  # int64 [R] outputs already in the prompt (a restarted request)
    logprob_counts: np.ndarray  # int [R] top tokens per sampled token each row asks for (NONE: none)
    prompt_logprob_counts: np.ndarray  # int [R] top tokens per prompt position (NONE: none)
    logprob_top: int  # the most of logprob_counts: the step's top-N (NONE: no row asks)
    prompt_logprob_top: int  # the same for prompt_logprob_counts
    # Encoded once for the runtime, [B] each: slot_ids (padding rows: the scratch slot), temperature,
    # top_k, top_p, seeds, and query_lens of a decode step (1 per real row; a prefill's are per step);
    # the logits-processing inputs when a row uses them ([B] or [B, W], model/logits_processors.py).
    # sample_logprobs when a row asks.
    encoded: Mapping[str, WireTensor]

    def step_logprobs(self) -> StepLogprobs | None:
        """A step's sampled-token logprobs (a prefill may add its prompt's), or None when no row asks."""
        if self.logprob_top == NONE:  # the common step: an int compare, nothing else
            return None
        layout = LogprobsLayout(self.logprob_top, NONE, 1)
        return StepLogprobs(layout, self.logprob_counts, self.prompt_logprob_counts, None, None)


def _follows(written: WrittenTokens, step_id: int, req_ids: tuple[str, ...], start: tuple[int, ...]) -> bool:
    """`written` is the step just before `step_id`, on the same rows, each of which sampled the position
    this step starts at: its tokens are then the ids the batch holds there, the gather's result.

    Hazard: stale input ids. All three are needed: an older step's tokens, or another request's
    (a recycled id), would be a silent wrong token where the gather reads POISON_TOKEN."""
    snapshot = written.snapshot
    return snapshot.step_id == step_id - 1 and snapshot.req_ids == req_ids and snapshot.sample_positions == start


def _padded(values: np.ndarray, num_padded: int, name: str, fill: float | None = None) -> np.ndarray:
    """Step input `name` [B]: `values` in the real rows, the input's padding (or `fill`) after them."""
    spec = INPUTS[name]
    out = np.full(num_padded, spec.pad if fill is None else fill, dtype=_NUMPY_DTYPE[spec.dtype])  # [B]
    out[: len(values)] = values
    return out


def row_inputs(
    config: EngineConfig,
    batch: InputBatch,
    req_ids: tuple[str, ...],
    slots: np.ndarray,
    num_padded: int,
    one_extras_variant: bool = False,
) -> RowInputs:
    """The step's RowInputs: the batch's cached ones when the rows and the padding are the same.

    `one_extras_variant` (a device that compiles per shape): a step where some row processes its
    logits, asks for logprobs or (with `config.sampling_extras`) samples under a grammar carries the
    processing inputs (neutral in the rows that use none) and the sampled tokens' logprobs at
    `max_logprobs` top tokens (each row reads those it asked for, none when it asked for none), and
    prompt logprobs come at `max_logprobs` too: what the program computes then depends on the shape
    alone, one variant per shape (and one with a mask), which warm-up compiles (engine/warmup.py).
    Otherwise every count and combination would be a program of its own, compiled the first time
    serving meets it."""
    cached = batch.row_inputs_cache
    if isinstance(cached, RowInputs) and cached.num_padded == num_padded and cached.req_ids == req_ids:
        return cached
    fixed = {
        "query_lens": _padded(np.ones(len(req_ids)), num_padded, "query_lens"),
        "slot_ids": _padded(slots, num_padded, "slot_ids", config.max_num_seqs),  # padding rows: the scratch slot
        "temperature": _padded(batch.temperature[slots], num_padded, "temperature"),
        "top_k": _padded(batch.top_k[slots], num_padded, "top_k"),
        "top_p": _padded(batch.top_p[slots], num_padded, "top_p"),
        "seeds": _padded(batch.seeds[slots], num_padded, "seeds"),
    }
    params = [batch.requests[r].sampling_params for r in req_ids]
    prompt_len = batch.num_prompt_tokens[slots] - batch.output_base[slots]  # [R] the original prompt
    logprob_counts, prompt_counts = batch.logprob_counts[slots], batch.prompt_logprob_counts[slots]
    top, prompt_top = top_count(logprob_counts), top_count(prompt_counts)
    # A grammar's step carries them too where the engine takes extras: its mask is one variant more,
    # not two (warm-up). Without extras (sampling_extras off) it carries none: the mask alone.
    grammar = config.sampling_extras and any(p.structured_outputs is not None for p in params)
    always = one_extras_variant and (top != NONE or grammar)
    processing = processing_inputs(params, prompt_len, num_padded, batch.eos_token_ids, always=always)
    if one_extras_variant:
        top = config.max_logprobs if processing else NONE
        prompt_top = config.max_logprobs if prompt_top != NONE else NONE
    encoded = {
        **{name: WireTensor(value.tobytes(), (num_padded,), INPUTS[name].dtype) for name, value in fixed.items()},
        **{name: WireTensor(v.tobytes(), v.shape, PROCESSING[name].dtype) for name, v in processing.items()},
    }
    if top != NONE:
        encoded["sample_logprobs"] = count_input(top)
    rows = RowInputs(
        req_ids=req_ids,
        num_padded=num_padded,
        num_prompt=batch.num_prompt_tokens[slots],
        token_offsets=tuple((slots * batch.max_model_len).tolist()),
        output_index_offsets=tuple((1 - batch.num_prompt_tokens[slots] + batch.output_base[slots]).tolist()),
        output_base=batch.output_base[slots],
        logprob_counts=logprob_counts,
        prompt_logprob_counts=prompt_counts,
        logprob_top=top,
        prompt_logprob_top=prompt_top,
        encoded=encoded,
    )
    batch.row_inputs_cache = rows
    return rows


def build_model_input(
    config: EngineConfig,
    scheduled: SchedulerOutput,
    batch: InputBatch,
    rows: StepRows,
    *,
    cpu_ids: bool = True,
    one_extras_variant: bool = False,
) -> ModelInput:
    """The batch takes on the step's `rows` (`InputBatch.update`), then its inputs are built from CPU
    state: a prefill's are vectorized gathers from the batch's arrays; a decode step's few values per
    row are gathered in plain Python through the batch's memoryview. The caller holds `batch.lock`.

    Tokens that exist only in a pending future come out as POISON_TOKEN (hazard: stale input ids;
    the device rejects them). A decode step whose rows are the previous step's builds only its ids,
    positions and output indices: the rest (`RowInputs`) is the previous step's. Its ids are the
    previous step's tokens as written back (`batch.last_written`) when that step sampled exactly
    them (`_follows`), and are not built at all (`cpu_ids=False`: POISON_TOKEN in every real row)
    when the plan feeds every input id from a future. `one_extras_variant`: see `row_inputs`.
    """
    batch.update(rows)
    req_ids, shape, is_decode = rows.req_ids, rows.shape, scheduled.all_decode
    slots = batch.slots(req_ids)  # [num_rows]
    written = batch.last_written
    num_padded, num_rows = shape[0], len(req_ids)
    fixed = row_inputs(config, batch, req_ids, slots, num_padded, one_extras_variant)
    computed = scheduled.num_computed_tokens
    if is_decode:
        # Every row is past its prompt and samples the token after its one input token. map() over a
        # memoryview and one buffer per tensor: a decode step's few values cost less so than numpy's
        # dozen calls, each microseconds on the engine's cache-cold thread (and no bytecode per row).
        start = tuple(map(computed.__getitem__, req_ids))  # [R] position of each row's input token
        end = tuple(map(_plus_one, start))  # [R] position of the token each row samples
        if not cpu_ids:  # a future replaces them; if they ever reached the device it would reject them
            ids = array("i", [POISON_TOKEN]) * num_rows  # [B]
        elif written is not None and _follows(written, scheduled.step_id, req_ids, start):
            ids = array("i", written.tokens)  # [B]
        else:
            ids = array("i", map(batch.token_flat.__getitem__, map(add, fixed.token_offsets, start)))  # [B]
        pos = array("i", start)  # [B]
        output_index = array("q", map(add, start, fixed.output_index_offsets))  # [B]: end - num_prompt + output_base
        if num_padded > num_rows:
            pad = [0] * (num_padded - num_rows)
            ids.extend(pad)
            pos.extend(pad)
            output_index.extend(pad)
        # Encoded from the buffers: the runtime gets every input of a decode step as bytes and
        # encodes nothing.
        inputs = {
            **fixed.encoded,
            "input_ids": WireTensor(ids.tobytes(), shape, INPUTS["input_ids"].dtype),
            "positions": WireTensor(pos.tobytes(), shape, INPUTS["positions"].dtype),
            "output_index": WireTensor(output_index.tobytes(), shape, INPUTS["output_index"].dtype),
        }
        return ModelInput(req_ids, end, True, inputs, fixed.step_logprobs())
    start = np.fromiter(map(computed.__getitem__, req_ids), np.int64, num_rows)  # [R]
    width = shape[1]
    count = np.fromiter(map(scheduled.num_scheduled_tokens.__getitem__, req_ids), np.int64, num_rows)  # [R]
    cols = np.arange(width, dtype=np.int64)  # [L]
    real = cols[None, :] < count[:, None]  # [R, L]
    at = np.where(real, start[:, None] + cols[None, :], 0)  # [R, L] positions; padding reads position 0
    ids = np.zeros((num_padded, width), dtype=np.int32)  # [B, L]
    pos = np.zeros((num_padded, width), dtype=np.int32)  # [B, L]
    ids[:num_rows] = np.where(real, batch.token_ids[slots[:, None], at], 0)
    pos[:num_rows] = at
    end = start + count  # [R] position of the token each row samples
    num_prompt = fixed.num_prompt  # [R]
    sample_positions = end.tolist()
    for i in np.flatnonzero(end < num_prompt).tolist():  # a partial prefill chunk samples nothing
        sample_positions[i] = None
    inputs = {
        "input_ids": torch.from_numpy(ids),
        "positions": torch.from_numpy(pos),
        "query_lens": torch.from_numpy(_padded(count, num_padded, "query_lens")),  # a prefill's are per step
        **{name: value for name, value in fixed.encoded.items() if name != "query_lens"},
        "output_index": torch.from_numpy(
            _padded(np.maximum(end - num_prompt, 0) + fixed.output_base, num_padded, "output_index")
        ),
    }
    logprobs = fixed.step_logprobs()
    if fixed.prompt_logprob_top != NONE:
        logprobs = _prompt_logprobs(fixed, logprobs, inputs, batch.token_ids[slots], at, real, num_padded)
    return ModelInput(req_ids, tuple(sample_positions), False, inputs, logprobs)


def _prompt_logprobs(
    fixed: RowInputs,
    logprobs: StepLogprobs | None,
    inputs: dict[str, torch.Tensor | WireTensor],
    tokens: np.ndarray,
    at: np.ndarray,
    real: np.ndarray,
    num_padded: int,
) -> StepLogprobs | None:
    """A prefill step's prompt logprobs: adds the program's inputs for them (`prompt_logprobs`,
    `prompt_targets`) and returns the step's logprobs, or `logprobs` unchanged when no row that asks
    computes prompt tokens (a row whose chunk holds none of its prompt's logprobs, as a one-token
    prompt's, gets an empty list). tokens int32 `[R, max_model_len]` (the rows'),
    at / real `[R, L]`: each chunk position and whether it is a real token."""
    counts = fixed.prompt_logprob_counts
    if not ((counts != NONE) & (at[:, 0] < fixed.num_prompt)).any():  # no row that asks is in its prompt
        return logprobs
    nxt = at + 1  # [R, L] the position whose token each position's logprob is of
    valid = real & (nxt < fixed.num_prompt[:, None]) & (counts[:, None] != NONE)  # [R, L]
    top = fixed.prompt_logprob_top
    targets = np.zeros((num_padded, at.shape[1]), dtype=np.int32)  # [B, L]
    targets[: len(counts)] = np.where(valid, np.take_along_axis(tokens, np.where(valid, nxt, 0), axis=1), 0)
    inputs["prompt_logprobs"] = count_input(top)
    inputs["prompt_targets"] = torch.from_numpy(targets)
    sample = logprobs.layout.sample_top if logprobs is not None else NONE
    layout = LogprobsLayout(sample, top, at.shape[1])
    return StepLogprobs(layout, fixed.logprob_counts, counts, targets[: len(counts)], valid)
