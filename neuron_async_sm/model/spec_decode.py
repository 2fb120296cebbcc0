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
from neuron_async_sm.model.logits_processors import PARTS, READS_HISTORY, parts_used, process_logits
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
    accepted = leading(accept).unsqueeze(1)  # [B, 1] a
    col = torch.arange(width, device=draft.device).unsqueeze(0)  # [1, W]
    return torch.where(col < accepted, draft, torch.where(col == accepted, last, -1))


def leading(mask: torch.Tensor) -> torch.Tensor:
    """int64 `[B]`: the True values before each row's first False in `mask` bool `[B, W]`. A min, not
    a cumprod: XLA runs an integer cumprod on the host (a read-back in the middle of the step)."""
    col = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)  # [1, W]
    return torch.where(mask, mask.shape[1], col).amin(dim=1)


class SpecStepProgram:
    """The step program with verification: the target's forward, then `rejection_sample`; `[B, W]` int32.

    Inputs: the step program's nine (`model/inputs.py`; input_ids `[B, L]` on the host: the drafts
    come from the host, n-gram) and num_drafts int32 `[B]`, the last num_drafts real tokens of each row
    being drafts. output_index is the output index of the token after each row's first verified
    token (x0 for a spec row, the last token otherwise). Eager, or on XLA one graph per input shape
    (no value is read back in a call); not under torch.compile (config: enforce_eager).

    With a `drafter` (draft_model) the output is `[B, 2W]`: the `[B, W]` tokens, then `next_input`
    `[B, W]`, the row's last accepted token and the k drafts the drafter proposed after it (-1 past
    them: none for a row without tokens, fewer where they would pass max_model_len).

    `drafted_input` (optional, draft_model): the previous call's output `[B, 2W + ...]` (a future, the same
    rows in the same order, or in another order given by `drafted_rows` int `[B]`, per row the
    previous output's row it reads). Every real row then computes on its `next_input`: the last
    accepted token and its first num_drafts drafts (fewer where the drafter proposed fewer), at the
    device's positions; the host's input_ids and positions of those rows are placeholders.

    With logprobs asked (`sample_logprobs`, `prompt_logprobs` with `prompt_targets`, host inputs as
    the step program takes them) they follow those columns, the whole output then float32 (the tokens
    exact integers, `model/logprobs.py`): W blocks per row, then L prompt blocks per row
    (`LogprobsLayout` with `sampled` = W).

    `token_bitmask` (structured output, n-gram): int32 `[B, W, words]`, row c of a row from its grammar
    after its first c drafts (the scheduler's, cut to the grammar-valid prefix): the mask of position
    c, applied after logits processing as the step program applies its own.
    """

    def __init__(self, program: StepProgram, width: int, drafter: Drafter | None = None) -> None:
        self.program = program
        self.width = width  # W = 1 + k
        self.drafter = drafter
        # [slots] int64 tokens of each KV slot whose KV is valid, as this program computed them (the
        # device's count, program state like the KV cache; the same on every TP rank, which run the
        # same calls on the same inputs).
        self.slot_len = torch.zeros(program.scratch_slot + 1, dtype=torch.int64, device=program.device)

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
        host_lens = query_lens.numpy().astype(np.int64)  # [B]
        host_drafted = num_drafts.numpy().astype(np.int64)  # [B]
        if (
            (host_drafted < 0).any()
            or (host_drafted >= np.maximum(host_lens, 1)).any()
            or host_drafted.max(initial=0) >= width
        ):
            raise ValueError(f"num_drafts {host_drafted.tolist()} must lie in [0, min(query_len, {width}))")
        dev = program.device
        # Every per-row value below is a tensor on the device: on a lazy device (XLA) a fed row's
        # lengths and positions are values of the previous call, and reading one back would block
        # the step (and make its shape a per-step value). One graph per input shape.
        lens = torch.from_numpy(host_lens).to(dev)  # [B]
        drafted = torch.from_numpy(host_drafted).to(dev)  # [B]
        with program._no_autograd():
            if drafted_input is not None:  # SpecSteady / SpecExit: the previous call's next_input, on the device
                if drafted_rows is not None:  # ReorderRemap on a non-output rank: the rows permuted here
                    drafted_input = drafted_input.index_select(0, drafted_rows.to(drafted_input.device, torch.int64))
                ids, pos, lens, drafted, output_index = self._fed(
                    drafted_input, ids, pos, lens, drafted, slot_ids, output_index
                )
                batch = program.batch_of(ids, pos, lens, slot_ids)
            else:
                batch = program._prepare(ids, pos, query_lens, slot_ids)
                ids, pos = ids.to(dev).long(), pos.to(dev).long()
            first = (lens - 1 - drafted).clamp(min=0)  # [B] column of the first verified token
            span = torch.arange(width, device=dev).unsqueeze(0)  # [1, W]
            cols = first.unsqueeze(1) + span  # [B, W]
            real = span < drafted.unsqueeze(1)  # [B, W] a draft follows column c
            draft_ids = torch.where(real, ids.gather(1, (cols + 1).clamp(max=length - 1)), -1)  # [B, W]
            # [B, W] the position each verified token's logits come from (past a row's end: its last)
            at = torch.minimum(cols, (lens - 1).clamp(min=0).unsqueeze(1))
            columns = width * (1 if self.drafter is None else 2)  # the tokens (draft_model: then next_input)
            processed = program._processing_inputs(processing)
            # The parts some row uses (host values) on an eager device; all of them on a compiling one,
            # one graph whatever the rows ask for (neutral for the others), as the step program does.
            parts = frozenset() if processed is None else parts_used(processing) if program.packed else PARTS
            if parts & READS_HISTORY:  # the drafts too: a later position counts those before it
                program._write_history(batch)
            if isinstance(batch, PackedBatch):
                if batch.input_ids.numel() == 0:  # all padding: nothing ran (nor drafted: next_input -1 too)
                    empty = torch.full((rows, columns), -1, dtype=torch.int32)
                    return self._with_logprobs(empty, None, None, sample_logprobs, prompt_logprobs, length)
                starts = torch.cumsum(lens, 0) - lens
                hidden = program.model.hidden_states(batch, program.kv_cache)  # [N, hidden]
                picked = hidden[torch.where(lens.unsqueeze(1) > 0, starts.unsqueeze(1) + at, 0)]
            else:
                hidden = program.model.hidden_states(batch, program.kv_cache)  # [B, L, hidden]
                picked = hidden[torch.arange(rows, device=dev).unsqueeze(1), at]
            logits = raw = program.model.logits_of(picked)  # [B, W, vocab]; raw: what logprobs are of
            prompt_block = None
            if prompt_logprobs is not None:  # every token's logits (packed [N, vocab], or [B, L, vocab])
                every = program.model.logits_of(hidden)
                prompt_block = program._prompt_block(raw, every, query_lens, prompt_logprobs, prompt_targets)
            if processed is not None:
                first_pos = pos.gather(1, first.clamp(max=length - 1).unsqueeze(1)).squeeze(1)  # [B]
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
            # The all-greedy shortcuts are host-only (a host value; elsewhere both paths, one graph).
            greedy = dev.type == "cpu" and bool((temperature <= 0).all())
            drafter = self.drafter
            # q of the drafts being verified, read before this step's drafting overwrites it.
            q = None if drafter is None or greedy else drafter.draft_probs(slot_ids, width)
            out = rejection_sample(
                logits,
                draft_ids,
                output_index=output_index.to(dev),
                min_p=processed["min_p"] if "min_p" in parts else None,
                draft_probs=q,
                **sampling,
            )
            out = out.masked_fill((lens == 0).unsqueeze(1), -1).to(torch.int32)
            accepted = ((out >= 0).sum(dim=1) - 1).clamp(min=0)  # [B] a
            # The slot's KV is valid up to the run's new token, which the next row computes on first.
            chunk_lens = torch.where(lens > 0, lens - drafted + accepted, 0)  # [B] a chunk, or x0 + accepted
            start = pos[:, 0]  # [B] the row's first position
            # Hazard: stale positions. A padding row may name a real slot; its write goes to the scratch
            # slot, never over that slot's count (the next fed row of the slot starts there).
            slots = torch.where(lens > 0, slot_ids.to(dev).long(), program.scratch_slot)
            self.slot_len[slots] = start + chunk_lens
            if drafter is not None:
                drafts = self._draft(
                    drafter, out, accepted, chunk_lens, start, ids, lens, slot_ids, output_index, greedy, sampling
                )
                out = torch.cat([out, drafts], 1)
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
        when asked, the logprobs (the whole then float32): per verified position the logprobs of the token emitted there
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
        lens: torch.Tensor,
        drafted: torch.Tensor,
        slot_ids: torch.Tensor,
        output_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of rows fed from the previous call's `next_input` (every real row), on the device:
        ids, positions, lengths and drafts from the device's values, output indices moved to the
        device's positions. Nothing is read back (on a lazy device that would block the step)."""
        width, dev = self.width, self.program.device
        rows, length = ids.shape
        # The previous call's output: tokens, next_input, then logprobs when it had them (unread here).
        if drafted_input.shape[0] != rows or drafted_input.dim() != 2 or drafted_input.shape[1] < 2 * width:
            raise ValueError(
                f"drafted_input {tuple(drafted_input.shape)} must be [{rows}, >= {2 * width}]: the previous output"
            )
        # Hazard: a draft as input (the production runner's garbage tokens at the spec -> non-spec switch).
        # Column 0 is each row's last accepted token, the drafts follow it: a row with no drafts (SpecExit)
        # reads column 0 alone, never column k (the last draft) nor the tokens' -1 (NextInputInv).
        next_input = drafted_input.to(dev)[:, width : 2 * width].long()  # [B, W]
        real = lens > 0
        if dev.type == "cpu" and bool((next_input[real, 0] < 0).any()):  # a host check costs no sync
            raise ValueError(f"drafted_input: a fed row has no last accepted token ({next_input[:, 0].tolist()})")
        proposed = leading(next_input[:, 1:] >= 0)  # [B] drafts the previous call made
        drafted = torch.where(real, torch.minimum(drafted, proposed), 0)
        lens = torch.where(real, 1 + drafted, 0)
        cols = torch.arange(length, device=dev).unsqueeze(0)  # [1, L]
        span = min(width, length)  # a row has at most 1 + num_drafts <= its host length <= L tokens
        padded = torch.cat([next_input[:, :span], next_input.new_zeros(rows, length - span)], 1)  # [B, L]
        fed_ids = torch.where(cols < lens.unsqueeze(1), padded, 0)
        # Hazard: optimistic positions. The host's assume every draft in flight accepted; the slot's
        # device count is the truth, and the output index moves with the position.
        start = torch.where(real, self.slot_len[slot_ids.to(dev).long()], 0)  # [B]
        host_start = pos[:, 0].to(dev).long()
        index = output_index.to(dev).long() + torch.where(real, start - host_start, 0)
        fed_pos = torch.where(cols < lens.unsqueeze(1), start.unsqueeze(1) + cols, 0)
        return fed_ids, fed_pos, lens, drafted, index

    def _process(
        self,
        logits: torch.Tensor,
        processed: dict[str, torch.Tensor],
        parts: frozenset[str],
        slot_ids: torch.Tensor,
        first_pos: torch.Tensor,
        lens: torch.Tensor,
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
        cols = torch.arange(width, device=dev).unsqueeze(0)  # [1, W]
        counts = torch.where(lens.unsqueeze(1) > 0, first_pos.unsqueeze(1) + 1 + cols, 0).reshape(-1)  # [B*W]
        counts = counts.clamp(max=program.spec.max_model_len)  # columns past a row's drafts are unread
        slots = torch.from_numpy(slot_ids.numpy().astype(np.int64)).repeat_interleave(width).to(dev)  # [B*W]
        # The history's width: the step's longest count on the host (a computed value there); the whole
        # history on a compiling device, where the width would be a per-step value (a graph each).
        length = max(int(counts.max()), 1) if program.packed else program.spec.max_model_len
        history = program.history.rows(slots, length)  # [B*W, T]
        index = (output_index.to(dev).long().unsqueeze(1) + torch.arange(width, device=dev)).reshape(-1)  # [B*W]
        expanded = {name: value.repeat_interleave(width, dim=0) for name, value in processed.items()}
        flat = process_logits(logits.reshape(rows * width, vocab), expanded, history, counts, index, parts)
        return flat.reshape(rows, width, vocab)

    def _draft(
        self,
        drafter: Drafter,
        out: torch.Tensor,
        accepted: torch.Tensor,
        chunk_lens: torch.Tensor,
        start: torch.Tensor,
        ids: torch.Tensor,
        lens: torch.Tensor,
        slot_ids: torch.Tensor,
        output_index: torch.Tensor,
        greedy: bool,
        sampling: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """next_input int32 `[B, W]`: the drafter over each row's accepted tokens, then its drafts.
        out `[B, W]`: the rows' runs; ids `[B, L]`: the rows' tokens; accepted, chunk_lens, start, lens
        `[B]`: as `__call__` has them, on the device. greedy: every row greedy (a host fact)."""
        width, dev = self.width, self.program.device
        last = out.gather(1, accepted.unsqueeze(1)).squeeze(1).long()  # [B] the run's last token
        room = self.program.spec.max_model_len - (start + chunk_lens)  # positions left from the new token's
        counts = torch.where(lens > 0, room.clamp(0, width - 1), 0)  # [B] drafts per row
        drafts = drafter.draft(
            chunks=ids,
            chunk_lens=chunk_lens,
            start=start,
            slots=slot_ids.to(dev).long(),
            last=last,
            counts=counts,
            first_index=output_index.to(dev).long() + accepted + 1,
            greedy=greedy,
            **sampling,
        )
        next_input = torch.cat([last.masked_fill(lens == 0, -1).unsqueeze(1), drafts], 1)
        return next_input.to(torch.int32)
