"""One API request in the engine, answered streamed (SSE) or collected; completions and chat alike.

A request is one `Generation`: one engine request per choice (`n` per prompt: a completion's batch
has n per prompt, chat n). Its pieces are merged in arrival order; the endpoint's `Format` turns them
into chunks or one response. Whatever ends the response (the last piece, the client leaving, a
cancelled task), every choice still open is aborted in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from neuron_async_sm.engine.async_llm import AsyncLLM, RequestStream
from neuron_async_sm.outputs import TokenLogprobs
from neuron_async_sm.serve import protocol as p
from neuron_async_sm.serve.detokenizer import IncrementalText
from neuron_async_sm.serve.errors import GenerationEnded
from neuron_async_sm.serve.logprobs import Scored, chat_logprobs, completion_logprobs, prompt_logprobs
from neuron_async_sm.serve.tokenizer import ServedTokenizer


@dataclass(frozen=True)
class Piece:
    """What one engine step adds to a choice."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" on the last piece
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked


@dataclass
class Choice:
    """One engine request of a generation: the `index`-th choice of the response."""

    index: int
    prompt_len: int
    stream: RequestStream
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""  # what `echo` puts before the output
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # generated so far, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked: the first piece brings them
    echoed: bool = False  # a stream wrote the prompt already
    text_offset: int = 0  # characters a stream's logprobs have covered

    def usage(self) -> p.Usage:
        return p.usage(self.prompt_len, len(self.token_ids))

    def before(self, piece: Piece) -> list[int]:
        """The last tokens before `piece`'s (4: enough to complete a character split over tokens)."""
        end = len(self.token_ids) - len(piece.token_ids)
        return self.token_ids[max(0, end - 4) : end]


class Generation:
    """The choices of one API request, and the engine they run in."""

    def __init__(self, engine: AsyncLLM, request_id: str, choices: list[Choice], sequences: int = 1) -> None:
        self.engine, self.request_id, self.choices = engine, request_id, choices
        self.sequences = sequences  # choices per prompt (n), prompt-major

    def usage(self) -> p.Usage:
        """A prompt's tokens count once, however many sequences it has (as vLLM counts them)."""
        prompt_tokens = sum(c.prompt_len for c in self.choices[:: self.sequences])
        return p.usage(prompt_tokens, sum(len(c.token_ids) for c in self.choices))

    def abort(self) -> None:
        """A no-op for a choice that finished; one still running is aborted wherever it is."""
        for choice in self.choices:
            self.engine.abort(choice.stream.request_id)

    async def pieces(self) -> AsyncIterator[tuple[Choice, Piece]]:
        """Every choice's pieces, in the order they arrive, until all have finished."""
        if len(self.choices) == 1:
            [choice] = self.choices
            async for piece in self._pieces(choice):
                yield choice, piece
            return
        merged: asyncio.Queue[tuple[Choice, Piece | None, Exception | None]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for piece in self._pieces(choice):
                    merged.put_nowait((choice, piece, None))
            except Exception as exc:  # GenerationEnded: re-raised on the consumer's side
                merged.put_nowait((choice, None, exc))
                return
            merged.put_nowait((choice, None, None))

        tasks = [asyncio.ensure_future(pump(choice)) for choice in self.choices]
        try:
            open_choices = len(tasks)
            while open_choices:
                choice, piece, exc = await merged.get()
                if exc is not None:
                    raise exc
                if piece is None:
                    open_choices -= 1
                else:
                    yield choice, piece
        finally:
            for task in tasks:
                task.cancel()

    async def _pieces(self, choice: Choice) -> AsyncIterator[Piece]:
        """One choice's pieces until it finishes; a stop string ends it here (and aborts it in the engine)."""
        async for delta in choice.stream:
            reason = delta.finish_reason
            if reason in ("abort", "error"):
                raise GenerationEnded(reason, delta.error)
            text = choice.text.push(delta.new_token_ids, reason)
            # A stop string drops the tokens after the one that completed it (vLLM's), their logprobs too.
            kept = len(choice.text.token_ids) - len(choice.token_ids)
            new_ids = delta.new_token_ids[:kept]
            logprobs = None if delta.logprobs is None else delta.logprobs[:kept]
            choice.token_ids.extend(new_ids)
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            if logprobs is not None:
                choice.logprobs.extend(logprobs)
            if choice.text.stopped:
                self.engine.abort(choice.stream.request_id, finish_reason="stop")  # the engine would go on
                choice.finish_reason = "stop"
                yield Piece(text, new_ids, "stop", logprobs)
                return
            choice.finish_reason = reason
            yield Piece(text, new_ids, reason, logprobs)


class Format(Protocol):
    """How one endpoint writes its chunks and its response."""

    def opening(self, choice: Choice) -> BaseModel | None: ...  # the first chunk of a choice, if any

    def chunk(self, choice: Choice, piece: Piece, usage: p.Usage | None) -> BaseModel: ...

    def usage_chunk(self, usage: p.Usage) -> BaseModel: ...

    def response(self, generation: Generation, texts: dict[int, str]) -> BaseModel: ...


@dataclass(frozen=True)
class _Answer:
    """What every chunk of one response carries."""

    request_id: str
    model: str
    return_token_ids: bool  # each choice carries its `token_ids`
    tokenizer: ServedTokenizer | None = None  # the logprobs' token texts
    logprobs: int | None = None  # candidates per token the response shows (None: no logprobs)
    echo: bool = False  # completions: the prompt (and its logprobs) before the output; chat: `prompt_text`

    def _ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.return_token_ids else None


class CompletionFormat(_Answer):
    def opening(self, choice: Choice) -> None:
        return None

    def chunk(self, choice: Choice, piece: Piece, usage: p.Usage | None) -> p.CompletionResponse:
        positions = piece.logprobs or [None] * len(piece.token_ids)
        text, parts = piece.text, [Scored(piece.token_ids, positions, choice.before(piece))]
        if self.echo and not choice.echoed:  # the first chunk of an echoed choice: the prompt first
            choice.echoed = True
            text, parts = choice.prompt_text + text, [self._prompt(choice), *parts]
        logprobs = self._logprobs(parts, choice.text_offset)
        if logprobs is not None and logprobs.tokens:
            choice.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        out = p.CompletionChoice(
            index=choice.index,
            text=text,
            finish_reason=piece.finish_reason,
            logprobs=logprobs,
            token_ids=self._ids(piece.token_ids),
        )
        return p.CompletionResponse(id=self.request_id, model=self.model, choices=[out], usage=usage)

    @staticmethod
    def _prompt(choice: Choice) -> Scored:
        """The echoed prompt's tokens and logprobs (None where it has none), before the output's."""
        prompt = choice.prompt_logprobs if choice.prompt_logprobs is not None else [None] * len(choice.prompt_ids)
        return Scored(choice.prompt_ids, prompt, [])

    def _logprobs(self, parts: list[Scored], offset: int) -> p.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, parts, self.logprobs, offset)

    def usage_chunk(self, usage: p.Usage) -> p.CompletionResponse:
        return p.CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, generation: Generation, texts: dict[int, str]) -> p.CompletionResponse:
        choices = []
        for c in generation.choices:
            text, parts = texts[c.index], [Scored(c.token_ids, c.logprobs or [None] * len(c.token_ids), [])]
            if self.echo:
                text, parts = c.prompt_text + text, [self._prompt(c), *parts]
            choices.append(
                p.CompletionChoice(
                    index=c.index,
                    text=text,
                    finish_reason=c.finish_reason,
                    logprobs=self._logprobs(parts, 0),
                    token_ids=self._ids(c.token_ids),
                    prompt_logprobs=None
                    if c.prompt_logprobs is None
                    else prompt_logprobs(self.tokenizer, c.prompt_logprobs),
                )
            )
        return p.CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=generation.usage())


class ChatFormat(_Answer):
    def _chunk(self, choice: p.ChatChunkChoice, usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def opening(self, choice: Choice) -> p.ChatCompletionChunk:
        delta = p.ChatDelta(role="assistant", content="")
        return self._chunk(p.ChatChunkChoice(index=choice.index, delta=delta, token_ids=self._ids([])))

    def chunk(self, choice: Choice, piece: Piece, usage: p.Usage | None) -> p.ChatCompletionChunk:
        text = piece.text
        if self.echo and not choice.echoed:  # vLLM's chat echo: the last message's text first
            choice.echoed = True
            text = choice.prompt_text + text
        out = p.ChatChunkChoice(
            index=choice.index,
            delta=p.ChatDelta(content=text),
            finish_reason=piece.finish_reason,
            logprobs=self._logprobs(piece.logprobs, choice.before(piece)),
            token_ids=self._ids(piece.token_ids),
        )
        return self._chunk(out, usage)

    def _logprobs(self, positions: list[TokenLogprobs] | None, before: list[int]) -> p.ChatLogprobs | None:
        if self.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, positions or [], self.logprobs, before)

    def usage_chunk(self, usage: p.Usage) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, generation: Generation, texts: dict[int, str]) -> p.ChatCompletionResponse:
        choices = [
            p.ChatChoice(
                index=c.index,
                message=p.AssistantMessage(content=(c.prompt_text if self.echo else "") + texts[c.index]),
                finish_reason=c.finish_reason,
                logprobs=self._logprobs(c.logprobs, []),
                token_ids=self._ids(c.token_ids),
            )
            for c in generation.choices
        ]
        return p.ChatCompletionResponse(
            id=self.request_id,
            model=self.model,
            choices=choices,
            usage=generation.usage(),
            # one prompt: every choice has the same
            prompt_logprobs=prompt_logprobs(self.tokenizer, generation.choices[0].prompt_logprobs),
        )


# -- the two ways to answer ------------------------------------------------------------------------


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


async def events(generation: Generation, fmt: Format, options: p.StreamOptions | None) -> AsyncIterator[str]:
    """The SSE body: each choice's opening, its pieces, the usage (when asked), then [DONE]."""
    every_chunk = options is not None and options.usage_in_every_chunk
    try:
        for choice in generation.choices:
            opening = fmt.opening(choice)
            if opening is not None:
                yield sse(opening)
        async for choice, piece in generation.pieces():
            yield sse(fmt.chunk(choice, piece, choice.usage() if every_chunk else None))
        if options is not None and options.include_usage:
            yield sse(fmt.usage_chunk(generation.usage()))
    except GenerationEnded as exc:
        yield sse(exc.api_error.body)
    yield "data: [DONE]\n\n"


class GenerationStreamingResponse(StreamingResponse):
    """SSE whose generation is aborted however the response ends (client gone, task cancelled)."""

    def __init__(self, generation: Generation, fmt: Format, options: p.StreamOptions | None) -> None:
        self._generation, self._content = generation, events(generation, fmt, options)
        super().__init__(self._content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Hazard: a client that disconnected mid-stream. Starlette cancels the stream but never
            # closes our generator; without this abort its requests would run to max_tokens unseen.
            self._generation.abort()
            await self._content.aclose()  # type: ignore[attr-defined]


async def collect(request: Request, generation: Generation, fmt: Format) -> Response:
    """The whole response at once; 499 (nobody reads it) when the client left first."""

    async def texts() -> dict[int, str]:
        parts: dict[int, list[str]] = {c.index: [] for c in generation.choices}
        async for choice, piece in generation.pieces():
            parts[choice.index].append(piece.text)
        return {index: "".join(texts) for index, texts in parts.items()}

    try:
        answered, result = await _until_disconnected(request, texts())
    except GenerationEnded as exc:
        return exc.api_error.response()
    finally:
        generation.abort()  # a no-op once every choice finished; a client that left is aborted here
    if not answered:
        return Response(status_code=499)  # nginx's "client closed request"
    return JSONResponse(fmt.response(generation, result).model_dump())  # type: ignore[arg-type]


async def _until_disconnected(request: Request, work: Awaitable) -> tuple[bool, object]:
    """(True, result of `work`), or (False, None) when the client disconnected first (`work` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return False, None
    return True, task.result()
