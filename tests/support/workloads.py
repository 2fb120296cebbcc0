"""Random workloads and a driver that runs one through an engine turn by turn (aborts included)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.engine.llm import PromptRequest, Turn

# The speculative-decoding tests' engine: float64 (float32 matmuls may round differently per row
# count; float64 makes ties negligible), a small token budget so that prompts are chunked and spec
# rows compete for it.
SPEC_ENGINE = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=128,
    max_num_batched_tokens=32,
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4),
)


@dataclass
class WorkItem:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_turn: int
    abort_turn: int | None = None


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    deltas_per_turn: list[int] = field(default_factory=list)


def random_workload(
    rng: random.Random, tag: str, vocab: int = 1024, max_prompt: int = 60, *, processing: bool = False
) -> list[WorkItem]:
    """Random requests; `processing`: most of them with penalties, logit_bias, min_tokens, min_p,
    allowed_token_ids or bad words too."""
    items = []
    for i in range(rng.randint(1, 10)):
        temperature = rng.choice([0.0, 0.0, 0.7, 1.3])
        params = SamplingParams(
            max_tokens=rng.randint(1, 30),
            temperature=temperature,
            top_k=rng.choice([0, 0, 5, 50]),
            top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
            seed=rng.choice([None, rng.randrange(2**31)]),
            stop_token_ids=tuple(rng.sample(range(3, vocab), rng.choice([0, 0, 20, 60]))),
            ignore_eos=rng.random() < 0.3,
        )
        if processing and rng.random() < 0.8:
            params = _with_processing(rng, params, vocab)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
        abort = rng.randint(0, 25) if rng.random() < 0.15 else None
        items.append(WorkItem(f"{tag}-{i}", prompt, params, rng.randint(0, 12), abort))
    return items


def _with_processing(rng: random.Random, params: SamplingParams, vocab: int) -> SamplingParams:
    return dataclasses.replace(
        params,
        presence_penalty=rng.choice([0.0, 0.0, 1.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 2.0, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.5, 0.8]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        min_tokens=rng.choice([0, 0, min(params.max_tokens, rng.randint(1, 10))]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.choice([0, 0, 3, 40]))},
        **_token_lists(random.Random(rng.getrandbits(32)), vocab),
    )


def _token_lists(rng: random.Random, vocab: int) -> dict:
    """allowed_token_ids (a random half of the vocabulary) and bad words (1-4 sequences of 1-3 random
    ids) for some requests."""
    fields: dict = {}
    if rng.random() < 0.15:
        fields["allowed_token_ids"] = tuple(rng.sample(range(vocab), vocab // 2))
    if rng.random() < 0.3:
        words = [tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
        fields["bad_words_token_ids"] = tuple(words)
    return fields


def drive(llm: LLM, items: list[WorkItem], *, aborts: bool = True, max_turns: int = 10_000) -> RunResult:
    """Add each item at its arrival turn, abort at its abort turn, step until everything finished."""
    result = RunResult()
    requests = [PromptRequest(w.prompt, w.params, w.request_id, w.arrival_turn) for w in items]
    added: set[str] = set()

    def before_step(turn: Turn) -> None:
        assert not turn.rejected, turn.rejected
        for request in turn.admitted:
            added.add(request.request_id)
            result.tokens[request.request_id] = []
        if aborts:
            for item in items:
                if item.abort_turn == turn.index and item.request_id in added:
                    delta = llm.abort(item.request_id)
                    if delta is not None:
                        result.finish[item.request_id] = delta.finish_reason

    for turn in llm.turns(requests, before_step=before_step, max_turns=max_turns):
        for d in turn.deltas:
            assert d.request_id not in result.finish, f"{d.request_id} got a token after it finished"
            result.tokens[d.request_id].extend(d.new_token_ids)
            if d.finish_reason is not None:
                result.finish[d.request_id] = d.finish_reason
        result.deltas_per_turn.append(len(turn.deltas))
    return result


def prompt_lines(items: list[WorkItem]) -> list[dict]:
    """`items` as `generate`'s input lines (arrival turns kept; the CLI cannot abort, so aborts are not)."""
    return [
        {
            "request_id": w.request_id,
            "prompt_token_ids": w.prompt,
            "max_tokens": w.params.max_tokens,
            "temperature": w.params.temperature,
            "top_k": w.params.top_k,
            "top_p": w.params.top_p,
            "seed": w.params.seed,
            "stop_token_ids": list(w.params.stop_token_ids),
            "ignore_eos": w.params.ignore_eos,
            "arrival_step": w.arrival_turn,
        }
        for w in items
    ]


def assert_matches(got: RunResult, reference: RunResult, items: list[WorkItem]) -> None:
    """Each request's tokens and finish are the reference's; one aborted mid-flight got a prefix of its
    reference tokens, nothing after."""
    for item in items:
        rid = item.request_id
        if got.finish[rid] == "abort":
            assert got.tokens[rid] == reference.tokens[rid][: len(got.tokens[rid])], rid
        else:
            assert (got.tokens[rid], got.finish[rid]) == (reference.tokens[rid], reference.finish[rid]), rid


def greedy(items: list[WorkItem]) -> list[WorkItem]:
    return [dataclasses.replace(w, params=dataclasses.replace(w.params, temperature=0.0)) for w in items]


def workloads(seed: int, count: int, max_prompt: int = 40) -> list[list[WorkItem]]:
    """`count` random workloads (request ids w0, w1, ... within each), the same for the same seed."""
    rng = random.Random(seed)
    return [random_workload(rng, f"w{n}", max_prompt=max_prompt) for n in range(count)]


def drive_batches(llm: LLM, batches: list[list[WorkItem]]) -> list[RunResult]:
    return [drive(llm, items, aborts=False) for items in batches]
