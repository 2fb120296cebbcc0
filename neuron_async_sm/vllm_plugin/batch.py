"""vLLM's SchedulerOutput as ours: the step our ModelRunner runs. Imports nothing from vLLM.

The translation decides nothing about the step: which requests run, how many tokens each computes
and from where are vLLM's; which path the step takes is our machine's. What it adds is what vLLM
leaves to the worker:
- KV slots. Our device's KV cache is one slot per request (Neuron's sequence ids), not vLLM's
  blocks: a request takes a slot when it (re)starts and gives it back when it finishes or is
  preempted; a new request may take it in the same step (our runner removes before it adds).
- Restarts. A preempted request is recomputed from scratch. Model runner V1 resends it as a cached
  request listed in `resumed_req_ids`, with `all_token_ids`; V2 resends it as a new request whose
  `prefill_token_ids` are its prompt and outputs. Either way it becomes one of our new requests whose
  prompt is every token it had, in a fresh slot.
- Step boundaries. vLLM may send a step with nothing scheduled (only finished or preempted ids); our
  runner never sees an empty step, so those ids are held for the next step that runs.
- Drafts. vLLM's scheduled drafts become our `num_draft_tokens` (and `draft_token_ids` when they
  are real ids, sync): `spec_drafts`.
The in-flight token is not here either: vLLM's async scheduler counts it (output placeholders) but
never sends it. Our runner feeds it from the pending device future, as in our own engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from neuron_async_sm.outputs import NewRequestData, SchedulerOutput
from neuron_async_sm.sampling_params import SamplingParams

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy


class UnsupportedStepError(RuntimeError):
    """vLLM sent a step our worker cannot run as given (e.g. a prefix-cache hit our slots do not hold)."""


@dataclass(frozen=True)
class KnownRequest:
    """What the worker keeps of a live vLLM request across preemptions: enough to restart it."""

    params: SamplingParams
    seed: int
    num_prompt_tokens: int  # the request's own prompt (a restart's prompt also holds its outputs)
    structured: bool = False  # samples under a grammar (vLLM's `structured_outputs`): a masked row


@dataclass(frozen=True)
class HeldRequest:
    """A request our runner holds now."""

    kv_slot: int
    num_prompt_tokens: int  # the prompt our runner was given: past it, a row decodes


def sampling_params(params: Any, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
    """Our sampling parameters from vLLM's (the platform's validate_request refuses what we lack).

        Stops, max_tokens and EOS are vLLM's business: our runner samples and processes logits. min_tokens
        holds back vLLM's own stop set (`all_stop_token_ids`: stop_token_ids, and EOS unless ignore_eos),
        as vLLM's MinTokensLogitsProcessor does, so ours is given that set and no EOS of its own. Logprobs
        counts of -1 (the whole vocabulary) become `vocab_size` (None: they stay -1), as our scheduler
        resolves them; vLLM has checked them against its max_logprobs. bad_words come as vLLM tokenized
    them (`bad_words_token_ids`). The grammar stays vLLM's: its
        scheduler builds the bitmask (`KnownRequest.structured`)."""
    greedy = params.temperature < GREEDY_EPS
    return SamplingParams(
        max_tokens=max(1, max_tokens),
        temperature=0.0 if greedy else float(params.temperature),
        top_k=0 if greedy or params.top_k is None or params.top_k < 0 else int(params.top_k),
        top_p=1.0 if greedy else float(params.top_p),
        stop_token_ids=tuple(sorted(params.all_stop_token_ids)),
        ignore_eos=True,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        min_p=float(params.min_p),
        min_tokens=int(params.min_tokens),
        logit_bias=dict(params.logit_bias or {}),
        allowed_token_ids=tuple(params.allowed_token_ids) if params.allowed_token_ids else None,
        # vLLM's tokenization of bad_words (its input processor's, after validate_request: () there)
        bad_words_token_ids=tuple(map(tuple, params.bad_words_token_ids or ())),
        logprobs=_count(params.logprobs, vocab_size),
        prompt_logprobs=_count(params.prompt_logprobs, vocab_size),
    )


def _count(value: int | None, vocab_size: int | None) -> int | None:
    return vocab_size if value == -1 and vocab_size is not None else value


def spec_drafts(scheduled: dict[str, list[int]] | None) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """vLLM's `scheduled_spec_decode_tokens` as our SchedulerOutput's: per request the drafts its row
    verifies (`num_draft_tokens`), and the ids where vLLM sent real ones (`draft_token_ids`).

    Synchronous, vLLM schedules the drafts our worker proposed after the previous step
    (`take_draft_token_ids`), maybe cut (max_model_len, the token budget): the row verifies exactly
    those. Async, it sends `-1` placeholders, one per draft it counts in flight: the count is vLLM's,
    the ids are the device's (draft_model: the pending output's next_input, or its materialized drafts)."""
    num_drafts: dict[str, int] = {}
    draft_ids: dict[str, tuple[int, ...]] = {}
    for req_id, tokens in (scheduled or {}).items():
        if not tokens:
            continue
        num_drafts[req_id] = len(tokens)
        if min(tokens) >= 0:  # real ids (a -1 is a placeholder)
            draft_ids[req_id] = tuple(tokens)
    return num_drafts, draft_ids


def request_seed(req_id: str, params: Any, model_seed: int) -> int:
    """vLLM's seed when the request has one; otherwise one from the model seed and the request id, so
    that a request samples the same tokens in sync and async mode and on every rank."""
    if params.seed is not None:
        return int(params.seed) % 2**63
    digest = hashlib.sha256(f"{model_seed}/{req_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


class BatchTranslator:
    """One rank's view of vLLM's steps as ours. Every rank translates the same steps the same way."""

    def __init__(
        self, max_num_seqs: int, max_model_len: int, vocab_size: int, model_seed: int = 0, *, speculative: bool = False
    ) -> None:
        self.max_model_len = max_model_len
        self.speculative = speculative
        self.vocab_size = vocab_size
        self.model_seed = model_seed
        self._free_slots = list(range(max_num_seqs))
        self.known: dict[str, KnownRequest] = {}  # every live vLLM request this worker has seen
        self.held: dict[str, HeldRequest] = {}  # those our runner holds, with their slot
        self._leaving: set[str] = set()  # released since our runner's last step: it drops them next
        self._next_step_id = 0
        self.restarts = 0  # preempted requests restarted (their outputs recomputed as prompt)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def translate(self, step: Any) -> SchedulerOutput | None:
        """Our step for vLLM's `step`, or None when nothing is scheduled (its departures are kept)."""
        for req_id in step.finished_req_ids:
            self._release(req_id)
            self.known.pop(req_id, None)
        for req_id in step.preempted_req_ids or ():
            self._release(req_id)  # its restart comes as a resumed or new request, in a fresh slot
        new: list[NewRequestData] = []
        computed: dict[str, int] = {}
        for data in step.scheduled_new_reqs:
            if data.num_computed_tokens:
                raise UnsupportedStepError(
                    f"request {data.req_id}: {data.num_computed_tokens} tokens computed elsewhere (a prefix-cache "
                    "hit); our KV cache holds a request's tokens in its own slot only"
                )
            if data.req_id not in self.known:
                params = data.sampling_params
                self.known[data.req_id] = KnownRequest(
                    sampling_params(params, params.max_tokens or self.max_model_len, self.vocab_size),
                    request_seed(data.req_id, params, self.model_seed),
                    len(data.prompt_token_ids),
                    params.structured_outputs is not None,
                )
            # Model runner V2 resends a preempted request as new, with its outputs in prefill_token_ids.
            tokens = data.prefill_token_ids if data.prefill_token_ids is not None else data.prompt_token_ids
            new.append(self._start(data.req_id, tokens))
            computed[data.req_id] = 0
        cached = step.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if req_id in cached.resumed_req_ids:
                # Model runner V1 resends a preempted request as cached, with every token it has.
                if num_computed:
                    raise UnsupportedStepError(f"request {req_id}: resumed with {num_computed} tokens computed")
                new.append(self._start(req_id, cached.all_token_ids[req_id]))
            computed[req_id] = num_computed
        scheduled: dict[str, int] = step.num_scheduled_tokens
        if not scheduled:
            return None
        held = self.held
        sampling = frozenset(r for r, n in scheduled.items() if computed[r] + n >= held[r].num_prompt_tokens)
        all_decode = all(n == 1 and computed[r] >= held[r].num_prompt_tokens for r, n in scheduled.items())
        known = self.known
        # vLLM's structured_output_request_ids: the sampling rows of requests with a grammar. Their
        # bitmask comes with sample_tokens (worker.py), never with the step.
        masked = frozenset(r for r in sampling if known[r].structured)
        leaving, self._leaving = frozenset(self._leaving), set()
        num_drafts, draft_ids = spec_drafts(step.scheduled_spec_decode_tokens)
        output = SchedulerOutput(
            step_id=self._next_step_id,
            num_scheduled_tokens=dict(scheduled),
            num_computed_tokens=computed,
            scheduled_new_reqs=new,
            finished_req_ids=leaving,
            sampling_req_ids=sampling,
            all_decode=all_decode and not self.speculative,  # a spec step's input is [rows, L], as our scheduler's
            num_draft_tokens=num_drafts,
            draft_token_ids=draft_ids,
            structured_output_req_ids=masked,
        )
        self._next_step_id += 1
        return output

    def _start(self, req_id: str, tokens: list[int]) -> NewRequestData:
        """A request (re)starting: a fresh slot, every token it has as its prompt."""
        self._release(req_id)  # a restart without a preemption notice: the old run's slot goes first
        if not self._free_slots:
            raise UnsupportedStepError(
                f"request {req_id}: no free KV slot; vLLM ran more requests than max_num_seqs={len(self.held)}"
            )
        known = self.known[req_id]
        slot = self._free_slots.pop(0)
        self.held[req_id] = HeldRequest(slot, len(tokens))
        num_outputs = len(tokens) - known.num_prompt_tokens  # already produced before a preemption
        params = known.params
        if num_outputs:
            self.restarts += 1
            # Every parameter stays as it was: output indices continue from num_outputs (min_tokens,
            # max_tokens and the seeded draws count from the request's first output), and the
            # penalties see the restart's last num_outputs prompt tokens as outputs. Its prompt's
            # logprobs went out with its first run's first token: they are not computed again.
            params = replace(params, prompt_logprobs=None)
        return NewRequestData(req_id, list(tokens), params, known.seed, slot, num_outputs)

    def _release(self, req_id: str) -> None:
        held = self.held.pop(req_id, None)
        if held is None:
            return
        self._free_slots.append(held.kv_slot)
        self._free_slots.sort()
        # Hazard: a recycled slot. Our runner drops the request in its next step, in the same update
        # that may add the slot's new owner (removals first), so no two requests share a slot's row.
        self._leaving.add(req_id)
