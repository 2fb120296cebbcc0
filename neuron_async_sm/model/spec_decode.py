"""Speculative verification on the device: one forward scores a row's last accepted token and its drafts.

A spec row holds `[x0, d1 .. dn]` (n = its `num_drafts`, 0..k) at consecutive positions after the
request's accepted tokens. The forward writes their K/V like a prompt chunk's; the logits at x0 and
each draft decide, left to right, whether the next draft is accepted (`rejection_sample`). The row's
output is the accepted drafts, then one more token (the recovered token at the first rejection, or
the bonus after the last draft), then -1 (docs/spec-decode.md §2, §8). Prefill and plain decode rows
are rows with no drafts: their one token is the ordinary sample at their last position.

Logits processing (penalties, logit_bias, min_tokens; min_p in the sampler): each verified
position is processed as an ordinary step processes the one it samples, with the history that
position would have without speculation, the drafts before it included: the forward writes the
token history (`TokenHistory`) at every position of the row, drafts too, and position c counts the
row's tokens up to its own; its output index is the row's plus c.

Logprobs (`sample_logprobs`, `prompt_logprobs`): an emitted token's are an ordinary step's at its
position, vLLM's raw logprobs (model/logprobs.py): the target's logits there before any processing,
whether the token is an accepted draft, the recovered token or the bonus. Packed after the token
columns, one block per verified position (past a row's run: unread), then the prompt blocks.

KV of rejected drafts: written at positions past the request's accepted tokens. No later query
attends to them (a query attends to positions up to its own), and the request's next row starts at
its last accepted token, so it overwrites them before any query could reach them.

The device's count (`slot_len`, docs/spec-decode.md §2): per KV slot the tokens whose KV is valid,
set by every call from what it computed (a prompt chunk: start + its length; a spec or plain row:
start + 1 + accepted). A row fed from the previous call's `next_input` (`drafted_input`: the
machine's SpecSteady and SpecExit, no host round trip) is placed there: its positions are
`slot_len[slot] + arange`, its output index the host's less the host's position plus `slot_len`
(the host counted every draft in flight as accepted; the difference is the same for both).
"""

from __future__ import annotations

import numpy as np
import torch

from neuron_async_sm.model.drafter import Drafter
from neuron_async_sm.model.grammar_mask import apply_token_bitmask
from neuron_async_sm.model.inputs import SamplingInputs
from neuron_async_sm.model.logits_processors import READS_HISTORY, parts_used, process_logits
from neuron_async_sm.model.logprobs import block_width, pack_output, position_logprobs
from neuron_async_sm.model.packed import PackedBatch
from neuron_async_sm.model.program import StepProgram
from neuron_async_sm.model.sampler import _below_min_p, _filtered_out, sample_tokens, uniform_noise

# The acceptance draw's stream: its key is output_index with this bit set, so it never equals an
# ordinary sample's key (an output index is far below 2**62) and the plain stream stays today's.
ACCEPT_STREAM = 1 << 62


def rejection_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    output_index: torch.Tensor,
    min_p: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens a spec row emits, int64 `[B, W]` (-1 past them), from the target's logits `[B, W, vocab]`
    at the row's last accepted token and each draft, and `drafts` int64 `[B, W]`: drafts[b, c] is the
    draft after logits position c (-1: none; a row's drafts are a prefix of its columns).

    Per row: temperature, top_k, top_p, seeds `[B]`, min_p `[B]` (None: off); output_index `[B]` the
    output index of the token at position 0 (position c: output_index + c). The logits are processed
    already (penalties, logit_bias, min_tokens: `SpecStepProgram`); min_p filters as the sampler does.
    Greedy: a draft is accepted while it equals the argmax. Sampled, the drafter's q one-hot on its
    draft (n-gram): accepted when u < p(d), u drawn per (seed, output index) in its own stream; at a
    rejection the token is drawn from p without d, with the ordinary sampler's noise for that output
    index, so it is the ordinary sample whenever that is not d. With no draft left the bonus is the
    ordinary sample. With the drafter's q, float64 `[B, W, vocab]` (`draft_probs`, draft_model: q of
    the draft after each position), accepted when u * q(d) < p(d), and at a rejection the token is
    drawn from max(p - q, 0) with the ordinary noise. Every draw is keyed by (seed, output index)
    alone: the same tokens in any batch, in async and in sync mode.
    """
    b, width, vocab = logits.shape
    flat = logits.reshape(b * width, vocab)
    index = (output_index.long().unsqueeze(1) + torch.arange(width, device=logits.device)).reshape(-1)  # [B*W]

    def per_position(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(width)

    temp, k, p, seed = (per_position(x) for x in (temperature, top_k, top_p, seeds))
    floor = None if min_p is None else per_position(min_p)
    sampled = sample_tokens(flat, temperature=temp, top_k=k, top_p=p, seeds=seed, output_index=index, min_p=floor)
    greedy = temp <= 0
    draft = drafts.reshape(-1).long()
    has_draft = draft >= 0
    if logits.device.type == "cpu" and bool(greedy.all()):  # a host branch costs no device sync
        return _runs(has_draft & (draft == sampled), draft, sampled, b, width)
    safe = draft.clamp(min=0).unsqueeze(1)  # [B*W, 1]
    scaled = flat.double() / torch.where(greedy, 1.0, temp.double()).unsqueeze(1)
    if floor is not None:  # the sampler's order: min_p, then top-k and top-p
        scaled = scaled.masked_fill(_below_min_p(scaled, floor), float("-inf"))
    scaled = scaled.masked_fill(_filtered_out(scaled, k, p, (k > 0) & (k < vocab), p < 1.0), float("-inf"))
    p_draft = torch.softmax(scaled, dim=-1).gather(1, safe).squeeze(1)  # p(d) [B*W]
    u = uniform_noise(seed, index | ACCEPT_STREAM, 1)[:, 0]  # [B*W]
    gumbel = -torch.log(-torch.log(uniform_noise(seed, index, vocab)))
    if draft_probs is None:
        accept = has_draft & torch.where(greedy, draft == flat.argmax(dim=-1), u < p_draft)
        # The residual max(p - q, 0) for a one-hot q: p without d, by Gumbel-max with the ordinary noise.
        residual = (scaled + gumbel).scatter(1, safe, float("-inf")).argmax(dim=-1)
    else:
        q = draft_probs.reshape(b * width, vocab).to(scaled.device)
        q_draft = q.gather(1, safe).squeeze(1)  # q(d) [B*W]
        accept = has_draft & torch.where(greedy, draft == flat.argmax(dim=-1), u * q_draft < p_draft)
        p = torch.softmax(scaled, dim=-1)
        residual = (torch.log((p - q).clamp(min=0.0)) + gumbel).argmax(dim=-1)
        # The draft was drawn from q, so u * q(d) < p(d) holds whenever p(d) >= q(d): at a rejection
        # p(d) < q(d), and the residual is nonzero somewhere (both sum to one).
        recovered = torch.where(greedy, sampled, residual)
        return _runs(accept, draft, torch.where(has_draft, recovered, sampled), b, width)
    recovered = torch.where(greedy | (sampled != draft), sampled, residual)  # [B*W]
    return _runs(accept, draft, torch.where(has_draft, recovered, sampled), b, width)


def _runs(accept: torch.Tensor, draft: torch.Tensor, last: torch.Tensor, b: int, width: int) -> torch.Tensor:
    """`[B, W]`: each row's drafts up to its first rejection, then `last` at that position, then -1.
    accept, draft, last: `[B*W]`; last is the token emitted where a row's run ends."""
    accept, draft, last = accept.view(b, width), draft.view(b, width), last.view(b, width)
    accepted = accept.long().cumprod(dim=1).sum(dim=1, keepdim=True)  # [B, 1] a
    col = torch.arange(width, device=draft.device).unsqueeze(0)  # [1, W]
    return torch.where(col < accepted, draft, torch.where(col == accepted, last, -1))


class SpecStepProgram:
    """The step program with verification: the target's forward, then `rejection_sample`; `[B, W]` int32.

    Inputs: the step program's nine (`model/inputs.py`; input_ids `[B, L]` on the host: the drafts
    come from the host, n-gram) and num_drafts int32 `[B]`, the last num_drafts real tokens of each row
    being drafts. output_index is the output index of the token after each row's first verified
    token (x0 for a spec row, the last token otherwise). Eager only (config: enforce_eager).

    With a `drafter` (draft_model) the output is `[B, 2W]`: the `[B, W]` tokens, then `next_input`
    `[B, W]`, the row's last accepted token and the k drafts the drafter proposed after it (-1 past
    them: none for a row without tokens, fewer where they would pass max_model_len).

    `drafted_input` (optional, draft_model): the previous call's output `[B, 2W + ...]` (a future, the same
    rows in the same order, or in another order given by `drafted_rows` int `[B]`, per row the
    previous output's row it reads). Every real row then computes on its `next_input`: the last
    accepted token and its first num_drafts drafts (fewer where the drafter proposed fewer), at the
    device's positions; the host's input_ids and positions of those rows are placeholders.

    With logprobs asked (`sample_logprobs`, `prompt_logprobs` with `prompt_targets`, host inputs as
    the step program takes them) their float32 bits follow those columns: W blocks per row, then L
    prompt blocks per row (`LogprobsLayout` with `sampled` = W).

    `token_bitmask` (structured output, n-gram): int32 `[B, W, words]`, row c of a row from its grammar
    after its first c drafts (the scheduler's, cut to the grammar-valid prefix): the mask of position
    c, applied after logits processing as the step program applies its own.
    """

    def __init__(self, program: StepProgram, width: int, drafter: Drafter | None = None) -> None:
        self.program = program
        self.width = width  # W = 1 + k
        self.drafter = drafter
        # [slots] tokens of each KV slot whose KV is valid, as this program computed them (the
        # device's count; the same on every TP rank, which run the same calls on the same inputs).
        self.slot_len = np.zeros(program.scratch_slot + 1, dtype=np.int32)

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        drafted_input: torch.Tensor | None = None,
        drafted_rows: torch.Tensor | None = None,
        sample_logprobs: torch.Tensor | None = None,
        prompt_logprobs: torch.Tensor | None = None,
        prompt_targets: torch.Tensor | None = None,
        token_bitmask: torch.Tensor | None = None,
        **inputs: torch.Tensor,  # the five SamplingInputs, then logits processing's
    ) -> torch.Tensor:
        program, width = self.program, self.width
        temperature, top_k, top_p, seeds, output_index = SamplingInputs.take(inputs)  # checked before the forward
        processing = inputs
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(1)  # [B, L]
        pos = positions if positions.dim() == 2 else positions.unsqueeze(1)
        rows, length = ids.shape
        lens = query_lens.numpy().astype(np.int64)  # [B]
        drafted = num_drafts.numpy().astype(np.int64)  # [B]
        if drafted_input is not None:  # SpecSteady / SpecExit: the previous call's next_input, on the device
            if drafted_rows is not None:  # ReorderRemap on a non-output rank: the rows permuted here
                drafted_input = drafted_input.index_select(0, drafted_rows.to(drafted_input.device, torch.int64))
            fed = self._fed(drafted_input, ids, pos, lens, drafted, slot_ids, output_index)
            ids, pos, lens, drafted, output_index = fed
            query_lens = torch.from_numpy(lens.astype(np.int32))
        if (drafted < 0).any() or (drafted >= np.maximum(lens, 1)).any() or drafted.max(initial=0) >= width:
            raise ValueError(f"num_drafts {drafted.tolist()} must lie in [0, min(query_len, {width}))")
        first = np.maximum(lens - 1 - drafted, 0)  # [B] column of the first verified token
        cols = first[:, None] + np.arange(width)[None, :]  # [B, W]
        real = np.arange(width)[None, :] < drafted[:, None]  # [B, W] a draft follows column c
        host_ids = ids.numpy().astype(np.int64)
        draft_ids = np.where(real, host_ids[np.arange(rows)[:, None], np.minimum(cols + 1, length - 1)], -1)
        at = np.minimum(cols, np.maximum(lens - 1, 0)[:, None])  # [B, W] positions past a row's end: its last
        columns = width * (1 if self.drafter is None else 2)  # the tokens (draft_model: then next_input)
        with program._no_autograd():
            batch = program._prepare(ids, pos, query_lens, slot_ids)
            dev = program.device
            processed = program._processing_inputs(processing)
            parts = parts_used(processing) if processed is not None else frozenset()
            if parts & READS_HISTORY:  # the drafts too: a later position counts those before it
                program._write_history(batch)
            if isinstance(batch, PackedBatch):
                if batch.input_ids.numel() == 0:  # all padding: nothing ran (nor drafted: next_input -1 too)
                    empty = torch.full((rows, columns), -1, dtype=torch.int32)
                    return self._with_logprobs(empty, None, None, sample_logprobs, prompt_logprobs, length)
                starts = np.cumsum(lens) - lens
                hidden = program.model.hidden_states(batch, program.kv_cache)  # [N, hidden]
                picked = hidden[torch.from_numpy(np.where(lens[:, None] > 0, starts[:, None] + at, 0)).to(dev)]
            else:
                hidden = program.model.hidden_states(batch, program.kv_cache)  # [B, L, hidden]
                picked = hidden[torch.arange(rows, device=dev).unsqueeze(1), torch.from_numpy(at).to(dev)]
            logits = raw = program.model.logits_of(picked)  # [B, W, vocab]; raw: what logprobs are of
            prompt_block = None
            if prompt_logprobs is not None:  # every token's logits (packed [N, vocab], or [B, L, vocab])
                every = program.model.logits_of(hidden)
                prompt_block = program._prompt_block(raw, every, query_lens, prompt_logprobs, prompt_targets)
            if processed is not None:
                first_pos = pos.numpy()[np.arange(rows), np.minimum(first, length - 1)].astype(np.int64)  # [B]
                logits = self._process(logits, processed, parts, slot_ids, first_pos, lens, output_index)
            if token_bitmask is not None:  # int32 [B, W, words]: row c constrains the token sampled at position c
                flat = apply_token_bitmask(logits.reshape(rows * width, -1), token_bitmask.reshape(rows * width, -1))
                logits = flat.reshape(rows, width, -1)
            sampling = dict(
                temperature=temperature.to(dev),
                top_k=top_k.to(dev),
                top_p=top_p.to(dev),
                seeds=seeds.to(dev),
            )
            greedy = bool((temperature <= 0).all())
            drafter = self.drafter
            # q of the drafts being verified, read before this step's drafting overwrites it.
            q = None if drafter is None or greedy else drafter.draft_probs(slot_ids, width)
            out = rejection_sample(
                logits,
                torch.from_numpy(draft_ids).to(dev),
                output_index=output_index.to(dev),
                min_p=processed["min_p"] if "min_p" in parts else None,
                draft_probs=q,
                **sampling,
            )
            out = out.masked_fill(torch.from_numpy(lens == 0).to(dev).unsqueeze(1), -1).to(torch.int32)
            host_out = out.cpu().numpy().astype(np.int64)  # eager program: the tokens are computed values
            accepted = np.maximum((host_out >= 0).sum(axis=1) - 1, 0)  # [B] a
            # The slot's KV is valid up to the run's new token, which the next row computes on first.
            chunk_lens = np.where(lens > 0, lens - drafted + accepted, 0)  # [B] prompt chunk, or x0 + accepted drafts
            start = pos.numpy()[:, 0].astype(np.int64)  # [B] the row's first position
            real = lens > 0
            self.slot_len[slot_ids.numpy()[real]] = (start + chunk_lens)[real]
            if drafter is not None:
                drafts = self._draft(
                    drafter, host_out, accepted, chunk_lens, start, host_ids, lens, slot_ids, output_index, sampling
                )
                out = torch.cat([out, drafts.to(out.device)], 1)
            return self._with_logprobs(out, raw, prompt_block, sample_logprobs, prompt_logprobs, length)

    def _with_logprobs(
        self,
        out: torch.Tensor,
        raw: torch.Tensor | None,
        prompt_block: torch.Tensor | None,
        sample_logprobs: torch.Tensor | None,
        prompt_logprobs: torch.Tensor | None,
        length: int,
    ) -> torch.Tensor:
        """`out` int32 `[B, columns]` (its first W columns the emitted tokens, -1 past each run), then,
        when asked, the logprobs' bits: per verified position the logprobs of the token emitted there
        from `raw` `[B, W, vocab]`, then `prompt_block` `[B, L * w]`. raw None: an all-padding step,
        whose blocks are zeros (never read)."""
        if sample_logprobs is None and prompt_logprobs is None:
            return out
        rows, width = out.shape[0], self.width
        blocks = []
        if sample_logprobs is not None:
            top = int(sample_logprobs[0])  # a host value: no device sync
            if raw is None:
                blocks.append(torch.zeros(rows, width * block_width(top)))
            else:
                # Hazard: misplaced logprobs. Block c is the logprobs at position c of the token emitted
                # there (-1 past the run: 0, unread), never a rejected draft's.
                emitted = out[:, :width].long().clamp(min=0).reshape(-1).to(raw.device)  # [B*W]
                lp = position_logprobs(raw.reshape(rows * width, -1), emitted, top)  # [B*W, w]
                blocks.append(lp.reshape(rows, -1))
        if prompt_logprobs is not None:
            top = int(prompt_logprobs[0])
            blocks.append(torch.zeros(rows, length * block_width(top)) if prompt_block is None else prompt_block)
        return pack_output(out, blocks)

    def _fed(
        self,
        drafted_input: torch.Tensor,
        ids: torch.Tensor,
        pos: torch.Tensor,
        lens: np.ndarray,
        drafted: np.ndarray,
        slot_ids: torch.Tensor,
        output_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray, torch.Tensor]:
        """The inputs of rows fed from the previous call's `next_input` (every real row): ids, positions,
        lengths and drafts from the device's values, output indices moved to the device's positions."""
        width = self.width
        rows, length = ids.shape
        future = drafted_input.cpu().numpy().astype(np.int64)  # eager program: a computed value
        # The previous call's output: tokens, next_input, then logprobs' bits when it had them (unread here).
        if future.shape[0] != rows or future.shape[1] < 2 * width:
            raise ValueError(f"drafted_input {future.shape} must be [{rows}, >= {2 * width}]: the previous output")
        # Hazard: a draft as input (the production runner's garbage tokens at the spec -> non-spec switch).
        # Column 0 is each row's last accepted token, the drafts follow it: a row with no drafts (SpecExit)
        # reads column 0 alone, never column k (the last draft) nor the tokens' -1 (NextInputInv).
        next_input = future[:, width : 2 * width]  # [B, W]
        real = lens > 0
        if (next_input[real, 0] < 0).any():
            raise ValueError(f"drafted_input: a fed row has no last accepted token ({next_input[:, 0].tolist()})")
        proposed = np.cumprod(next_input[:, 1:] >= 0, axis=1).sum(axis=1)  # [B] drafts the previous call made
        drafted = np.where(real, np.minimum(drafted, proposed), 0)
        lens = np.where(real, 1 + drafted, 0)
        if lens.max(initial=0) > length:
            raise ValueError(f"drafted_input: rows of {lens.tolist()} tokens in input_ids of {length}")
        cols = np.arange(length)[None, :]  # [1, L]
        fed_ids = np.zeros((rows, length), dtype=np.int64)
        span = min(width, length)
        fed_ids[:, :span] = np.where(cols[:, :span] < lens[:, None], next_input[:, :span], 0)
        # Hazard: optimistic positions. The host's assume every draft in flight accepted; the slot's
        # device count is the truth, and the output index moves with the position.
        start = np.where(real, self.slot_len[slot_ids.numpy()].astype(np.int64), 0)  # [B]
        host_start = pos.numpy()[:, 0].astype(np.int64)
        index = output_index.numpy().astype(np.int64) + np.where(real, start - host_start, 0)
        fed_pos = np.where(cols < lens[:, None], start[:, None] + cols, 0)
        return (
            torch.from_numpy(fed_ids.astype(np.int32)),
            torch.from_numpy(fed_pos.astype(np.int32)),
            lens,
            drafted,
            torch.from_numpy(index),
        )

    def _process(
        self,
        logits: torch.Tensor,
        processed: dict[str, torch.Tensor],
        parts: frozenset[str],
        slot_ids: torch.Tensor,
        first_pos: np.ndarray,
        lens: np.ndarray,
        output_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[B, W, vocab]` after min_tokens, logit_bias and the penalties, each verified position
        processed as the ordinary step processes the one it samples: position c of a row (its last
        accepted token, then drafts) counts the row's tokens up to c, its c drafts included, and its
        output index is output_index + c. first_pos `[B]`: the position of each row's first verified
        token; lens `[B]`: its real tokens (0: a padding row, which counts nothing)."""
        program, width = self.program, self.width
        rows, _, vocab = logits.shape
        dev = program.device
        cols = np.arange(width)[None, :]
        counts = np.where(lens[:, None] > 0, first_pos[:, None] + 1 + cols, 0).reshape(-1)  # [B*W]
        counts = np.minimum(counts, program.spec.max_model_len)  # columns past a row's drafts are unread
        slots = torch.from_numpy(slot_ids.numpy().astype(np.int64)).repeat_interleave(width).to(dev)  # [B*W]
        history = program.history.rows(slots, max(int(counts.max()), 1))  # [B*W, T]
        index = (output_index.long().unsqueeze(1) + torch.arange(width)).reshape(-1).to(dev)  # [B*W]
        expanded = {name: value.repeat_interleave(width, dim=0) for name, value in processed.items()}
        flat = process_logits(
            logits.reshape(rows * width, vocab), expanded, history, torch.from_numpy(counts).to(dev), index, parts
        )
        return flat.reshape(rows, width, vocab)

    def _draft(
        self,
        drafter: Drafter,
        host_out: np.ndarray,
        accepted: np.ndarray,
        chunk_lens: np.ndarray,
        start: np.ndarray,
        host_ids: np.ndarray,
        lens: np.ndarray,
        slot_ids: torch.Tensor,
        output_index: torch.Tensor,
        sampling: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """next_input int32 `[B, W]`: the drafter over each row's accepted tokens, then its drafts.
        host_out `[B, W]`: the rows' runs; accepted, chunk_lens, start `[B]`: as `__call__` has them."""
        rows, width = host_out.shape
        last = torch.from_numpy(host_out[np.arange(rows), accepted])  # [B] the run's last token
        room = self.program.spec.max_model_len - (start + chunk_lens)  # positions left from the new token's
        counts = np.where(lens > 0, np.clip(room, 0, width - 1), 0)  # [B] drafts per row
        drafts = drafter.draft(
            chunks=host_ids,
            chunk_lens=chunk_lens,
            start=start,
            slots=slot_ids.numpy().astype(np.int64),
            last=last,
            counts=counts,
            first_index=output_index.long() + torch.from_numpy(accepted) + 1,
            **sampling,
        )
        next_input = torch.cat([last.masked_fill(torch.from_numpy(lens == 0), -1).unsqueeze(1), drafts], 1)
        return next_input.to(torch.int32)
