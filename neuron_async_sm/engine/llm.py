"""The user-facing API, in the spirit of vLLM's `LLM` class."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.engine.core import EngineCore
from neuron_async_sm.model import tokenizer_path
from neuron_async_sm.outputs import RequestDelta, RequestOutput
from neuron_async_sm.runtime import RuntimeFactory, create_runtime
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams, child_request_id


@dataclass(frozen=True)
class PromptRequest:
    """One request to generate: its tokens, its parameters, and (optionally) when it arrives."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams = SamplingParams()
    request_id: str | None = None
    arrival_step: int = 0  # added just before the engine's arrival_step-th loop turn (0-based)
    index: int = 0  # which of its prompt's n sequences (sampling_params.n) this child request is


@dataclass
class Turn:
    """One turn of the arrival loop (`LLM.turns`): who arrived before it, and what its engine turn produced."""

    index: int
    admitted: list[PromptRequest] = field(default_factory=list)
    rejected: list[tuple[PromptRequest, InvalidRequestError]] = field(default_factory=list)
    deltas: list[RequestDelta] = field(default_factory=list)  # empty when nothing was unfinished


class LLM:
    """Generate with the engine: `LLM(model="tiny-llama", async_scheduling=True, ...)`.

    Keyword arguments are EngineConfig fields, and ``runtime_factory`` (the engine's runtime seam, see
    ``EngineCore``: tests pass one that wraps the backend). One invalid request never takes down the others:
    `generate()` returns it with finish_reason "error" and a message naming the field.

    A prompt is token ids, or text (as in vLLM, `generate("some text")` is one prompt) encoded with the
    model directory's tokenizer.json. A request whose parameters ask for `n` > 1 sequences runs as n
    child requests (ids `"{i}_{request_id}"`, child i seeded `seed + i`): its n outputs come one after
    the other, each with its `index`.
    """

    def __init__(self, model: str = "tiny-llama", runtime_factory: RuntimeFactory = create_runtime, **config: object):
        self.engine = EngineCore(EngineConfig(model=model, **config), runtime_factory)  # type: ignore[arg-type]
        self._ids = itertools.count()
        self._tokenizer: object | None = None  # loaded at the first text prompt

    @classmethod
    def from_config(cls, config: EngineConfig, runtime_factory: RuntimeFactory = create_runtime) -> LLM:
        """An `LLM` over a config already built (the command line's: `args.engine_config`)."""
        llm = cls.__new__(cls)
        llm.engine = EngineCore(config, runtime_factory)
        llm._ids = itertools.count()
        return llm

    @property
    def config(self) -> EngineConfig:
        """The engine's config as resolved against the model (max_model_len is always an int here)."""
        return self.engine.config

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    # -- step-level API -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequestError naming the bad field."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.engine.add_request(request_id, prompt_token_ids, sampling_params or SamplingParams())
        return request_id

    def step(self) -> list[RequestDelta]:
        """One turn of the engine loop: the tokens and finishes it produced."""
        return self.engine.run_step()

    def abort(self, request_id: str) -> RequestDelta | None:
        return self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    # -- whole-run API ------------------------------------------------------------------------------

    def turns(
        self,
        requests: Sequence[PromptRequest | list[int]],
        *,
        before_step: Callable[[Turn], None] | None = None,
        step: Callable[[], list[RequestDelta]] | None = None,
        max_turns: int | None = None,
    ) -> Iterator[Turn]:
        """The arrival loop, turn by turn, until every request arrived and finished.

        Before turn t, every request whose `arrival_step` <= t is added (a rejected one is reported, not
        raised); then `before_step(turn)` runs (e.g. to abort), then one engine turn (`step`, default
        `self.step`) if anything is unfinished. Yields each turn, steps or not.
        """
        pending = deque(sorted(self._normalize(requests, None), key=lambda r: r.arrival_step))
        index = 0
        while pending or self.has_unfinished_requests():
            if max_turns is not None and index >= max_turns:
                raise RuntimeError(f"requests still unfinished after {max_turns} turns")
            turn = Turn(index)
            while pending and pending[0].arrival_step <= index:
                request = pending.popleft()
                try:
                    self.add_request(request.prompt_token_ids, request.sampling_params, request.request_id)
                except InvalidRequestError as exc:
                    turn.rejected.append((request, exc))
                else:
                    turn.admitted.append(request)
            if before_step is not None:
                before_step(turn)
            if self.has_unfinished_requests():
                turn.deltas = (step or self.step)()
            yield turn
            index += 1

    def stream(
        self,
        requests: str | Sequence[PromptRequest | list[int] | str],
        sampling_params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield per-step deltas (new tokens of one request; `finished` on its last) as steps finish."""
        normalized = self._normalize(requests, sampling_params)
        by_id = {r.request_id: r for r in normalized}
        for turn in self.turns(normalized):
            for request, exc in turn.rejected:
                yield RequestOutput(
                    request.request_id, request.prompt_token_ids, [], True, "error", str(exc), index=request.index
                )
            for delta in turn.deltas:
                yield _to_output(delta, by_id.get(delta.request_id))

    def generate(
        self,
        requests: str | Sequence[PromptRequest | list[int] | str],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run requests to completion; outputs in input order.

        `on_finish(output)` is called the moment each request finishes (completion order), e.g. to
        make its result durable before the others end; a request rejected up front counts too.
        """
        normalized = self._normalize(requests, sampling_params)
        results: dict[str, RequestOutput] = {}
        rejected: dict[int, RequestOutput] = {}
        for i, r in enumerate(normalized):
            if r.request_id in results:  # results are keyed by id: a duplicate would merge into the first
                rejected[i] = RequestOutput(
                    r.request_id,
                    r.prompt_token_ids,
                    [],
                    True,
                    "error",
                    f"request_id: duplicate request id {r.request_id!r}",
                    index=r.index,
                )
            else:
                results[r.request_id] = RequestOutput(r.request_id, r.prompt_token_ids, index=r.index)
        progress = _progress(len(normalized)) if use_tqdm else None
        failed = 0
        for output in rejected.values():
            failed += 1
            if on_finish is not None:
                on_finish(output)
            if progress is not None:
                progress.update(1)
        accepted = [r for i, r in enumerate(normalized) if i not in rejected]
        try:
            for delta in self.stream(accepted):
                result = results[delta.request_id]
                result.output_token_ids.extend(delta.output_token_ids)
                _add_logprobs(result, delta)
                if not delta.finished:
                    continue
                result.finished, result.finish_reason, result.error = True, delta.finish_reason, delta.error
                failed += result.finish_reason == "error"
                if on_finish is not None:
                    on_finish(result)
                if progress is not None:
                    progress.update(1)
                    # Failures counted apart: a bar at 100% must not hide requests that errored.
                    progress.set_postfix(tok_s=f"{self.engine.stats()['tokens_per_s']:.0f}", failed=failed)
        finally:
            if progress is not None:
                progress.close()
        return [rejected.get(i) or results[r.request_id] for i, r in enumerate(normalized)]

    def _normalize(
        self, requests: str | Sequence[PromptRequest | list[int] | str], params: SamplingParams | None
    ) -> list[PromptRequest]:
        """Every request as a PromptRequest with an id; one asking for n > 1 sequences as its n children."""
        if isinstance(requests, str):
            requests = [requests]  # one text prompt, not a list of characters
        out = []
        for i, r in enumerate(requests):
            request = self._as_request(r, params, i)
            children = request.sampling_params.children()
            if len(children) == 1:
                out.append(request)
                continue
            for index, child in enumerate(children):
                child_id = child_request_id(request.request_id, index)  # type: ignore[arg-type]
                out.append(PromptRequest(request.prompt_token_ids, child, child_id, request.arrival_step, index))
        return out

    def _as_request(
        self, request: PromptRequest | list[int] | str, params: SamplingParams | None, index: int
    ) -> PromptRequest:
        if isinstance(request, str):
            request = PromptRequest(self.encode(request), params or SamplingParams())
        elif not isinstance(request, PromptRequest):
            request = PromptRequest(list(request), params or SamplingParams())
        if request.request_id is None:
            request = PromptRequest(
                request.prompt_token_ids, request.sampling_params, f"req-{next(self._ids)}", request.arrival_step
            )
        return request

    def encode(self, text: str) -> list[int]:
        """Text -> token ids with the model's tokenizer.json (special tokens added, as a prompt gets them)."""
        if self._tokenizer is None:
            path = tokenizer_path(self.config.model)
            if path is None:
                raise InvalidRequestError(f"prompt: text prompts need a tokenizer.json in {self.config.model}")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(path)
        return self._tokenizer.encode(text).ids  # type: ignore[attr-defined]

    # -- lifecycle ----------------------------------------------------------------------------------

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_output(delta: RequestDelta, request: PromptRequest | None) -> RequestOutput:
    return RequestOutput(
        delta.request_id,
        request.prompt_token_ids if request is not None else [],
        list(delta.new_token_ids),
        delta.finish_reason is not None,
        delta.finish_reason,
        delta.error,
        index=request.index if request is not None else 0,
        logprobs=delta.logprobs,
        prompt_logprobs=delta.prompt_logprobs,
    )


def _add_logprobs(result: RequestOutput, delta: RequestOutput) -> None:
    """A streamed piece's logprobs added to the request's whole result."""
    if delta.prompt_logprobs is not None:
        result.prompt_logprobs = delta.prompt_logprobs
    if delta.logprobs is not None:
        if result.logprobs is None:
            result.logprobs = []
        result.logprobs.extend(delta.logprobs)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
