"""Packing rows into StepProgram inputs, and the one-request-alone decode loop tests compare against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from neuron_async_sm.model.inputs import padding_inputs
from neuron_async_sm.model.program import StepProgram

VOCAB = 192  # save_hf_model's vocabulary


@dataclass(frozen=True)
class RowStep:
    """One row of a step: a request's real tokens this step, where they go, and how to sample after them."""

    token_ids: tuple[int, ...]  # decode: one token; prefill: a chunk of the prompt
    start_position: int  # absolute position of token_ids[0]
    slot: int  # the request's KV slot
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    output_index: int = 0  # index, within the request's output, of the token this step samples


def pack_step(
    rows: Sequence[RowStep], scratch_slot: int, num_rows: int | None = None, length: int | None = None
) -> dict[str, torch.Tensor]:
    """StepProgram kwargs for `rows`, padded to `num_rows` rows and `length` tokens per row.

    Padding rows have query_len 0 and the scratch slot; padding tokens have id 0 and position 0,
    as the engine's runner is expected to send them.
    """
    num_rows = len(rows) if num_rows is None else num_rows
    length = max(len(r.token_ids) for r in rows) if length is None else length
    if num_rows < len(rows) or any(len(r.token_ids) > length for r in rows):
        raise ValueError(f"{len(rows)} rows do not fit a [{num_rows}, {length}] step")
    step = padding_inputs((num_rows, length), scratch_slot)  # [B, L] ids and positions, the rest [B]
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        step["input_ids"][b, :n] = torch.tensor(row.token_ids, dtype=torch.int32)
        step["positions"][b, :n] = torch.arange(row.start_position, row.start_position + n, dtype=torch.int32)
        step["query_lens"][b], step["slot_ids"][b] = n, row.slot
        step["temperature"][b], step["top_k"][b], step["top_p"][b] = row.temperature, row.top_k, row.top_p
        step["seeds"][b], step["output_index"][b] = row.seed, row.output_index
    return step


def generate_alone(
    program: StepProgram,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    slot: int = 0,
    prefill_chunk: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    """One request run alone: prefill (in chunks of `prefill_chunk`), then decode one token per call.

    The synchronous reference an engine must match token for token. Does not stop at EOS.
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    chunk = prefill_chunk or len(prompt)
    token = 0
    for start in range(0, len(prompt), chunk):
        row = RowStep(tuple(prompt[start : start + chunk]), start, slot, output_index=0, **sampling)
        token = int(program(**pack_step([row], program.scratch_slot))[0])
    out = [token]
    while len(out) < max_new_tokens:
        row = RowStep((out[-1],), len(prompt) + len(out) - 1, slot, output_index=len(out), **sampling)
        out.append(int(program(**pack_step([row], program.scratch_slot))[0]))
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`transformers`' greedy continuation of one prompt (no padding, no early stop on EOS): the
    reference our engine and the vLLM plugin are held to."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def save_hf_model(path: Path, *, seed: int = 0, **overrides):  # -> transformers.LlamaForCausalLM
    """A small random LlamaForCausalLM (GQA: 4 heads on 2 KV heads) saved to `path` as safetensors."""
    import transformers  # noqa: PLC0415 (only tests with transformers pay its import)

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
        eos_token_id=None,
    )  # wide init: varied greedy tokens; no early stop
    fields.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    model.save_pretrained(path)
    return model


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """float64 `[len(tokens), vocab]` from `transformers`' logits (as the model computes them): row i
    is the log-distribution of the token after tokens[: i + 1]. The logprobs reference."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long)).logits[0]
    return logits.double().log_softmax(dim=-1)
