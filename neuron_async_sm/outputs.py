"""Values that cross a boundary: scheduler -> runner -> output thread -> client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from neuron_async_sm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from neuron_async_sm.structured_output import GrammarBitmask


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen before (its first scheduled step)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    kv_slot: int
    # The last tokens of prompt_token_ids that an earlier run of this request produced (a preempted
    # request restarted from its tokens, under vLLM): its output indices, which seed its sampling,
    # continue from there. 0 for a request's first run.
    num_output_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """What one engine step runs. Built by the scheduler; the runner applies it."""

    step_id: int
    # Every request scheduled this step -> number of tokens it computes this step.
    # Its key set is the step's request *set*; the runner compares it with the set that
    # produced the pending future to detect a composition change.
    num_scheduled_tokens: dict[str, int]
    # request id -> tokens already computed before this step (prompt chunks + decodes).
    num_computed_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequestData]
    # Requests that finished or were aborted since the previous schedule: the runner frees them.
    finished_req_ids: frozenset[str]
    # Requests whose row samples a real output token this step (prefill complete); a partial
    # prefill chunk's sampled token is discarded.
    sampling_req_ids: frozenset[str]
    # Every scheduled request computes exactly one token past its prompt (a decode step): the
    # program input is 1-D and may be the previous step's sampled-token future.
    all_decode: bool
    # Speculative decoding: request id -> drafts reserved for its row (its row computes 1 + that many
    # tokens); a request not here drafts nothing this step.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Speculative decoding under a grammar (n-gram): request id -> the drafts the scheduler proposed and
    # cut to their grammar-valid prefix (the mask's rows follow them); the worker verifies these.
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Structured output: the requests of this step that sample under a live grammar (the machine's
    # `masked_req_ids`), and their bitmask when the scheduler could build it now (every one of their
    # grammars holds its request's newest token); None otherwise: the sampling is deferred.
    structured_output_req_ids: frozenset[str] = frozenset()
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(frozen=True)
class StepSnapshot:
    """Which request owns each row of one step's sampled tokens, taken when the step is sampled (the
    design's `_bookkeeping_sync`). Crosses from the worker's main thread to the async output thread.

    The next step may reorder or remove rows; tokens are written back by these request ids, never by
    current row, so they always reach the request they were sampled for.
    """

    step_id: int
    req_ids: tuple[str, ...]  # row i of the step's sampled tokens belongs to req_ids[i]
    sample_positions: tuple[int | None, ...]  # token position each row samples; None: partial prefill

    def sampled_req_ids(self) -> frozenset[str]:
        """The requests whose newest token this step sampled (a partial prefill chunk's row did not)."""
        return frozenset(r for r, p in zip(self.req_ids, self.sample_positions, strict=True) if p is not None)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one position (vLLM's raw logprobs, see model/logprobs.py): the chosen
    token's (the sampled one, or the prompt's), its rank (1: the most likely), and the top tokens."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]  # the most likely first, as many as the request asked for
    top_logprobs: tuple[float, ...]

    def as_dict(self) -> dict[int, float]:
        """vLLM's order: the chosen token first, then the top ones (a token in both keeps its first place)."""
        out = {self.token_id: self.logprob}
        for token, logprob in zip(self.top_ids, self.top_logprobs, strict=True):
            out.setdefault(token, logprob)
        return out


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens of one step, keyed by the request ids snapshotted when the step was sampled."""

    step_id: int
    req_ids: list[str]  # row order of the step's program (the snapshot)
    sampled_token_ids: list[int]  # [num_reqs], row i belongs to req_ids[i]
    # Speculative decoding: row i's tokens, its accepted drafts then one more ([1 + a_i] each);
    # sampled_token_ids[i] is the first of them. None: one token per row.
    spec_token_ids: list[list[int]] | None = None
    # Only when a row of the step asked for them (None otherwise), per row: the sampled token's
    # logprobs (None: the row did not ask, or samples nothing), and the prompt logprobs of the row's
    # chunk, of the prompt tokens after its positions (None: the row did not ask).
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    # Speculative decoding with logprobs asked: row i's, one per token of spec_token_ids[i] (None: the
    # row did not ask); logprobs[i] is the first of them.
    spec_logprobs: list[list[TokenLogprobs] | None] | None = None
    # draft_model: row i's next_input ([1 + k]: its last accepted token, then the drafts its drafter
    # proposed after it, -1 past them), read with its run; the scheduler keeps a masked request's drafts
    # to cut with its grammar for its next row. None: no drafter on the device.
    next_input: list[list[int]] | None = None

    def by_request(self) -> dict[str, int]:
        return dict(zip(self.req_ids, self.sampled_token_ids, strict=True))

    def runs_by_request(self) -> dict[str, list[int]]:
        """Each row's tokens as a list (one token each without speculation)."""
        runs = self.spec_token_ids or [[t] for t in self.sampled_token_ids]
        return dict(zip(self.req_ids, runs, strict=True))


@dataclass
class RequestOutput:
    """What a client sees of one request: all tokens so far, or only the new ones when streaming."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    index: int = 0  # which of its prompt's n sequences (SamplingParams.n) this is
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked
    # one per prompt token when the request asked; the first is None (nothing comes before it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "output_token_ids": list(self.output_token_ids),
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


@dataclass(slots=True)
class RequestDelta:
    """What one step changed for one request: new tokens and, when it ended, why.

    Not frozen: the scheduler makes one per running request on every step, and a frozen dataclass's
    __init__ (one object.__setattr__ per field) costs twice a plain one's.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    # the whole prompt's, on the request's first delta with a token, when it asked (first entry None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
