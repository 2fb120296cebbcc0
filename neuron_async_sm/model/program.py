"""StepProgram: the device's compiled program. One call = one forward over the KV cache + sampling."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from neuron_async_sm.model.config import LlamaConfig, load_model_config
from neuron_async_sm.model.grammar_mask import apply_token_bitmask
from neuron_async_sm.model.inputs import FORWARD_INPUT_NAMES, INPUTS, SamplingInputs, padding_inputs
from neuron_async_sm.model.kv_cache import KVCache
from neuron_async_sm.model.llama import ForwardBatch, LlamaModel
from neuron_async_sm.model.loader import load_weights
from neuron_async_sm.model.logits_processors import (
    PARTS,
    PROCESSING,
    READS_HISTORY,
    TokenHistory,
    parts_used,
    process_logits,
    tokens_so_far,
)
from neuron_async_sm.model.logprobs import block_width, pack_output, position_logprobs
from neuron_async_sm.model.packed import PackedBatch, pack_step
from neuron_async_sm.model.sampler import sample_tokens
from neuron_async_sm.model.spec import ModelSpec

HOST = torch.device("cpu")

logger = logging.getLogger("neuron_async_sm")


class StepProgram:
    """A loaded Llama plus its static KV cache; each call runs one step for a batch of rows.

    Row b holds query_lens[b] real tokens (a decode token, or a prefill chunk padded to the
    bucket length L) for KV slot slot_ids[b]. The call writes the real tokens' K/V at
    cache[slot, position], attends each token to its slot's positions 0..its own position, and samples
    one token from the logits of the row's last real token. Padding rows (query_lens 0, slot
    `scratch_slot`) return token 0. The cache persists across calls: it is the program's device state.

    A malformed step raises ValueError before touching the cache: shapes that disagree, two live rows
    on one slot, a real token id outside the vocab (so a leaked placeholder such as -1 is caught, not
    embedded), or a position outside max_model_len.

    Placement: weights and cache live on `device`. Host inputs arrive as host tensors and are checked
    there, then moved; input_ids may instead be a device tensor (the previous step's sampled tokens,
    in the vocab by construction), which is never read back: on a lazy device a check on a device
    value is a blocking sync. The relay (optional `relay_tokens` and `relay_rows`) builds input ids on
    the device instead: row b whose `relay_rows[b] >= 0` computes on the previous step's sampled
    token `relay_tokens[relay_rows[b]]` (a future), every other row on its host ids.
    On a compiled-graph device (XLA) every shape is part of the program, so
    attention reads the whole cache (`fixed_context`) instead of the step's longest prefix; the mask
    makes the extra positions contribute nothing.

    Compiled (`compile`): the forward runs as torch.compile graphs built at start-up and reused for
    every step: one per decode bucket (static shapes) and, per prefill length, one for a single row
    and one whose row count is symbolic (rows 2..max_num_seqs would otherwise be as many graphs). A
    shape first seen while serving compiles then, and counts in the runtime's `compilations`.
    Checks, padding, the relay and sampling stay eager.
    """

    def __init__(
        self, spec: ModelSpec, config: LlamaConfig, model: LlamaModel, kv_cache: KVCache, device: torch.device = HOST
    ):
        self.spec = spec
        self.config = config
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # Device state beside the KV cache: each slot's token ids, for the penalties (logits_processors.py).
        self.history = TokenHistory(kv_cache.scratch_slot + 1, spec.max_model_len, device)
        self.fixed_context = device.type == "xla"
        # Eager programs run the step's real tokens only (model/packed.py); a compiled one (XLA, or
        # `compile`) runs the padded shape it was compiled for.
        self.packed = not self.fixed_context
        self._compiled = None  # torch.compile of `_traced_forward` once `compile` ran; None: eager
        self.compile_report: tuple[tuple[str, float], ...] = ()  # (shape label, seconds) per compiled shape

    @property
    def scratch_slot(self) -> int:
        """Slot index padding rows must use; equals spec.max_num_seqs."""
        return self.kv_cache.scratch_slot

    def __call__(
        self,
        *,
        sample_logprobs: torch.Tensor | None = None,
        token_bitmask: torch.Tensor | None = None,
        **inputs: torch.Tensor,
    ) -> torch.Tensor:
        """Sampled token ids, int32 `[B]`; with logprobs asked, float32 `[B, 1 + width]`, the tokens in
        column 0 (`model/logprobs.py`). The forward (`forward_logits`, which takes every input but
        these and the five `SamplingInputs`) then the sampling (`sample`), the two halves a step whose
        mask waited runs as two programs.

        The nine step inputs are declared in `model/inputs.py` (`STEP_INPUTS`: dtypes, shapes,
        padding). sample_logprobs (a host input, int32 `[1]`): the top tokens per sampled token.
        token_bitmask: int32 `[B, ceil(V/32)]`, the grammars' masks (`model/grammar_mask.py`); absent
        when no row samples under a grammar.
        """
        sampling = SamplingInputs.take(inputs)  # what is left is the forward's
        with self._no_autograd():
            logits = self.forward_logits(**inputs)
            return self.sample(
                logits,
                positions=inputs["positions"],
                query_lens=inputs["query_lens"],
                slot_ids=inputs["slot_ids"],
                sample_logprobs=sample_logprobs,
                prompt_logprobs=inputs.get("prompt_logprobs"),
                token_bitmask=token_bitmask,
                **sampling._asdict(),
                **{name: value for name, value in inputs.items() if name in PROCESSING},
            )

    def forward_logits(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        relay_tokens: torch.Tensor | None = None,
        relay_rows: torch.Tensor | None = None,
        prompt_logprobs: torch.Tensor | None = None,
        prompt_targets: torch.Tensor | None = None,
        **processing: torch.Tensor,
    ) -> torch.Tensor:
        """The step's forward (the KV writes, and the token history's with `processing`) without
        sampling: logits `[B, vocab]` (host sampling, tests, and a step whose sampling is deferred).

        relay_tokens: integer `[P]`, the previous step's sampled tokens (a future); relay_rows: int32
        `[B]`, a row of relay_tokens or -1. A future fed as input_ids or relay_tokens may be a packed
        output `[P, 1 + width]`: its column 0 is the tokens. prompt_logprobs (a host input, int32
        `[1]`): the top tokens per prompt position, with prompt_targets int32 `[B, L]`, the prompt
        token after each position (what its logprob is of; 0 where the row has none); the prompt
        positions' logprob blocks then follow each row's logits: `[B, vocab + L * w]`, in the logits'
        dtype (float32 values, exact in either), so a deferred step's sampling program gets them with
        the logits, as one future.
        `processing`: the logits-processing inputs (`model/logits_processors.py`), all or none; a
        step with them writes its input ids into the token history, and its sampling processes the
        logits (the logprobs are of the logits before it, vLLM's raw logprobs)."""
        if positions.dim() == 1 and input_ids.dim() == 2:  # a decode step fed a packed output
            input_ids = input_ids[:, 0]
        if relay_tokens is not None and relay_tokens.dim() == 2:
            relay_tokens = relay_tokens[:, 0]
        with self._no_autograd():
            batch = self._prepare(input_ids, positions, query_lens, slot_ids, relay_tokens, relay_rows)
            processed = self._processing_inputs(processing)
            parts = parts_used(processing) if processed is not None and self.packed else PARTS
            if processed is not None and parts & READS_HISTORY:
                # After _prepare: the ids are final (a future's token relayed in; under TP, the
                # output rank's, broadcast), so the in-flight token is counted and ranks agree. A
                # request reading it is in every step that computes its tokens: its history is whole.
                self._write_history(batch)
            if prompt_logprobs is None:
                return self._forward(batch)  # [B, vocab]
            logits, every = self.model.forward_every_token(batch, self.kv_cache)
            block = self._prompt_block(logits, every, query_lens, prompt_logprobs, prompt_targets)
            return torch.cat([logits, block.to(logits.dtype)], dim=1)

    def sample(
        self,
        logits: torch.Tensor,
        *,
        positions: torch.Tensor,
        query_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        sample_logprobs: torch.Tensor | None = None,
        prompt_logprobs: torch.Tensor | None = None,
        token_bitmask: torch.Tensor | None = None,
        **inputs: torch.Tensor,
    ) -> torch.Tensor:
        """Token ids int32 `[B]` (with logprobs asked, the packed `[B, 1 + width]`) from the forward's
        output: processing, the grammar mask, sampling. Alone (the `model_sample` program) when a
        grammar's mask waited for the previous step. `inputs`: the five `SamplingInputs`, and the
        processing inputs when the step has them."""
        sampling = SamplingInputs.take(inputs)
        processing = inputs
        dev = self.device
        with self._no_autograd():
            logits, sampling = logits.to(dev), sampling.to(dev)
            prompt_block = None
            if prompt_logprobs is not None:  # the forward put the prompt blocks after the logits
                vocab = self.config.vocab_size
                logits, prompt_block = logits[:, :vocab], logits[:, vocab:].float()
            raw = logits  # what logprobs are taken from (vLLM's raw_logprobs): before any processing
            processed = self._processing_inputs(processing)
            # A host program runs the parts some row uses; a compiled one all (one program).
            parts = parts_used(processing) if processed is not None and self.packed else PARTS
            if processed is not None:
                num_computed = tokens_so_far(positions.numpy(), query_lens.numpy())  # [B]
                length = self.spec.max_model_len if self.fixed_context else max(int(num_computed.max()), 1)
                logits = process_logits(
                    logits,
                    processed,
                    self.history.rows(torch.from_numpy(slot_ids.numpy().astype(np.int64)).to(dev), length),
                    torch.from_numpy(num_computed).to(dev),
                    sampling.output_index,
                    parts,
                )
            if token_bitmask is not None:
                logits = apply_token_bitmask(logits, token_bitmask)
            tokens = sample_tokens(
                logits,
                **sampling._asdict(),
                min_p=None if processed is None or "min_p" not in parts else processed["min_p"],
            )
            if not self.packed or query_lens.numpy().min() == 0:  # padding rows return token 0
                tokens = tokens.masked_fill(query_lens.to(dev) == 0, 0)
            if sample_logprobs is None and prompt_block is None:
                return tokens.to(torch.int32)
            blocks = [] if sample_logprobs is None else [position_logprobs(raw, tokens, int(sample_logprobs[0]))]
            if prompt_block is not None:
                blocks.append(prompt_block)
            return pack_output(tokens, blocks)

    def _prompt_block(
        self,
        logits: torch.Tensor,
        every: torch.Tensor,
        query_lens: torch.Tensor,
        prompt_logprobs: torch.Tensor,
        prompt_targets: torch.Tensor | None,
    ) -> torch.Tensor:
        """The prompt positions' logprob blocks, float32 `[B, L * w]` (`every`: logits `[B, L, vocab]`,
        or packed `[N, vocab]`, the real tokens row by row). The counts are host values: no device sync."""
        assert prompt_targets is not None, "prompt_logprobs come with their targets"
        top, (rows, length) = int(prompt_logprobs[0]), prompt_targets.shape
        targets = prompt_targets.to(self.device).long().reshape(-1)  # [B * L]
        if every.dim() == 3:  # padded: every position has logits
            block = position_logprobs(every.reshape(rows * length, -1), targets, top)
        else:  # packed: the real tokens' positions, row-major, are where their blocks go
            lens = query_lens.numpy().astype(np.int64)
            real = torch.from_numpy(np.flatnonzero(np.arange(length)[None, :] < lens[:, None])).to(self.device)
            block = logits.new_zeros(rows * length, block_width(top), dtype=torch.float32)
            block[real] = position_logprobs(every, targets[real], top)
        return block.reshape(rows, -1)

    def _processing_inputs(self, processing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The processing inputs on the device, or None when the step has none."""
        if not processing:
            return None
        if processing.keys() != PROCESSING.keys():
            raise ValueError(f"logits processing inputs: expected {sorted(PROCESSING)}, got {sorted(processing)}")
        return {name: value.to(self.device) for name, value in processing.items()}

    def _write_history(self, batch: ForwardBatch | PackedBatch) -> None:
        if isinstance(batch, PackedBatch):  # its write index has the history's layout (slot, position)
            self.history.write(batch.write_index, batch.input_ids)
        else:
            self.history.write(batch.write_slots * self.spec.max_model_len + batch.positions, batch.input_ids)

    def compile(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Compile the forward for each padded input_ids shape (`[B]` decode, `[B, L]` prefill) now.

        Each shape runs one all-padding call (query_lens 0: only the scratch slot is written), which
        compiles it unless a graph already covers it (a prefill of 3+ rows: the symbolic-rows graph).
        Logs each shape's time.
        """
        if self.device.type == "xla":
            raise ValueError("StepProgram.compile: an XLA device compiles its own graphs")
        # Every shape is one more entry in the one code object's cache; past dynamo's limit it would
        # silently fall back to eager. Several programs in one process (tests) share that cache.
        import torch._dynamo  # noqa: PLC0415 (only a compiled program pays its import)

        limit = 8 * len(shapes) + 64
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, limit)
        self.model.opaque_attention = True
        self.packed = False
        self._compiled = torch.compile(self._traced_forward, dynamic=False, fullgraph=True)
        report = []
        for shape in tqdm(shapes, desc="compiling step programs", unit="shape", disable=None):
            rows, started = shape[0], time.perf_counter()
            padding = padding_inputs(shape, self.scratch_slot)
            self.forward_logits(**{name: padding[name] for name in FORWARD_INPUT_NAMES})
            label = f"decode bucket {rows}" if len(shape) == 1 else f"prefill {rows} x {shape[1]}"
            report.append((label, time.perf_counter() - started))
            logger.info("compiled %s: %.1f s", *report[-1])
        self.compile_report = tuple(report)
        logger.info("compiled %d step program shapes in %.1f s", len(report), sum(s for _, s in report))

    def _forward(self, batch: ForwardBatch | PackedBatch) -> torch.Tensor:
        if self._compiled is None:  # eager (a compiled program never packs)
            return self.model.forward(batch, self.kv_cache)
        # Tensors only: an int (context_len) would be a guard, one program per value.
        inputs = (batch.input_ids, batch.positions, batch.write_slots, batch.slot_ids, batch.last_index)
        rows, length = batch.input_ids.shape
        if length > 1 and rows > 1:  # a prefill: its row count is symbolic (1 stays its own graph)
            for tensor in inputs:
                torch._dynamo.mark_dynamic(tensor, 0)
        return self._compiled(*inputs)

    def _traced_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        slot_ids: torch.Tensor,
        last_index: torch.Tensor,
    ) -> torch.Tensor:
        """The forward as torch.compile sees it; attention reads its own context (`cached_attention`)."""
        batch = ForwardBatch(input_ids, positions, write_slots, slot_ids, last_index, context_len=0)
        return self.model.forward(batch, self.kv_cache)

    def _no_autograd(self) -> torch.autograd.grad_mode.no_grad | torch.autograd.grad_mode.inference_mode:
        # XLA refuses inference tensors in the in-place KV cache writes ("Cannot set version_counter");
        # no_grad costs a little more bookkeeping on the host, so the host keeps inference_mode.
        return torch.inference_mode() if self.device.type == "cpu" else torch.no_grad()

    def _prepare(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        relay_tokens: torch.Tensor | None = None,
        relay_rows: torch.Tensor | None = None,
    ) -> ForwardBatch | PackedBatch:
        if input_ids.dim() == 1:
            input_ids, positions = input_ids.unsqueeze(1), positions.unsqueeze(1)
        b, length = input_ids.shape
        if positions.shape != input_ids.shape or query_lens.shape != (b,) or slot_ids.shape != (b,):
            raise ValueError(
                f"step inputs disagree in shape: input_ids {tuple(input_ids.shape)}, "
                f"positions {tuple(positions.shape)}, query_lens {tuple(query_lens.shape)}, "
                f"slot_ids {tuple(slot_ids.shape)}"
            )
        # The host values are checked and sanitized in numpy: a few small arrays, where each torch op
        # would cost its dispatch.
        lens, slots = query_lens.numpy().astype(np.int64), slot_ids.numpy().astype(np.int64)
        valid = np.arange(length)[None, :] < lens[:, None]  # [B, L]
        # Padding tokens get id 0 and position 0 whatever the caller left there, so garbage in the
        # padding can neither index out of range nor widen the attended cache prefix.
        on_host = input_ids.device.type == "cpu"
        relayed = self._relayed(relay_tokens, relay_rows, lens)  # [B] bool, or None
        # A relayed row's host id is a placeholder (POISON_TOKEN): the device supplies its token.
        host_valid = valid if relayed is None else valid & ~relayed[:, None]
        host_ids = np.where(host_valid, input_ids.numpy(), 0) if on_host else None
        pos = np.where(valid, positions.numpy(), 0).astype(np.int64)
        self._check(host_ids, pos, lens, slots, length)
        dev = self.device
        if on_host and self.packed:  # an eager host program: the ids are sanitized already
            assert host_ids is not None
            if relayed is not None:  # the relay (below) in numpy: an eager device's future is a computed value
                assert relay_tokens is not None and relay_rows is not None
                host_ids[relayed, 0] = relay_tokens.numpy()[relay_rows.numpy()[relayed]]
            ids = torch.from_numpy(host_ids.astype(np.int64))
        else:  # masked on the device, so a future input and a host input run one program
            ids = input_ids.to(dev).long().masked_fill(~torch.from_numpy(host_valid).to(dev), 0)
            if relayed is not None:
                assert relay_tokens is not None and relay_rows is not None
                # The relay: where(map >= 0, future[map], host ids), on the device. A relayed row is a
                # decode row, so its one token is column 0. Never read back (a blocking sync on a lazy device).
                gathered = relay_tokens.to(dev).long()[relay_rows.long().clamp(min=0).to(dev)]  # [B]
                ids[:, 0] = torch.where(torch.from_numpy(relayed).to(dev), gathered, ids[:, 0])
        if self.packed:
            return pack_step(ids, pos, lens, slots, dev, self.spec.max_model_len, self.model.compute_dtype)
        return ForwardBatch(
            input_ids=ids,
            positions=torch.from_numpy(pos).to(dev),
            write_slots=torch.from_numpy(np.where(valid, slots[:, None], self.scratch_slot)).to(dev),
            slot_ids=torch.from_numpy(slots).to(dev),
            last_index=torch.from_numpy(np.maximum(lens - 1, 0)).to(dev),
            context_len=self.spec.max_model_len if self.fixed_context else int(pos.max()) + 1,
        )

    def batch_of(
        self, input_ids: torch.Tensor, positions: torch.Tensor, query_lens: torch.Tensor, slot_ids: torch.Tensor
    ) -> ForwardBatch | PackedBatch:
        """A batch of rows computed on the device (`device_batch`'s inputs): an eager program packs them
        through `_prepare` and its checks (there a device value is a computed one: reading it costs
        nothing); a compiled one builds the padded batch on the device."""
        if self.packed:
            return self._prepare(input_ids.cpu(), positions.cpu(), query_lens.cpu(), slot_ids.cpu())
        return self.device_batch(input_ids, positions, query_lens, slot_ids)

    def device_batch(
        self, input_ids: torch.Tensor, positions: torch.Tensor, query_lens: torch.Tensor, slot_ids: torch.Tensor
    ) -> ForwardBatch:
        """The padded batch of rows whose ids, positions and lengths may be device values (a spec row fed
        from the previous call's `next_input`, the drafter's passes): sanitized as `_prepare` does, on the
        device, with no read-back. Nothing is checked: the caller derived the values from checked ones.
        input_ids, positions `[B, L]`; query_lens, slot_ids `[B]`."""
        dev = self.device
        lens, slots = query_lens.to(dev).long(), slot_ids.to(dev).long()
        valid = torch.arange(input_ids.shape[1], device=dev).unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
        pos = torch.where(valid, positions.to(dev).long(), 0)
        return ForwardBatch(
            input_ids=torch.where(valid, input_ids.to(dev).long(), 0),
            positions=pos,
            write_slots=torch.where(valid, slots.unsqueeze(1), self.scratch_slot),
            slot_ids=slots,
            last_index=(lens - 1).clamp(min=0),
            context_len=self.spec.max_model_len if self.fixed_context else int(pos.max()) + 1,
        )

    @staticmethod
    def _relayed(
        relay_tokens: torch.Tensor | None, relay_rows: torch.Tensor | None, lens: np.ndarray
    ) -> np.ndarray | None:
        """The rows whose input token comes from `relay_tokens` (bool `[B]`), checked on the host."""
        if relay_tokens is None and relay_rows is None:
            return None
        if relay_tokens is None or relay_rows is None:
            raise ValueError("relay_tokens and relay_rows come together")
        if relay_tokens.dim() != 1 or tuple(relay_rows.shape) != lens.shape:
            raise ValueError(
                f"relay inputs: relay_tokens {tuple(relay_tokens.shape)} must be 1-D and relay_rows "
                f"{tuple(relay_rows.shape)} one per row"
            )
        rows = relay_rows.numpy()
        if rows.size and (rows.min() < -1 or rows.max() >= relay_tokens.shape[0]):
            raise ValueError(f"relay_rows {rows.tolist()} must lie in [-1, {relay_tokens.shape[0]})")
        relayed = rows >= 0
        if (relayed & (lens != 1)).any():
            raise ValueError(f"relay_rows {rows.tolist()}: only a row of one token (a decode) is relayed")
        return relayed

    def _check(self, ids: np.ndarray | None, pos: np.ndarray, lens: np.ndarray, slots: np.ndarray, length: int) -> None:
        if lens.min() < 0 or lens.max() > length:
            raise ValueError(f"query_lens {lens.tolist()} must lie in [0, {length}]")
        if slots.min() < 0 or slots.max() > self.scratch_slot:
            raise ValueError(f"slot_ids {slots.tolist()} must lie in [0, {self.scratch_slot}]")
        real = slots[lens > 0].tolist()
        # Two live rows on one slot would race their K/V writes; padding rows with tokens would write
        # the scratch slot and then read it as context, which is meaningless.
        if len(set(real)) != len(real) or self.scratch_slot in real:
            raise ValueError(f"rows with tokens need distinct real slots, got slot_ids {slots.tolist()}")
        if ids is not None and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size})")
        if pos.min() < 0 or pos.max() >= self.spec.max_model_len:
            raise ValueError(f"positions must lie in [0, max_model_len={self.spec.max_model_len})")


class RelayPad:
    """The relay's padding program: a step's sampled tokens `[P]` -> `[width]` (rows P.. are 0).

    On a device that compiles per shape, the relay's step program takes the previous output as an
    input, so each (previous rows, input shape) pair would be its own program. Padded first, a relay
    program's shape is its input's alone; this program is compiled once per P (a handful, tiny).
    Rows keep their index, so a row map into `[P]` reads the same tokens from `[width]`.
    """

    def __init__(self, width: int, device: torch.device = HOST) -> None:
        self.width = width
        self.device = device

    def __call__(self, *, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        if tokens.dim() not in (1, 2) or rows > self.width:
            raise ValueError(f"relay_pad: tokens {tuple(tokens.shape)} must be 1-D with at most {self.width} rows")
        if tokens.dim() == 2:  # a packed output (float32): its tokens are column 0, as the ids' integers
            tokens = tokens[:, 0].to(INPUTS["input_ids"].dtype)
        tokens = tokens.to(self.device)
        return torch.cat([tokens, tokens.new_zeros(self.width - rows)])  # [width]


def build_step_program(spec: ModelSpec, device: torch.device = HOST) -> StepProgram:
    """Loads the config and weights named by `spec` and allocates its KV cache (zeros), on `device`;
    compiles the forward for `spec.compile_shapes` (none: eager)."""
    config = load_model_config(spec.model)
    if spec.max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"ModelSpec.max_model_len ({spec.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    weights = load_weights(spec.model, config, spec.torch_dtype, seed=spec.seed)
    if device.type != "cpu":
        weights = weights.to(device)
    model = LlamaModel(config, weights, spec.max_model_len, spec.torch_dtype)
    kv_cache = KVCache(config, spec.max_num_seqs, spec.max_model_len, spec.torch_dtype, device)
    program = StepProgram(spec, config, model, kv_cache, device)
    if spec.compile_shapes:
        program.compile(spec.compile_shapes)
    return program
