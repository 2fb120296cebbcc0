"""A request's lifecycle as the scheduler sees it. No tensors here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from neuron_async_sm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, no KV slot yet
    RUNNING = "running"  # holds a KV slot; scheduled every step it fits the budget
    FINISHED = "finished"  # terminal; see FinishReason


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token was sampled
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client aborted it
    ERROR = "error"  # the engine failed while it was in flight


@dataclass(slots=True)
class Request:
    """One generation request.

    `num_computed_tokens` counts tokens whose KV has been (or is being) written: the scheduler
    advances it when it schedules a step, before the step runs. In async mode the scheduler runs one
    step ahead, so tokens sampled by in-flight steps are not known yet: `num_output_placeholders`
    counts them.

    `stop_token_set`, `max_outputs` and `max_computed_tokens` are the stop conditions as the scheduler
    checks them on every step, set once when it admits the request (they depend on its EOS ids and
    max_model_len).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the effective sampling seed (params.seed, or one drawn by the engine)
    arrival_order: int
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    kv_slot: int | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # The tokens that stop it: stop_token_ids, and the model's EOS ids unless ignore_eos.
    stop_token_set: frozenset[int] = field(default=frozenset(), init=False, repr=False)
    # The most output tokens it may have: max_tokens, capped by max_model_len - prompt length.
    max_outputs: int = field(default=0, init=False, repr=False)
    # The most tokens it may compute: the prompt and every output but the last (sampled, never fed back).
    max_computed_tokens: int = field(default=0, init=False, repr=False)
    num_prompt_tokens: int = field(default=0, init=False, repr=False)  # len(prompt_token_ids)
    # Speculative decoding (docs/spec-decode.md §3, §5): rows in flight that sample (each gives at
    # least one token), and whether it may still speculate (off for good near max_model_len).
    num_sampling_in_flight: int = field(default=0, init=False, repr=False)
    speculating: bool = field(default=True, init=False, repr=False)
    # Prompt logprobs gathered chunk by chunk until the first output token carries them (None: none yet).
    prompt_logprobs: list | None = field(default=None, init=False, repr=False)
    # Structured output: its llguidance matcher, which has taken exactly the tokens delivered (None:
    # unconstrained). Owned by the scheduler (neuron_async_sm/structured_output.py).
    grammar: Any = field(default=None, init=False, repr=False)
    # Why its grammar allows no token it may sample, found when its mask was built (None: it does): the
    # output of that step finishes it with an error, never with the token sampled.
    grammar_dead_end: str | None = field(default=None, init=False, repr=False)
    # Under a grammar with draft_model: the drafts the device proposed after its newest token, read
    # with the run of its last step; cut to the grammar's valid prefix for its next row.
    proposed_drafts: tuple[int, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus materialized outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus the ones still being sampled by in-flight steps."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_outputs_with_placeholders(self) -> int:
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
