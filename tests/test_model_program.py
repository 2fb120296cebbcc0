"""StepProgram on tiny-llama: chunking, batch invariance, padding isolation, slot reuse, validation."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest
import torch
from support.reference import RowStep, generate_alone, pack_step

from neuron_async_sm.model import TINY_LLAMA, ModelSpec, StepProgram, build_step_program

SLOTS = 8
MAX_LEN = 96


def tiny(dtype: str = "float32", seed: int = 0) -> StepProgram:
    spec = ModelSpec(TINY_LLAMA, dtype, max_num_seqs=SLOTS, max_model_len=MAX_LEN, seed=seed)
    return build_step_program(spec)


def prompt(n: int, salt: int) -> list[int]:
    return [1] + [(salt * 131 + 7 * j * j + 3 * j) % 1000 + 3 for j in range(n - 1)]


def test_tiny_llama_weights_are_seeded_and_greedy_output_is_varied() -> None:
    a, b, other_seed = tiny(), tiny(), tiny(seed=1)
    prompts = [prompt(n, salt) for n, salt in ((4, 0), (9, 1), (2, 2), (13, 3))]
    outs = [generate_alone(a, p, 24, slot=i) for i, p in enumerate(prompts)]
    assert outs == [generate_alone(b, p, 24, slot=i) for i, p in enumerate(prompts)]
    assert outs[0] != generate_alone(other_seed, prompts[0], 24)
    assert len({tuple(o) for o in outs}) == len(prompts)
    assert all(len(set(o)) >= 12 for o in outs), outs  # not stuck in a short repetition loop


@pytest.mark.parametrize("chunk", [3, 5])
def test_chunked_prefill_equals_one_shot_prefill(chunk: int) -> None:
    program = tiny("float64")
    p = prompt(10, 5)
    one_shot = generate_alone(program, p, 10, slot=2)
    assert generate_alone(program, p, 10, prefill_chunk=chunk, slot=1) == one_shot


def test_decode_accepts_1d_inputs() -> None:
    program = tiny()
    generate_alone(program, prompt(5, 1), 1, slot=0)
    generate_alone(program, prompt(5, 1), 1, slot=1)
    step = pack_step([RowStep((44,), 5, 0), RowStep((44,), 5, 1)], program.scratch_slot)
    as_1d = dict(step, input_ids=step["input_ids"][:, 0], positions=step["positions"][:, 0])
    out_1d = program(**as_1d)
    assert out_1d.dtype == torch.int32 and out_1d.shape == (2,)
    assert torch.equal(out_1d, program(**step))


@dataclass
class Request:
    """A request driven through batched steps: prompt in chunks, then one token per step."""

    prompt: list[int]
    slot: int
    sampling: dict
    fed: int = 0  # prompt tokens already sent
    out: list[int] = field(default_factory=list)

    def next_row(self, chunk: int) -> RowStep:
        if self.fed < len(self.prompt):
            tokens = tuple(self.prompt[self.fed : self.fed + chunk])
            return RowStep(tokens, self.fed, self.slot, output_index=0, **self.sampling)
        return RowStep(
            (self.out[-1],),
            len(self.prompt) + len(self.out) - 1,
            self.slot,
            output_index=len(self.out),
            **self.sampling,
        )

    def take(self, row: RowStep, token: int) -> None:
        if self.fed < len(self.prompt):
            self.fed += len(row.token_ids)
            if self.fed < len(self.prompt):
                return  # a mid-prompt chunk's sample is discarded
        self.out.append(token)


def test_batched_mixed_steps_give_each_request_its_alone_tokens_float64() -> None:
    """Staggered arrivals: prefill chunks, decodes and padding rows share [8, 4] steps."""
    samplings = [
        dict(),
        dict(temperature=0.8, seed=11),
        dict(temperature=1.0, top_k=20, seed=12),
        dict(),
        dict(temperature=0.7, top_p=0.9, seed=13),
        dict(temperature=1.3, seed=14),
    ]
    requests = [Request(prompt(3 + 2 * i, i), slot=(3 * i + 1) % SLOTS, sampling=s) for i, s in enumerate(samplings)]
    new_tokens, chunk = 8, 4
    program = tiny("float64")
    for step in range(40):
        live = [r for i, r in enumerate(requests) if i <= step and len(r.out) < new_tokens]
        if not live:
            break
        rows = [r.next_row(chunk) for r in live]
        tokens = program(**pack_step(rows, program.scratch_slot, num_rows=8, length=chunk))
        for r, row, token in zip(live, rows, tokens.tolist(), strict=False):
            r.take(row, token)
    alone_program = tiny("float64")
    for r in requests:
        assert r.out == generate_alone(alone_program, r.prompt, new_tokens, slot=0, **r.sampling)


def garbage_padding(step: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fills every padding token (row padding and padding rows) with out-of-range ids and positions."""
    length = step["input_ids"].shape[1]
    pad = torch.arange(length)[None, :] >= step["query_lens"][:, None]
    return dict(
        step, input_ids=step["input_ids"].masked_fill(pad, 123456), positions=step["positions"].masked_fill(pad, 99999)
    )


def test_padding_never_writes_real_slots() -> None:
    program = tiny()
    p = prompt(7, 9)
    expected = generate_alone(tiny(), p, 6, slot=3)
    real_k = program.kv_cache.k[:, :SLOTS].clone()
    padding_only = pack_step([RowStep((5,), 0, 0)], program.scratch_slot, num_rows=4, length=6)
    padding_only["query_lens"][0], padding_only["slot_ids"][0] = 0, program.scratch_slot
    program(**garbage_padding(padding_only))
    assert torch.equal(program.kv_cache.k[:, :SLOTS], real_k)
    # The request's own rows padded to 8 tokens of garbage, next to padding rows.
    out: list[int] = []
    for i in range(6):
        row = RowStep(tuple(p), 0, 3) if i == 0 else RowStep((out[-1],), len(p) + i - 1, 3, output_index=i)
        tokens = program(**garbage_padding(pack_step([row], program.scratch_slot, num_rows=3, length=8)))
        assert tokens[1:].tolist() == [0, 0]  # padding rows answer token 0
        out.append(int(tokens[0]))
    assert out == expected


def test_reused_slot_ignores_previous_requests_longer_cache() -> None:
    program = tiny()
    generate_alone(program, prompt(30, 1), 20, slot=2)  # leaves positions 0..48 of slot 2 filled
    p = prompt(4, 2)
    assert generate_alone(program, p, 8, slot=2) == generate_alone(tiny(), p, 8, slot=2)


def test_bfloat16_program_runs() -> None:
    out = generate_alone(tiny("bfloat16"), prompt(6, 3), 4)
    assert len(out) == 4 and all(0 <= t < 1024 for t in out)


def test_invalid_steps_are_rejected() -> None:
    program = tiny()
    two = pack_step([RowStep((5,), 0, 1), RowStep((6,), 0, 1)], program.scratch_slot)
    with pytest.raises(ValueError, match="distinct real slots"):
        program(**two)
    with pytest.raises(ValueError, match="input_ids"):  # a placeholder token leaked into a real row
        program(**pack_step([RowStep((5, -1), 0, 0)], program.scratch_slot))
    with pytest.raises(ValueError, match="max_model_len"):
        program(**pack_step([RowStep((5,), MAX_LEN, 0)], program.scratch_slot))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_step_program(ModelSpec(TINY_LLAMA, "float32", max_num_seqs=1, max_model_len=5000))
    cache = program.kv_cache.k.clone()
    unseeded = {k: v for k, v in pack_step([RowStep((5, 6), 0, 0)], program.scratch_slot).items() if k != "seeds"}
    with pytest.raises(ValueError, match="seeds"):  # named, and before the forward wrote any K/V
        program(**unseeded)
    assert torch.equal(program.kv_cache.k, cache)


def test_model_spec_pickles_and_kv_cache_has_scratch_slot() -> None:
    spec = ModelSpec(TINY_LLAMA, "float32", max_num_seqs=3, max_model_len=16, seed=5)
    assert pickle.loads(pickle.dumps(spec)) == spec
    program = build_step_program(spec)
    assert program.scratch_slot == 3
    assert program.kv_cache.k.shape == (4, 4, 16, 2, 32) and program.kv_cache.k.dtype == torch.float32


def test_relay_builds_input_ids_from_the_previous_tokens_on_the_device() -> None:
    """A relayed row computes on relay_tokens[relay_rows[b]] exactly as on the same id sent from the host;
    the other rows of the step (here a prompt chunk and padding) keep their host ids."""
    host, relayed = tiny("float64"), tiny("float64")
    for program in (host, relayed):
        generate_alone(program, prompt(5, 1), 1, slot=0)
    rows = [RowStep((44,), 5, 0), RowStep(tuple(prompt(6, 2)), 0, 1)]
    step = pack_step(rows, host.scratch_slot, num_rows=3)
    poisoned = step["input_ids"].clone()
    poisoned[0, 0] = -1  # POISON_TOKEN: the host does not have this token
    previous = torch.tensor([7, 44, 0], dtype=torch.int32)  # the previous step's sampled tokens [P]
    out = relayed(
        **dict(step, input_ids=poisoned), relay_tokens=previous, relay_rows=torch.tensor([1, -1, -1], dtype=torch.int32)
    )
    assert torch.equal(out, host(**step))


@pytest.mark.parametrize(
    "relay_rows,match",
    [
        ([3, -1, -1], "must lie in"),  # past the previous step's rows
        ([-2, -1, -1], "must lie in"),
        ([-1, 0, -1], "only a row of one token"),  # a prompt chunk is never relayed
        ([-1, -1], "one per row"),
    ],
)
def test_relay_rejects_a_malformed_row_map(relay_rows: list[int], match: str) -> None:
    program = tiny()
    step = pack_step([RowStep((44,), 5, 0), RowStep((5, 6, 7), 0, 1)], program.scratch_slot, num_rows=3)
    with pytest.raises(ValueError, match=match):
        program(
            **step,
            relay_tokens=torch.tensor([7, 44, 0], dtype=torch.int32),
            relay_rows=torch.tensor(relay_rows, dtype=torch.int32),
        )


def test_relay_still_rejects_a_poisoned_row_it_does_not_relay() -> None:
    program = tiny()
    step = pack_step([RowStep((44,), 5, 0), RowStep((45,), 5, 1)], program.scratch_slot)
    step["input_ids"][1, 0] = -1
    with pytest.raises(ValueError, match="input_ids must lie in"):
        program(
            **step,
            relay_tokens=torch.tensor([7, 44], dtype=torch.int32),
            relay_rows=torch.tensor([1, -1], dtype=torch.int32),
        )
