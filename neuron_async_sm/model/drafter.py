"""The draft model on the device (docs/spec-decode.md §2, §8): a second Llama with its own KV cache.

It runs inside the spec step program after verification. Per row: one chunk over the tokens the
target accepted this step (a prompt chunk, or the last accepted token and the accepted drafts) and
the row's new token t, whose logits give the first draft; then k - 1 one-token passes, each on the
draft before. Its KV cache has the target's layout (slot, position), so the drafter's KV past the
accepted tokens (drafts, or a partial prefill's sample) lies where the request's next row writes
first, and no query reaches it before then (the same argument as the target's rejected drafts).

With temperature a draft is sampled from q (the drafter's distribution after temperature, top-k and
top-p) with its own counter-based stream, and q is kept per (slot, draft) on the device: the next
step's verification accepts with min(1, p/q) and resamples from max(p - q, 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neuron_async_sm.config import ConfigError, SpeculativeConfig
from neuron_async_sm.model.config import TINY_LLAMA, LlamaConfig, load_model_config, model_directory
from neuron_async_sm.model.loader import checkpoint_path
from neuron_async_sm.model.parallel import TensorParallelGroup, check_divisible, shard_step_program
from neuron_async_sm.model.program import StepProgram, build_step_program
from neuron_async_sm.model.sampler import _filtered_out, uniform_noise
from neuron_async_sm.model.spec import ModelSpec

# The draft sample's stream: its key is output_index with this bit set (the acceptance draw's is bit 62,
# model/spec_decode.py), so the drafter's noise is independent of the target's for the same output.
DRAFT_STREAM = 1 << 61


def check_draft_model(spec: SpeculativeConfig, target: LlamaConfig, tensor_parallel_size: int) -> LlamaConfig:
    """The draft model's config; ConfigError naming `speculative_config.model` unless the checkpoint
    exists, shares the target's vocabulary and special ids (one tokenizer), and splits over the
    target's ranks. Its positions are checked against max_model_len where that is resolved
    (engine/model_len.py, which counts its KV cache in the budget)."""
    assert spec.model is not None
    try:
        draft = load_model_config(spec.model)
        if spec.model != TINY_LLAMA:
            checkpoint_path(model_directory(spec.model))
    except Exception as exc:  # ModelLoadError or a malformed config: named as the key's problem
        raise ConfigError(f"speculative_config.model: {exc}") from exc
    for name in ("vocab_size", "bos_token_id", "eos_token_ids"):
        mine, theirs = getattr(draft, name), getattr(target, name)
        if mine != theirs:
            raise ConfigError(
                f"speculative_config.model: the draft's {name} {mine!r} differs from the target's {theirs!r} "
                "(the draft must share the target's tokenizer)"
            )
    if tensor_parallel_size > 1 and (problem := check_divisible(draft, tensor_parallel_size)):
        raise ConfigError(
            f"speculative_config.model: the draft is split over the target's {tensor_parallel_size} ranks "
            f"(tensor_parallel_size), but {problem}"
        )
    return draft


def build_drafter(spec: ModelSpec, num_drafts: int, device: torch.device, group: TensorParallelGroup | None) -> Drafter:
    """The draft model's program for `spec` (its checkpoint, the target's slots and positions) on `device`.

    On a tensor-parallel rank (`group`, joined already by the target's program) the draft is split
    as the target is, over the same ranks, and its `logits_of` gathers the whole vocabulary: every
    rank runs the same drafter on the same gathered logits with the same counter-based noise, so
    every rank proposes the same drafts and keeps the same q.
    """
    if group is None:
        return Drafter(build_step_program(spec, device), num_drafts)
    return Drafter(shard_step_program(spec, group.rank, group.world_size, device), num_drafts)


class Drafter:
    """The draft model's program state: its StepProgram (weights and KV cache) and q per (slot, draft)."""

    def __init__(self, program: StepProgram, num_drafts: int) -> None:
        self.program = program
        self.k = num_drafts
        # q of each slot's drafts in flight, float64 [slots, k, vocab]; read by the next verification.
        # On the host allocated when a row first samples a draft (all-greedy serving never holds it);
        # on a compiling device at once (ones: a row never sampled reads ones, as below), so the
        # graph does not change when the first sampled row arrives.
        self.probs: torch.Tensor | None = None
        if program.device.type != "cpu":
            self.probs = self._new_probs(torch.ones)

    def _new_probs(self, fill: Callable[..., torch.Tensor]) -> torch.Tensor:
        shape = (self.program.scratch_slot + 1, self.k, self.program.config.vocab_size)
        return fill(shape, dtype=torch.float64, device=self.program.device)

    def draft_probs(self, slot_ids: torch.Tensor, width: int) -> torch.Tensor:
        """q at each verified position, `[B, width, vocab]`: column c is q of the draft after column c
        (ones where no draft was ever sampled: only greedy rows, which never read it)."""
        rows, vocab = slot_ids.shape[0], self.program.config.vocab_size
        if self.probs is None:
            return torch.ones(rows, width, vocab, dtype=torch.float64, device=self.program.device)
        probs = self.probs[slot_ids.long().to(self.probs.device)]  # [B, k, vocab]
        pad = probs.new_ones(rows, width - self.k, vocab)  # no draft after the last column
        return torch.cat([probs, pad], dim=1)

    def draft(
        self,
        *,
        chunks: torch.Tensor,
        chunk_lens: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        last: torch.Tensor,
        counts: torch.Tensor,
        greedy: bool,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seeds: torch.Tensor,
        first_index: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts int64 `[B, k]` (-1 past a row's `counts`), after writing the drafter's KV.

        chunks `[B, C]`: row b's accepted tokens this step (chunk_lens[b] of them, at positions
        start[b]..), to which `last` `[B]` (the row's new token) is appended; counts `[B]` drafts per
        row (0: the row only writes its chunk's KV; it must leave its positions below max_model_len).
        first_index `[B]`: the output index of the first draft. Sampling parameters per row, as the
        target's; greedy: every row is greedy (a host fact: q is then never kept). Every `[B]` value is
        a device tensor: on a compiling device the k passes always run (one graph per input shape);
        on the host a pass no row needs is skipped.
        """
        program, k = self.program, self.k
        dev = program.device
        eager = dev.type == "cpu"  # a host branch on a value costs nothing there
        rows, width = chunks.shape[0], chunks.shape[1] + 1
        drafting = counts > 0
        query = chunk_lens + drafting.long()  # [B] t is appended where the row drafts
        cols = torch.arange(width, device=dev).unsqueeze(0)  # [1, C + 1]
        ids = torch.cat([chunks.to(dev).long(), chunks.new_zeros(rows, 1).to(dev).long()], 1)  # [B, C + 1]
        ids = torch.where((cols == chunk_lens.unsqueeze(1)) & drafting.unsqueeze(1), last.unsqueeze(1), ids)
        positions = start.unsqueeze(1) + cols  # [B, C + 1]
        out = torch.full((rows, k), -1, dtype=torch.int64, device=dev)  # [B, k]
        for j in range(k):
            live = counts > j  # [B] rows that draft a j-th token
            if j:  # one token: the draft before, right after it
                query = live.long()
                ids = torch.where(live, out[:, j - 1], 0).unsqueeze(1)
                positions = torch.where(live, start + chunk_lens + j, 0).unsqueeze(1)
            if eager and not bool(query.any()):
                break
            batch = program.batch_of(ids, positions, query, torch.where(query > 0, slots, program.scratch_slot))
            logits = program.model.forward(batch, program.kv_cache)  # [B, vocab] at each row's last token
            if eager and not bool(live.any()):  # the chunks' KV only: no row drafts
                break
            index = first_index + j
            tokens = self._sample(logits, greedy, j, slots, live, temperature, top_k, top_p, seeds, index)
            out[:, j] = torch.where(live, tokens, -1)
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        greedy: bool,
        j: int,
        slots: torch.Tensor,
        live: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seeds: torch.Tensor,
        index: torch.Tensor,
    ) -> torch.Tensor:
        """Draft j per row: the argmax (greedy), else a sample from q, which is kept for verification."""
        argmax = logits.argmax(dim=-1)
        if greedy:  # q is one-hot on the argmax; verification compares with the target's argmax
            return argmax
        dev = logits.device
        temp = temperature.to(dev).double()
        is_greedy = temp <= 0
        vocab = logits.shape[-1]
        scaled = logits.double() / torch.where(is_greedy, 1.0, temp).unsqueeze(1)
        k_on, p_on = (top_k.to(dev) > 0) & (top_k.to(dev) < vocab), top_p.to(dev) < 1.0
        scaled = scaled.masked_fill(_filtered_out(scaled, top_k.to(dev), top_p.to(dev), k_on, p_on), float("-inf"))
        gumbel = -torch.log(-torch.log(uniform_noise(seeds.to(dev), index | DRAFT_STREAM, vocab)))
        tokens = torch.where(is_greedy, argmax, (scaled + gumbel).argmax(dim=-1))
        q = torch.softmax(scaled, dim=-1)
        if self.probs is None:
            self.probs = self._new_probs(torch.zeros)
        # Rows that draft no j-th token write the scratch slot's (never read for a real row).
        self.probs[torch.where(live, slots, self.program.scratch_slot), j] = q
        return tokens
