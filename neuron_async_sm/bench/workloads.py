"""The benchmark's named workloads. Each is a seeded, deterministic list of requests.

Arrivals are counted in engine loop turns (`PromptRequest.arrival_step`), not in seconds, so sync and
async runs see the same request mix in the same order, whichever mode is faster.

- `steady`: N requests (default 8) with 32-token prompts, all arriving at once, each decoding 256
  tokens (`ignore_eos`, greedy). After one prefill step the batch never changes: the best case for
  async scheduling, where every step can feed the previous step's sampled-token future.
- `churn`: 64 short requests arriving one every 2 turns, prompts of 8-48 tokens, 4-24 output
  tokens, greedy and sampled mixed. The batch composition changes almost every step (joins, finishes,
  condense reorders), so many steps fall back to a synchronous path.
- `mixed`: 48 requests in bursts (gaps drawn from a geometric distribution, mean 4 turns), prompt
  lengths from a long-tailed distribution (8-320 tokens, so long prompts are chunked under the
  token budget), output lengths 16-192, greedy / temperature / top-p mixed. A realistic serving mix.

`penalties`: every request also carries presence, frequency and repetition penalties (`PENALTIES`),
so every step processes its logits on the device (model/logits_processors.py).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, replace

from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.sampling_params import SamplingParams
from neuron_async_sm.structured_output import StructuredOutputsParams

WORKLOADS = ("steady", "churn", "mixed")
# `--constrained-fraction`: bounded grammars, round robin, each ending well within 100 tokens (a model
# whose tokenizer can spell them: byte-level BPE or larger).
BENCH_CONSTRAINTS = (
    StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    ),
    StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{1,3}"),
    StructuredOutputsParams(choice=("yes", "no", "maybe")),
)
DEFAULT_NUM_REQUESTS = {"steady": 8, "churn": 64, "mixed": 48}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


@dataclass(frozen=True)
class Workload:
    """A named request list; `tag` makes request ids unique per repetition."""

    name: str
    requests: tuple[PromptRequest, ...]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def max_output_tokens(self) -> int:
        return sum(r.sampling_params.max_tokens for r in self.requests)

    def with_logprobs(self, logprobs: int | None) -> Workload:
        """The same requests, each asking for `logprobs` top tokens per output token (None: as they are)."""
        if logprobs is None:
            return self
        requests = tuple(
            dataclasses.replace(r, sampling_params=dataclasses.replace(r.sampling_params, logprobs=logprobs))
            for r in self.requests
        )
        return Workload(self.name, requests)

    def tagged(self, tag: str) -> list[PromptRequest]:
        """The requests with ids prefixed by `tag` (an engine may not see one id twice at once)."""
        return [
            PromptRequest(r.prompt_token_ids, r.sampling_params, f"{tag}-{r.request_id}", r.arrival_step)
            for r in self.requests
        ]


def with_constraints(workload: Workload, fraction: float) -> Workload:
    """`workload` with `fraction` of its requests (spread evenly) constrained by BENCH_CONSTRAINTS in
    turn; a constrained request stops at its grammar's end (EOS), the others are unchanged."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"constrained_fraction: must be in [0, 1], got {fraction}")
    requests, k = [], 0
    for i, r in enumerate(workload.requests):
        if int((i + 1) * fraction) > int(i * fraction):
            constraint = BENCH_CONSTRAINTS[k % len(BENCH_CONSTRAINTS)]
            r = replace(r, sampling_params=replace(r.sampling_params, ignore_eos=False, structured_outputs=constraint))
            k += 1
        requests.append(r)
    return Workload(workload.name, tuple(requests))


def build_workload(
    name: str,
    *,
    num_requests: int | None = None,
    vocab_size: int = 1024,
    max_model_len: int = 512,
    output_tokens: int | None = None,
    seed: int = 0,
    penalties: bool = False,
) -> Workload:
    """The workload called `name` (see the module docstring); ValueError names an unknown one.

    `output_tokens` overrides the output length of `steady` (the other workloads draw theirs).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    n = num_requests if num_requests is not None else DEFAULT_NUM_REQUESTS[name]
    if n < 1:
        raise ValueError(f"num_requests: must be >= 1, got {n}")
    rng = random.Random(f"{name}-{seed}")

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(length)]  # ids 0-2: padding, bos, eos

    requests = []
    if name == "steady":
        max_tokens = output_tokens if output_tokens is not None else 256
        for i in range(n):
            requests.append(PromptRequest(prompt(32), SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"s{i}"))
    elif name == "churn":
        for i in range(n):
            params = SamplingParams(
                max_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True
            )
            requests.append(PromptRequest(prompt(rng.randint(8, 48)), params, f"c{i}", arrival_step=2 * i))
    else:
        turn = 0
        for i in range(n):
            length = min(int(8 * rng.paretovariate(1.2)), 320, max_model_len - 200)
            params = SamplingParams(
                max_tokens=min(rng.choice([16, 32, 64, 128, 192]), max_model_len - length - 1),
                temperature=rng.choice([0.0, 0.0, 0.7, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                seed=i,
                ignore_eos=True,
            )
            requests.append(PromptRequest(prompt(max(length, 8)), params, f"m{i}", arrival_step=turn))
            turn += int(rng.expovariate(1 / 4))
    if penalties:
        requests = [
            dataclasses.replace(r, sampling_params=dataclasses.replace(r.sampling_params, **PENALTIES))
            for r in requests
        ]
    return Workload(name, tuple(requests))
