"""The warm-up calls of the engine's programs: one per input shape serving can produce.

A compiling device (XLA, Neuron) builds one program per input shape. Every shape the worker can
enqueue follows from the config alone (`input_batch.padded_input_shape`): `[decode bucket]` for an all-decode
step, `[rows, prefill bucket]` for any other, rows in 1..max_num_seqs. Each call here is all padding
(query_lens 0, the scratch slot), so running it writes only the scratch KV slot. With the relay on,
its programs take the previous output padded to one row count (`relay_width`), so they too are one
per input shape.

Sampling extras (penalties, logit_bias, min_tokens, min_p, logprobs; `EngineConfig.sampling_extras`)
change what a step computes, so each is a program of its own. On a compiling device the worker
sends a step that uses any of them all of them (`model_input.row_inputs`, `one_extras_variant`):
one more variant per program, which warm-up compiles too when the engine takes such requests. A
step with a grammar's mask carries them as well (none with `sampling_extras` off), so with a
tokenizer (structured output) there is one variant more with the mask, and the deferred step's
forward and sampling; under speculation the spec step's (n-gram and draft_model), its mask a row
per verified position. Not warmed, compiled
when serving first meets them: a logit_bias or min_tokens stop list longer than one token (its width,
a power of two, is part of the shape), prompt logprobs.
"""

from __future__ import annotations

import torch

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model.inputs import FORWARD_INPUT_NAMES, SAMPLING_INPUT_NAMES, padding_inputs
from neuron_async_sm.model.logits_processors import PROCESSING_INPUTS
from neuron_async_sm.model.logprobs import PACKED_DTYPE, block_width
from neuron_async_sm.runtime import TensorSpec, WarmupCall
from neuron_async_sm.worker.drafts import SPEC_STEP_PROGRAM
from neuron_async_sm.worker.model_input import SAMPLED_DTYPE, logits_dtype
from neuron_async_sm.worker.model_runner import (
    LOGITS_PROGRAM,
    RELAY_PAD_PROGRAM,
    SAMPLE_PROGRAM,
    STEP_PROGRAM,
    relay_width,
)


def warmup_shapes(config: EngineConfig) -> list[tuple[int, ...]]:
    """Every padded input_ids shape a step can have under `config`."""
    widest = config.prefill_bucket(config.max_num_batched_tokens)  # no row is ever scheduled more tokens
    shapes: list[tuple[int, ...]] = [(bucket,) for bucket in config.decode_buckets]
    for length in (b for b in config.prefill_buckets if b <= widest):
        shapes.extend((rows, length) for rows in range(1, config.max_num_seqs + 1))
    return shapes


def warmup_calls(config: EngineConfig, vocab_size: int, *, grammars: bool = False) -> list[WarmupCall]:
    """One call per shape, of the program this config runs (on-device sampling or host-sampled logits),
    for each of its `variants`: with `config.sampling_extras` the extras' inputs (`extras_inputs`),
    and with `grammars` (the engine takes structured output) a mask, in async mode the deferred
    step's two programs too (the forward, then the sampling under the mask).

    A decode call runs fed with its own output future (the Steady path's graph: input ids that are a
    previous graph's output). With the relay on, each shape also runs as a relay step: its relay input
    is a step's output padded to relay_width rows (RELAY_PAD_PROGRAM, compiled once per output row count
    and output width).
    """
    if config.speculative_config is not None:
        return spec_warmup_calls(config, vocab_size, grammars=grammars)
    if not config.on_device_sampling:
        calls = []
        for shape in warmup_shapes(config):
            out = TensorSpec((shape[0], vocab_size), logits_dtype(config.dtype))
            inputs = padding_inputs(shape, config.max_num_seqs)  # the scratch slot is max_num_seqs
            forward = {name: inputs[name] for name in FORWARD_INPUT_NAMES}
            calls.append(WarmupCall(_label(shape), LOGITS_PROGRAM, forward, out))
        return calls
    width = relay_width(config)
    relay = config.async_scheduling and config.async_relay
    calls, relay_calls = [], []
    for extras, mask in variants(config, grammars):
        for shape in warmup_shapes(config):
            rows = shape[0]
            inputs = padding_inputs(shape, config.max_num_seqs)
            out = TensorSpec((rows,), SAMPLED_DTYPE)
            label = _label(shape) + _variant_label(extras, mask)
            if extras:  # the packed output: the tokens, then the sampled tokens' logprobs
                inputs.update(extras_inputs(rows, config.max_logprobs))
                out = TensorSpec((rows, 1 + block_width(config.max_logprobs)), PACKED_DTYPE)
            forward_inputs = {k: v for k, v in inputs.items() if k not in (*SAMPLING_INPUT_NAMES, "sample_logprobs")}
            if mask:
                inputs["token_bitmask"] = mask_input((rows,), vocab_size)
            plain = WarmupCall(label, STEP_PROGRAM, inputs, out)
            steady = {"input_ids": plain}  # Steady: the sampled tokens are the next input
            calls.append(WarmupCall(label, STEP_PROGRAM, {**inputs, **steady}, out) if len(shape) == 1 else plain)
            fed_ways = [{}, steady] if len(shape) == 1 else [{}]
            if relay and rows <= width:  # no step has more rows than relay_width
                # This shape's own output, padded, is the relay input: the pads of every output row count.
                pad_out = TensorSpec((width,), SAMPLED_DTYPE)
                pad_label = f"relay pad {rows}" + (" of a packed output" if extras else "")
                padded = WarmupCall(pad_label, RELAY_PAD_PROGRAM, {"tokens": plain}, pad_out)
                no_rows = torch.full((rows,), -1, dtype=torch.int32)  # [rows] relays nothing: padding rows
                fed_ways.append({"relay_tokens": padded, "relay_rows": no_rows})
                relay_calls.append(WarmupCall(f"relay {label}", STEP_PROGRAM, {**inputs, **fed_ways[-1]}, out))
            if mask and config.async_scheduling:
                # SampleDeferred: the forward, its input ids from the host, the pending future or the
                # relay; then the sampling of its logits under the mask.
                logits = TensorSpec((rows, vocab_size), logits_dtype(config.dtype))
                sampling = {k: v for k, v in inputs.items() if k != "input_ids"}
                for fed in fed_ways:
                    forward = WarmupCall(f"deferred forward {label}", LOGITS_PROGRAM, {**forward_inputs, **fed}, logits)
                    calls.append(
                        WarmupCall(f"deferred sample {label}", SAMPLE_PROGRAM, {"logits": forward, **sampling}, out)
                    )
    return calls + relay_calls


def spec_warmup_calls(config: EngineConfig, vocab_size: int, *, grammars: bool = False) -> list[WarmupCall]:
    """With speculative decoding every step is one `SPEC_STEP_PROGRAM` call of `[rows, prefill bucket]`
    (the relay is off, and a decode row is a chunk of its last accepted token and its drafts): one
    call per such shape, and with a device drafter (draft_model) in async mode the same shape fed with
    its own output (SpecSteady, SpecExit and ReorderRemap of a drafted future: `drafted_input`, which
    is `[rows, 2(1 + k)]` whatever the step that made it, plus the logprobs with extras, float32 then). A fed
    graph depends on its input's rows alone, which equal the step's. Greedy and sampled rows run one
    graph on a compiling device (`SpecStepProgram`). Each call runs once per variant (`variants`): with
    `config.sampling_extras` the extras' inputs (a fed step has the same rows as the step that fed it,
    so the same variant), and with `grammars` a mask of one row per verified position
    (`[rows, 1 + k, words]`), fed too under draft_model in async mode (a masked request alone takes
    SpecSteady, and a deferred spec step runs the same program with its mask)."""
    spec = config.speculative_config
    assert spec is not None
    fed = config.async_scheduling and spec.method == "draft_model"
    columns = spec.width * (2 if spec.method == "draft_model" else 1)
    calls = []
    for extras, mask in variants(config, grammars):
        for shape in warmup_shapes(config):
            if len(shape) == 1:  # no spec step is [decode bucket]
                continue
            rows = shape[0]
            inputs = padding_inputs(shape, config.max_num_seqs)  # the scratch slot is max_num_seqs
            inputs["num_drafts"] = torch.zeros(rows, dtype=torch.int32)
            width, label, dtype = columns, f"spec {_label(shape)}{_variant_label(extras, mask)}", SAMPLED_DTYPE
            if extras:  # then a logprobs block per verified position, the whole packed as float32
                inputs.update(extras_inputs(rows, config.max_logprobs))
                width, dtype = columns + spec.width * block_width(config.max_logprobs), PACKED_DTYPE
            if mask:
                inputs["token_bitmask"] = mask_input((rows, spec.width), vocab_size)
            out = TensorSpec((rows, width), dtype)
            plain = WarmupCall(label, SPEC_STEP_PROGRAM, inputs, out)
            calls.append(plain)
            if fed:
                calls.append(WarmupCall(f"{label} fed", SPEC_STEP_PROGRAM, {**inputs, "drafted_input": plain}, out))
    return calls


def variants(config: EngineConfig, grammars: bool) -> list[tuple[bool, bool]]:
    """(extras, mask) of each program variant a step can be on a compiling device: plain; with the
    sampling extras (`config.sampling_extras`); with a grammar's mask (`grammars`), which carries the
    extras where the engine takes them (`model_input.row_inputs`)."""
    found = [(False, False)]
    if config.sampling_extras:
        found.append((True, False))
    if grammars:
        found.append((config.sampling_extras, True))
    return found


def mask_input(rows: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """A padding step's `token_bitmask`, int32 `[*rows, words]`: every token allowed."""
    return torch.full((*rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def extras_inputs(rows: int, max_logprobs: int) -> dict[str, torch.Tensor]:
    """The sampling extras' inputs of an all-padding step of `rows` rows: every logits-processing input
    (neutral; lists one wide) and the sampled tokens' logprobs at `max_logprobs`, as the worker sends a
    step with any extra on a compiling device."""
    processing = {
        spec.name: torch.full((rows, 1) if spec.listed else (rows,), spec.pad, dtype=spec.dtype)
        for spec in PROCESSING_INPUTS
    }
    return {**processing, "sample_logprobs": torch.tensor([max_logprobs], dtype=torch.int32)}


def _label(shape: tuple[int, ...]) -> str:
    return f"decode bucket {shape[0]}" if len(shape) == 1 else f"prefill {shape[0]} x {shape[1]}"


def _variant_label(extras: bool, mask: bool) -> str:
    parts = [name for name, used in (("sampling extras", extras), ("a mask", mask)) if used]
    return f" with {' and '.join(parts)}" if parts else ""
