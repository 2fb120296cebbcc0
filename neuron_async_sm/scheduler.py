"""Continuous batching in the style of vLLM v1. The scheduler never touches a tensor or a future.

Each step it gives every running request one decode token (or its next prefill chunk), then admits
waiting requests into free KV slots while the token budget lasts. A prefill longer than the budget is
chunked over several steps.

In async mode the engine schedules step N+1 before step N's tokens are known. The scheduler then
counts each in-flight sampled token as an output *placeholder*:
- a request whose in-flight tokens already reach `max_tokens` / `max_model_len` is not scheduled
  again (the max_tokens pipelining gap: it leaves `num_scheduled_tokens` one step before it shows up
  in `finished_req_ids`);
- a stop on EOS or a stop token is only known after materialization, so the step already in flight
  for that request samples one more token: `update_from_output` discards it, it is never emitted.
- with the relay on (`async_relay`), such a request gives its KV slot back as soon as it is left out,
  one step before its last token is applied: a waiting request takes the slot in the same step, as
  it would in sync mode. The request stays unfinished (its last token is still delivered); the worker
  drops it from its batch at once (`finished_req_ids`). With the relay off the slot is held until the
  token is applied: the design's behaviour, whose step counters the scenarios pin.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.model.logprobs import MAX_VOCAB
from neuron_async_sm.outputs import ModelRunnerOutput, NewRequestData, RequestDelta, SchedulerOutput, TokenLogprobs
from neuron_async_sm.request import FinishReason, Request, RequestStatus
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams, bad_words_token_ids
from neuron_async_sm.structured_output import GrammarBitmask, GrammarCompiler, dead_end
from neuron_async_sm.values import is_int
from neuron_async_sm.worker.drafts import propose_ngram

# Logits processing (model/logits_processors.py) and each parameter's "off" value.
_PROCESSING_OFF = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": (),
    "allowed_token_ids": None,
    "bad_words": (),
    "bad_words_token_ids": (),
}


def sampling_extras_used(params: SamplingParams) -> list[str]:
    """The fields of `params` that ask for logits processing or logprobs (EngineConfig.sampling_extras)."""
    used = [name for name, off in _PROCESSING_OFF.items() if getattr(params, name) != off]
    return used + [name for name in ("logprobs", "prompt_logprobs") if getattr(params, name) is not None]


class Scheduler:
    """Waiting and running queues, KV slots, the token budget, and stop conditions."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        # Structured output: compiles a request's grammar against the model's tokenizer (None: refused).
        self.grammars = grammars
        self._tokenizer: Any = None  # a tokenizers.Tokenizer for bad_words, loaded at the first request with them
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Async, relay on: requests whose last token is in flight and whose KV slot is already free.
        self.releasing: list[Request] = []
        self._early_release = config.async_scheduling and config.async_relay
        # Every request the scheduler still tracks: unfinished ones, and finished ones that a step in
        # flight still mentions. Keeping the latter guards token ownership: a recycled request id can
        # never receive a token sampled for its previous owner.
        self.requests: dict[str, Request] = {}
        # Steps scheduled and not applied yet, oldest first (at most two in async mode): the requests
        # a step in flight mentions are its keys. Kept per step, not counted per request, so that a
        # step costs nothing per request here.
        self._unapplied: deque[SchedulerOutput] = deque()
        self._free_slots: list[int] = list(range(config.max_num_seqs))
        self._finished_since_schedule: set[str] = set()
        self._next_step_id = 0
        self.num_output_tokens = 0  # tokens emitted so far
        spec = config.speculative_config
        self.num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens  # k; 0: no speculation
        self.num_accepted_tokens = 0  # drafts accepted, over every spec row applied
        self.num_prompt_steps = 0  # steps that scheduled a prompt chunk (the others are decode steps)

    # -- requests -----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate and queue a request. Raises InvalidRequestError naming the field; nothing else changes."""
        prompt = request.prompt_token_ids
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id: duplicate request id {request.request_id!r}")
        if not prompt:
            raise InvalidRequestError("prompt_token_ids: empty prompt")
        bad = [t for t in prompt if not is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt_token_ids: a prompt of {len(prompt)} tokens leaves no room for output under "
                f"max_model_len={self.config.max_model_len}"
            )
        if not self.config.sampling_extras and (extras := sampling_extras_used(request.sampling_params)):
            raise InvalidRequestError(
                f"{extras[0]}: this engine takes no penalties, logit_bias, min_tokens, min_p, "
                "allowed_token_ids, bad_words or logprobs "
                "(--no-sampling-extras)"
            )
        params = request.sampling_params = self._resolve_logprobs(request.sampling_params)
        outside = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        outside = [token for token in params.allowed_token_ids or () if token >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"allowed_token_ids: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        params = request.sampling_params = self._resolve_bad_words(params)
        eos = () if params.ignore_eos else self.eos_token_ids
        request.stop_token_set = frozenset(params.stop_token_ids).union(eos)
        request.max_outputs = min(params.max_tokens, self.config.max_model_len - len(prompt))
        request.max_computed_tokens = len(prompt) + request.max_outputs - 1
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured_outputs: this engine has no tokenizer to build a grammar over")
            request.grammar = self.grammars.matcher(params.structured_outputs)  # InvalidRequestError naming the field
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _resolve_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad_words tokenized (vLLM's rule; token sequences given are only checked)."""
        if params.bad_words_token_ids or not params.bad_words:
            sequences = params.bad_words_token_ids
            if outside := [t for s in sequences for t in s if t >= self.vocab_size]:
                raise InvalidRequestError(
                    f"bad_words: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            return params
        path = None if self.grammars is None else self.grammars.tokenizer_json
        if path is None:
            raise InvalidRequestError("bad_words: the model has no tokenizer.json to tokenize them with")
        if self._tokenizer is None:
            from tokenizers import Tokenizer  # noqa: PLC0415 (only a request with bad words pays its import)

            self._tokenizer = Tokenizer.from_file(path)
        tokenizer = self._tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        return replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, encode, self.vocab_size))

    def _resolve_logprobs(self, params: SamplingParams) -> SamplingParams:
        """`params` with -1 logprobs (the whole vocabulary) as a count; InvalidRequestError naming the
        field when a count is above max_logprobs."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return params
        limit = self.config.max_logprobs
        counts = {}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            count = self.vocab_size if value == -1 else value
            if count is not None and count > limit:
                raise InvalidRequestError(
                    f"{name}: asks for {count} logprobs per position, more than max_logprobs={limit} "
                    "(the engine's --max-logprobs)"
                )
            counts[name] = count
        if self.vocab_size > MAX_VOCAB:
            raise InvalidRequestError(f"logprobs: not available for a vocabulary of more than {MAX_VOCAB} tokens")
        return replace(params, **counts)

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Finish a request as aborted. Tokens of its steps still in flight are discarded."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return RequestDelta(request_id, [], FinishReason.ABORT.value)

    def fail_all(self, error: str) -> list[RequestDelta]:
        """The engine died: every unfinished request ends with finish_reason "error"."""
        deltas = []
        for request in list(self.requests.values()):
            if not request.is_finished:
                if request.status is RequestStatus.WAITING:
                    self.waiting.remove(request)
                self._finish(request, FinishReason.ERROR, error=error)
                deltas.append(RequestDelta(request.request_id, [], FinishReason.ERROR.value, error))
        # No step will ever be applied again: forget every request, including finished ones that
        # were only kept for a step in flight (those steps were drained, never applied).
        self.requests.clear()
        self._unapplied.clear()
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.releasing)

    @property
    def num_free_slots(self) -> int:
        """KV slots no request holds; back to max_num_seqs at idle unless a slot leaked."""
        return len(self._free_slots)

    # -- scheduling ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts. Advances `num_computed_tokens` at once."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        num_computed: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        sampling: set[str] = set()
        all_decode = True
        done: list[Request] = []  # left out for good: their last token is in flight
        add_sampling = sampling.add
        k = self.num_spec_tokens
        drafts: dict[str, int] = {}
        draft_ids: dict[str, tuple[int, ...]] = {}  # a masked request's grammar-valid drafts

        # One pass per running request, inlined: this loop is the scheduler's per-request cost on
        # every step (the rest of a step is O(changes)).
        for request in self.running:  # past the budget every n below is 0: nothing more is scheduled
            req_id, computed = request.request_id, request.num_computed_tokens
            num_prompt = request.num_prompt_tokens
            if computed >= num_prompt and k:  # speculative decode: 1 + drafts tokens, which sample
                n = self._spec_row(request, min(budget, 1 + k), done, draft_ids)
                if n:
                    budget -= n
                    num_scheduled[req_id] = n
                    num_computed[req_id] = computed
                    add_sampling(req_id)
                    if n > 1:
                        drafts[req_id] = n - 1
                continue
            if computed >= num_prompt:  # decode: one token, which samples
                if computed >= request.max_computed_tokens:
                    # The max_tokens pipelining gap: every output it may have is sampled or in flight
                    # (each decode step samples one), and another step would sample a token past
                    # max_tokens / max_model_len.
                    if self._early_release:
                        done.append(request)
                    continue
                if budget <= 0:
                    continue
                budget -= 1
                num_scheduled[req_id] = 1
                num_computed[req_id] = computed
                request.num_computed_tokens = computed + 1
                add_sampling(req_id)
                # One more token will exist once this step runs; in sync mode it is materialized
                # before the next schedule, so the placeholder is gone by then.
                request.num_output_placeholders += 1
                continue
            n = num_prompt - computed  # the prompt's remainder: one chunk of it
            if n > budget:
                n = budget
            if n <= 0:
                continue
            budget -= n
            num_scheduled[req_id] = n
            num_computed[req_id] = computed
            all_decode = False
            request.num_computed_tokens = computed = computed + n
            if computed >= num_prompt:
                add_sampling(req_id)
                request.num_output_placeholders += 1

        for request in done:
            self._release_slot(request)

        while self.waiting and budget > 0 and self._free_slots:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.kv_slot = self._free_slots.pop(0)
            self.running.append(request)
            req_id, num_prompt = request.request_id, request.num_prompt_tokens
            n = min(num_prompt, budget)
            num_scheduled[req_id] = n
            budget -= n
            new_reqs.append(
                NewRequestData(
                    req_id, list(request.prompt_token_ids), request.sampling_params, request.seed, request.kv_slot
                )
            )
            num_computed[req_id] = request.num_computed_tokens  # 0: nothing is preempted here
            all_decode = False  # a prompt chunk
            request.num_computed_tokens += n
            if request.num_computed_tokens >= num_prompt:
                sampling.add(req_id)
                request.num_output_placeholders += 1

        if not num_scheduled:
            # Nothing to run (e.g. every request waits on an in-flight token): keep the finished ids
            # for the next step that reaches the worker.
            return SchedulerOutput(self._next_step_id, {}, {}, [], frozenset(), frozenset(), False)
        self.num_prompt_steps += not all_decode  # before speculation makes every step's input [rows, L]
        if k:
            for req_id in sampling:
                self.requests[req_id].num_sampling_in_flight += 1
            # The step's input is always [rows, L]: decode rows are chunks of 1 + drafts tokens.
            all_decode = False
        masked = frozenset(r for r in sampling if self.requests[r].grammar is not None)
        output = SchedulerOutput(
            step_id=self._next_step_id,
            num_scheduled_tokens=num_scheduled,
            num_computed_tokens=num_computed,
            scheduled_new_reqs=new_reqs,
            finished_req_ids=frozenset(self._finished_since_schedule),
            sampling_req_ids=frozenset(sampling),
            all_decode=all_decode,
            num_draft_tokens=drafts,
            draft_token_ids=draft_ids,
            structured_output_req_ids=masked,
            grammar_bitmask=self._bitmask_if_current(masked, draft_ids) if masked else None,
        )
        self._next_step_id += 1
        self._finished_since_schedule.clear()
        self._unapplied.append(output)
        return output

    def _bitmask_if_current(
        self, masked: frozenset[str], draft_ids: dict[str, tuple[int, ...]] | None = None
    ) -> GrammarBitmask | None:
        """The step's bitmask, when every masked request's grammar holds its newest token: its only
        placeholders are this step's own (1, or 1 + its drafts). Otherwise None: the worker defers the
        step's sampling (never under speculation: a masked request waits for its step in flight).

        Hazard: stale mask. A mask built while a token is in flight would come from the grammar before it.
        """
        requests, draft_ids = self.requests, draft_ids or {}
        if any(requests[r].num_output_placeholders != 1 + len(draft_ids.get(r, ())) for r in masked):
            assert not self.num_spec_tokens, "a masked request under speculation runs one step at a time"
            return None
        return self._bitmask(masked, draft_ids)

    def grammar_bitmask(self, scheduled: SchedulerOutput) -> GrammarBitmask:
        """The bitmask of `scheduled`'s masked rows from the grammars as they are now (a deferred step's,
        built after the pending step was applied; speculative: one row per verified position, after
        the drafts the step verifies). A request finished meanwhile samples unmasked: its token is
        discarded."""
        return self._bitmask(scheduled.structured_output_req_ids, scheduled.draft_token_ids)

    def _bitmask(self, masked: frozenset[str], draft_ids: dict[str, tuple[int, ...]] | None = None) -> GrammarBitmask:
        assert self.grammars is not None
        requests = self.requests
        live = [r for r in sorted(masked) if not requests[r].is_finished]
        matchers = [requests[r].grammar for r in live]
        grammar_tokens = tuple(len(requests[r].output_token_ids) for r in live)
        if self.num_spec_tokens:  # one row per verified position: [M, 1 + k, W], from the drafts chosen
            width, draft_ids = 1 + self.num_spec_tokens, draft_ids or {}
            bitmask = np.zeros((len(live), width, self.grammars.words), dtype=np.int32)
            for i, (req_id, matcher) in enumerate(zip(live, matchers, strict=True)):
                bitmask[i] = self.grammars.draft_bitmask(matcher, draft_ids.get(req_id, ()), width)[1]
        else:
            bitmask = self.grammars.bitmask(matchers)  # [M, W]
        for i, req_id in enumerate(live):
            request = requests[req_id]
            if request.grammar_dead_end is None:  # row 0: the request's next output
                request.grammar_dead_end = self._dead_end(request, bitmask[i] if bitmask.ndim == 2 else bitmask[i, 0])
            if request.grammar_dead_end is not None:
                # Hazard: an empty mask. A row that may take no token would sample from logits that are
                # all -inf; it samples unmasked instead, and its output finishes it with the error.
                bitmask[i] = -1
        return GrammarBitmask(tuple(live), bitmask, grammar_tokens)

    def _dead_end(self, request: Request, row: np.ndarray, ahead: int = 0) -> str | None:
        """Why `request` can sample no token under its mask row: the grammar allows none, or only tokens
        its own parameters rule out for its next output (see `structured_output.dead_end`); `ahead`:
        the row is for the output that many after its next (a spec row's draft positions)."""
        params = request.sampling_params
        ruled_out: set[int] = set()
        why = []
        if len(request.output_token_ids) + ahead < params.min_tokens and request.stop_token_set:
            ruled_out |= request.stop_token_set
            why.append(f"min_tokens={params.min_tokens} holds back the stop tokens until {params.min_tokens} outputs")
        if params.ignore_eos:
            ruled_out |= set(self.eos_token_ids)
            why.append("ignore_eos is set (EOS does not end it)")
        return dead_end(request.grammar, row, ruled_out, "; ".join(why))

    # -- results ------------------------------------------------------------------------------------

    def update_from_output(self, scheduled: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestDelta]:
        """Apply one step's sampled tokens: append, check stops, finish, free slots."""
        if scheduled.is_empty:
            return []
        # Applied in the order scheduled; from here on it is no longer in flight.
        assert self._unapplied and self._unapplied[0] is scheduled, "steps are applied in the order scheduled"
        self._unapplied.popleft()
        if self.num_spec_tokens:
            return self._update_spec(scheduled, output)
        tokens = output.by_request()
        deltas: list[RequestDelta] = []
        # Only a step where a row asked for logprobs pays for them (None otherwise).
        asked = None if output.logprobs is None and output.prompt_logprobs is None else self._logprobs(output)
        requests, sampling = self.requests, scheduled.sampling_req_ids
        finished = RequestStatus.FINISHED
        append_delta = deltas.append
        for req_id in scheduled.num_scheduled_tokens:  # this loop runs for every request on every step
            request = requests[req_id]
            if req_id in sampling:
                request.num_output_placeholders -= 1
                # A stop discovered on an earlier step's token (or an abort): this step was already in
                # flight and sampled one more token for the request. Discard it, never emit it.
                if request.status is not finished and request.grammar_dead_end is not None:
                    # Its row sampled unmasked (its grammar allowed it no token): never emit that token.
                    self._finish(request, FinishReason.ERROR, error=request.grammar_dead_end)
                    append_delta(RequestDelta(req_id, [], FinishReason.ERROR.value, request.grammar_dead_end))
                    continue
                if request.status is not finished:
                    token = tokens[req_id]
                    outputs = request.output_token_ids
                    outputs.append(token)
                    # Hazard: grammar ownership. Only a delivered token advances the grammar.
                    if request.grammar is not None and not request.grammar.consume_token(token):
                        error = f"structured output: the grammar rejected token {token} ({request.grammar.get_error()})"
                        self._finish(request, FinishReason.ERROR, error=error)
                        append_delta(RequestDelta(req_id, [], FinishReason.ERROR.value, error))
                        outputs.pop()
                        continue
                    if token in request.stop_token_set:
                        reason = FinishReason.STOP
                    elif len(outputs) >= request.max_outputs:
                        reason = FinishReason.LENGTH
                    else:
                        append_delta(RequestDelta(req_id, [token]))
                        continue  # not finished: nothing to forget
                    self._finish(request, reason)
                    append_delta(RequestDelta(req_id, [token], reason.value))
            if request.status is finished:
                self._forget_if_done(request)
        self.num_output_tokens += len(deltas)  # one token each
        if asked:
            for delta in deltas:
                found = asked.get(delta.request_id)
                if found is not None:
                    delta.logprobs, delta.prompt_logprobs = found
        return deltas

    # -- speculative decoding (docs/spec-decode.md §3, §5) ------------------------------------------

    def _spec_row(self, request: Request, most: int, done: list[Request], draft_ids: dict[str, tuple[int, ...]]) -> int:
        """Tokens a decode row of `request` computes this step (1 + drafts; 0: not scheduled), at most
        `most`; advances its computed tokens and placeholders by as many, as if every draft is accepted.

        The host knows only bounds while rows are in flight: at least one token each (S rows), at most
        its placeholders (U = outputs + placeholders, the most the device may hold).
        A request under a grammar runs one step at a time, its drafts chosen here (`_grammar_drafts`).
        """
        if request.grammar is not None and request.num_output_placeholders:
            # Hazard: stale mask, and unvalidated drafts. Its drafts and mask rows need its grammar to
            # hold every token, and the n-gram every token of its history: it waits for its step in flight.
            return 0
        outputs = len(request.output_token_ids)
        if outputs + request.num_sampling_in_flight >= request.max_outputs:
            # Its rows in flight surely reach max_tokens / max_model_len (each gives a token).
            if self._early_release:
                done.append(request)
            return 0
        held = outputs + request.num_output_placeholders  # U
        room = self.config.max_model_len - request.num_prompt_tokens
        if held >= room:  # the next input may lie past max_model_len: wait for the reconcile
            return 0
        if request.speculating and held + self.num_spec_tokens > room - 1:
            # Hazard: async != sync near max_model_len. The row's first output n is known only as
            # least <= n <= U; a seeded position verified against a draft draws another token than a
            # plain one, so the switch must fall at the n sync mode's exact count gives: wait for the
            # reconcile while n may still fit a spec row.
            if outputs + request.num_sampling_in_flight + self.num_spec_tokens <= room - 1:
                return 0
            # For good: n only grows (a rule on U alone would flip the request between spec and plain rows).
            request.speculating = False
        # Hazard: async != sync when the budget cuts drafts. Which rows a budget cuts depends on the
        # step's company, which differs between the modes, and a seeded position verified against a
        # draft draws another token than a plain one: a spec row runs whole or waits a step.
        n = 1 + self.num_spec_tokens if request.speculating else 1
        if n > most:
            return 0
        if request.grammar is not None and n > 1:
            draft_ids[request.request_id] = drafts = self._grammar_drafts(request, n - 1)
            n = 1 + len(drafts)
        request.num_computed_tokens += n
        request.num_output_placeholders += n
        return n

    def _grammar_drafts(self, request: Request, most: int) -> tuple[int, ...]:
        """A masked request's drafts (at most `most`: n-gram's from its whole history, or draft_model's as
        its last step's drafter proposed them on the device), cut to the prefix its grammar accepts
        (vLLM's update_draft_token_ids / validate_tokens) and before a draft after which the request
        could sample no token (a dead end under its mask row)."""
        spec, grammars = self.config.speculative_config, self.grammars
        assert spec is not None and grammars is not None and request.grammar is not None
        if spec.method == "draft_model":  # the device's, read with its last run (one step at a time)
            proposed = list(request.proposed_drafts[:most])
        else:
            history = [*request.prompt_token_ids, *request.output_token_ids]
            proposed = propose_ngram(history, most, spec.prompt_lookup_min, spec.prompt_lookup_max)
        valid, rows = grammars.draft_bitmask(request.grammar, proposed, 1 + len(proposed))
        for j in range(1, len(valid) + 1):
            if self._dead_end(request, rows[j], ahead=j) is not None:
                return tuple(valid[: j - 1])
        return tuple(valid)

    def _update_spec(self, scheduled: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestDelta]:
        """`update_from_output` for speculative steps: each sampling row gives its run (accepted drafts,
        then one more); the rejected drafts' placeholders and computed tokens are taken back, the run
        is appended token by token with the stop check after each, and the tokens after a stop are
        dropped (never emitted)."""
        runs = output.runs_by_request()
        proposals: dict[str, list[int]] = {}  # draft_model: each masked row's next_input
        if (masked := scheduled.structured_output_req_ids) and output.next_input is not None:
            proposals = {r: row for r, row in zip(output.req_ids, output.next_input, strict=True) if r in masked}
        deltas: list[RequestDelta] = []
        asked = None if output.logprobs is None and output.prompt_logprobs is None else self._logprobs(output)
        sampling, drafted = scheduled.sampling_req_ids, scheduled.num_draft_tokens
        for req_id in scheduled.num_scheduled_tokens:
            request = self.requests[req_id]
            if req_id in sampling:
                run, reserved = runs[req_id], drafted.get(req_id, 0)
                request.num_sampling_in_flight -= 1
                request.num_output_placeholders -= 1 + reserved
                assert request.num_output_placeholders >= 0, (req_id, request.num_output_placeholders)
                request.num_computed_tokens -= reserved - (len(run) - 1)  # the rejected drafts
                self.num_accepted_tokens += len(run) - 1
                if not request.is_finished and request.grammar_dead_end is not None:
                    # Its row sampled unmasked (its grammar allowed it no token): never emit that run.
                    self._finish(request, FinishReason.ERROR, error=request.grammar_dead_end)
                    deltas.append(RequestDelta(req_id, [], FinishReason.ERROR.value, request.grammar_dead_end))
                elif not request.is_finished:
                    if req_id in proposals:  # the drafts after its run, for its next row's cut
                        request.proposed_drafts = tuple(d for d in proposals[req_id][1:] if d >= 0)
                    delta = self._append_run(request, run)
                    if asked and (found := asked.get(req_id)) is not None:
                        logprobs, delta.prompt_logprobs = found
                        # A stop inside the run: the tokens after it, and their logprobs, are dropped.
                        delta.logprobs = None if logprobs is None else logprobs[: len(delta.new_token_ids)]
                    deltas.append(delta)
            if request.is_finished:
                self._forget_if_done(request)
        self.num_output_tokens += sum(len(d.new_token_ids) for d in deltas)
        return deltas

    def _append_run(self, request: Request, run: list[int]) -> RequestDelta:
        outputs = request.output_token_ids
        for i, token in enumerate(run):
            # Hazard: grammar ownership. Only a delivered token advances the grammar, in order.
            if request.grammar is not None and not request.grammar.consume_token(token):
                error = f"structured output: the grammar rejected token {token} ({request.grammar.get_error()})"
                request.num_computed_tokens -= len(run) - i
                self._finish(request, FinishReason.ERROR, error=error)
                return RequestDelta(request.request_id, run[:i], FinishReason.ERROR.value, error)
            outputs.append(token)
            if token in request.stop_token_set:
                reason = FinishReason.STOP
            elif len(outputs) >= request.max_outputs:
                reason = FinishReason.LENGTH
            else:
                continue
            # A stop inside an accepted run ends the request exactly there.
            request.num_computed_tokens -= len(run) - 1 - i
            self._finish(request, reason)
            return RequestDelta(request.request_id, run[: i + 1], reason.value)
        return RequestDelta(request.request_id, list(run))

    def _logprobs(self, output: ModelRunnerOutput) -> dict[str, tuple[list[TokenLogprobs] | None, list | None]]:
        """Before a step is applied: each prompt chunk's logprobs added to its request's, and per request
        that samples with logprobs asked, what its delta carries (its tokens' logprobs, one each; the
        whole prompt's on its first token)."""
        found: dict[str, tuple[list[TokenLogprobs] | None, list | None]] = {}
        requests = self.requests
        sample = output.spec_logprobs  # speculative: per row, one per token of its run
        if sample is None:
            sample = [None if lp is None else [lp] for lp in output.logprobs or [None] * len(output.req_ids)]
        chunks = output.prompt_logprobs or [None] * len(output.req_ids)
        for req_id, logprobs, chunk in zip(output.req_ids, sample, chunks, strict=True):
            request = requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if chunk is not None:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None]  # the first prompt token has nothing before it
                request.prompt_logprobs.extend(chunk)
            prompt = request.prompt_logprobs if not request.output_token_ids else None  # before its first token
            if logprobs is not None or prompt is not None:
                found[req_id] = (logprobs, prompt)
        return found

    def _release_slot(self, request: Request) -> None:
        """The relay's early release: the slot goes back, the request stays unfinished (its last token,
        in flight, is still delivered; the worker skips its write-back, having dropped it)."""
        self._free_slot(request)
        self.releasing.append(request)

    def _free_slot(self, request: Request) -> None:
        self.running.remove(request)
        # Safe to reuse the slot at once even if a step writing it is in flight: the device runs
        # programs in order, and a new owner only attends to positions it wrote itself.
        self._free_slots.append(request.kv_slot)
        self._free_slots.sort()
        request.kv_slot = None
        self._finished_since_schedule.add(request.request_id)  # the worker drops it from its batch

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        was_running = request.status is RequestStatus.RUNNING
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        if was_running:
            if request.kv_slot is None:  # released early: its last token was in flight
                self.releasing.remove(request)
            else:
                self._free_slot(request)
        self._forget_if_done(request)

    def num_steps_in_flight(self, request_id: str) -> int:
        """Steps scheduled and not applied yet that run this request."""
        return sum(request_id in step.num_scheduled_tokens for step in self._unapplied)

    def _forget_if_done(self, request: Request) -> None:
        req_id = request.request_id
        if request.is_finished and self.requests.get(req_id) is request and not self.num_steps_in_flight(req_id):
            del self.requests[req_id]
