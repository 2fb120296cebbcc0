"""The OpenAI-compatible HTTP app: routes, request -> engine -> response, SSE, errors, disconnects.

Every request ends, whatever happens to it: its stream finishes, or its client leaves (the request is
aborted wherever it is in the engine's two-deep pipeline), or the server's shutdown deadline aborts
it (an error event / 503), or the engine dies (an error event / 500, and /health turns 503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from neuron_async_sm.engine.async_llm import AsyncLLM, EngineOverloadedError, RequestStream
from neuron_async_sm.engine.core import EngineDeadError
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams
from neuron_async_sm.serve import protocol as p
from neuron_async_sm.serve.metrics import ServerMetrics
from neuron_async_sm.serve.tokenizer import ChatTemplateError, IncrementalText, ServedTokenizer

logger = logging.getLogger("uvicorn.error")  # uvicorn's own: shown beside its "Shutting down" at --log-level


@dataclass(frozen=True)
class ServeSettings:
    model_name: str  # the id clients pass as `model` (and /v1/models lists)
    max_model_len: int  # the engine's, resolved against the model
    shutdown_timeout_s: float  # after SIGTERM, in-flight requests get this long, then are aborted


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body = (
            status,
            p.ErrorResponse(error=p.ErrorInfo(message=message, type=type_, param=param, code=code)),
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status)


class GenerationEnded(Exception):
    """The engine ended the request without a result: `abort` (shutdown deadline) or `error` (engine failure)."""

    def __init__(self, reason: str, detail: str | None) -> None:
        super().__init__(detail or reason)
        self.api_error = (
            ApiError(503, "the server is shutting down; the request was aborted", "service_unavailable", code="abort")
            if reason == "abort"
            else ApiError(500, f"the engine failed: {detail}", "server_error", code="engine_error")
        )


@dataclass(frozen=True)
class Piece:
    """What one engine step adds to a response."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" on the last piece


def _field_of(message: str) -> str | None:
    """Engine errors start with the field they are about ("max_tokens: ..."); the API calls the prompt `prompt`."""
    head = message.split(":", 1)[0]
    return {"prompt_token_ids": "prompt"}.get(head, head) if head.isidentifier() else None


def _invalid(exc: Exception) -> ApiError:
    return ApiError(400, str(exc), param=_field_of(str(exc)))


class Server:
    """The routes' shared state: the engine, the text codec, the metrics and the settings."""

    def __init__(
        self, engine: AsyncLLM, tokenizer: ServedTokenizer | None, metrics: ServerMetrics, settings: ServeSettings
    ) -> None:
        self.engine, self.tokenizer, self.metrics, self.settings = engine, tokenizer, metrics, settings
        self._deadline: asyncio.TimerHandle | None = None

    def begin_drain(self) -> None:
        """SIGTERM (on the loop): in-flight requests get shutdown_timeout_s, then every open one is aborted."""
        if self._deadline is None:
            timeout_s = self.settings.shutdown_timeout_s
            logger.info("Draining: %d open requests get %g s to finish", self.engine.num_open, timeout_s)
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(timeout_s, self._abort_at_deadline)

    def _abort_at_deadline(self) -> None:
        if self.engine.num_open:
            logger.warning(
                "Aborting %d requests still open after %g s", self.engine.num_open, self.settings.shutdown_timeout_s
            )
        self.engine.abort_all()

    # -- one request --------------------------------------------------------------------------------

    def sampling_params(
        self, body: p.CompletionRequest | p.ChatCompletionRequest, prompt_len: int, max_tokens: int | None
    ) -> SamplingParams:
        limit = self.settings.max_model_len
        if prompt_len >= limit:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; this model's maximum context length is {limit} "
                "tokens, and at least one must be left for output",
                param="messages" if isinstance(body, p.ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens: {max_tokens} output tokens after a {prompt_len}-token prompt exceed "
                f"this model's maximum context length of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if body.stop_strings and self.tokenizer is None:
            raise ApiError(
                400, "stop: stop strings need a tokenizer.json in the model directory; use stop_token_ids", param="stop"
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k or 0,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
            )
        except InvalidRequestError as exc:
            raise _invalid(exc) from exc

    async def start(self, prompt_ids: list[int], params: SamplingParams, prefix: str) -> RequestStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add_request(prompt_ids, params, request_id)
        except InvalidRequestError as exc:
            raise _invalid(exc) from exc
        except EngineOverloadedError as exc:
            raise ApiError(
                503, f"the server is overloaded: {exc}; retry later", "service_unavailable", code="overloaded"
            ) from exc
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), "service_unavailable", code="engine_dead") from exc

    async def pieces(self, stream: RequestStream, text: IncrementalText) -> AsyncIterator[Piece]:
        """The request's pieces until it finishes; a stop string ends it here (and aborts it in the engine)."""
        async for delta in stream:
            reason = delta.finish_reason
            if reason in ("abort", "error"):
                raise GenerationEnded(reason, delta.error)
            piece = text.push(delta.new_token_ids, final=reason is not None)
            if text.stopped:
                self.engine.abort(stream.request_id, finish_reason="stop")  # the engine would go on otherwise
                yield Piece(piece, delta.new_token_ids, "stop")
                return
            yield Piece(piece, delta.new_token_ids, reason)


def _sse(model: object) -> str:
    data = model.model_dump_json(exclude_none=False) if hasattr(model, "model_dump_json") else json.dumps(model)
    return f"data: {data}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """SSE whose request is aborted however the response ends (client gone, task cancelled)."""

    def __init__(self, content: AsyncIterator[str], engine: AsyncLLM, stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._engine, self._stream, self._content = engine, stream, content

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Hazard: a client that disconnected mid-stream. Starlette cancels the stream but never
            # closes our generator; without this abort its request would run to max_tokens unseen.
            self._engine.abort(self._stream.request_id)
            await self._content.aclose()  # type: ignore[attr-defined]


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


def build_app(server: Server) -> FastAPI:
    engine, settings = server.engine, server.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="neuron_async_sm", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        # Every refusal passes here (the route's own checks and the engine's): counted once, by kind.
        code = exc.body.error.code
        server.metrics.rejected(code if code in ("overloaded", "engine_dead") else "invalid")
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None  # OpenAI's `param` is the request's field
        where = f" (at {'.'.join(loc)})" if len(loc) > 1 else ""  # e.g. prompt.list[int].1: the union member too
        if error.get("type") == "json_invalid":
            message, param = f"malformed JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        elif error.get("type") == "extra_forbidden":
            message = f"{'.'.join(loc)}: unknown field"
        else:
            message = f"{param}: {error.get('msg')}{where}" if param else str(error.get("msg"))
        server.metrics.rejected("invalid")
        return ApiError(400, message, param=param).response()

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_reason is not None:
            return ApiError(
                503, f"engine is dead: {engine.dead_reason}", "service_unavailable", code="engine_dead"
            ).response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=settings.model_name, max_model_len=settings.max_model_len)])

    def check(body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        if body.model != settings.model_name:
            raise ApiError(
                404,
                f"model: the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        unsupported = body.unsupported()
        if unsupported is not None:
            raise ApiError(400, f"{unsupported[0]}: {unsupported[1]}", param=unsupported[0])

    def token_ids_of(body: p.CompletionRequest | p.ChatCompletionRequest, ids: list[int]) -> list[int] | None:
        return list(ids) if body.return_token_ids or server.tokenizer is None else None

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        check(body)
        if isinstance(body.prompt, str):
            if server.tokenizer is None:
                raise ApiError(
                    400,
                    "prompt: text prompts need a tokenizer.json in the model directory; give token ids",
                    param="prompt",
                )
            prompt_ids = server.tokenizer.encode(body.prompt)
        else:
            prompt_ids = body.prompt
        params = server.sampling_params(body, len(prompt_ids), body.max_tokens)
        stream = await server.start(prompt_ids, params, "cmpl")
        text = IncrementalText(server.tokenizer, body.stop_strings)

        def chunk(
            text_piece: str, ids: list[int], reason: str | None, usage: p.Usage | None = None, choices: bool = True
        ) -> p.CompletionResponse:
            choice = p.CompletionChoice(text=text_piece, finish_reason=reason, token_ids=token_ids_of(body, ids))
            return p.CompletionResponse(
                id=stream.request_id, model=settings.model_name, choices=[choice] if choices else [], usage=usage
            )

        if body.stream:

            async def events() -> AsyncIterator[str]:
                n = 0
                try:
                    async for piece in server.pieces(stream, text):
                        n += len(piece.token_ids)
                        yield _sse(chunk(piece.text, piece.token_ids, piece.finish_reason))
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield _sse(chunk("", [], None, p.usage(len(prompt_ids), n), choices=False))
                except GenerationEnded as exc:
                    yield _sse(exc.api_error.body)
                yield "data: [DONE]\n\n"

            return EngineStreamingResponse(events(), engine, stream)

        async def collect() -> p.CompletionResponse:
            pieces = [piece async for piece in server.pieces(stream, text)]
            ids = [t for piece in pieces for t in piece.token_ids]
            return chunk(
                "".join(x.text for x in pieces), ids, pieces[-1].finish_reason, p.usage(len(prompt_ids), len(ids))
            )

        return await run_collect(request, stream, collect())

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Response:
        check(body)
        if server.tokenizer is None:
            raise ApiError(
                400,
                "messages: chat needs a tokenizer.json and a chat template in the model directory",
                param="messages",
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = server.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        params = server.sampling_params(body, len(prompt_ids), body.token_limit)
        stream = await server.start(prompt_ids, params, "chatcmpl")
        text = IncrementalText(server.tokenizer, body.stop_strings)

        def chunk(delta: p.ChatDelta, ids: list[int], reason: str | None) -> p.ChatCompletionChunk:
            choice = p.ChatChunkChoice(delta=delta, finish_reason=reason, token_ids=token_ids_of(body, ids))
            return p.ChatCompletionChunk(id=stream.request_id, model=settings.model_name, choices=[choice])

        if body.stream:

            async def events() -> AsyncIterator[str]:
                n = 0
                try:
                    yield _sse(chunk(p.ChatDelta(role="assistant", content=""), [], None))
                    async for piece in server.pieces(stream, text):
                        n += len(piece.token_ids)
                        yield _sse(chunk(p.ChatDelta(content=piece.text), piece.token_ids, piece.finish_reason))
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield _sse(
                            p.ChatCompletionChunk(
                                id=stream.request_id,
                                model=settings.model_name,
                                choices=[],
                                usage=p.usage(len(prompt_ids), n),
                            )
                        )
                except GenerationEnded as exc:
                    yield _sse(exc.api_error.body)
                yield "data: [DONE]\n\n"

            return EngineStreamingResponse(events(), engine, stream)

        async def collect() -> p.ChatCompletionResponse:
            pieces = [piece async for piece in server.pieces(stream, text)]
            ids = [t for piece in pieces for t in piece.token_ids]
            message = p.AssistantMessage(content="".join(x.text for x in pieces))
            choice = p.ChatChoice(
                message=message, finish_reason=pieces[-1].finish_reason, token_ids=token_ids_of(body, ids)
            )
            return p.ChatCompletionResponse(
                id=stream.request_id,
                model=settings.model_name,
                choices=[choice],
                usage=p.usage(len(prompt_ids), len(ids)),
            )

        return await run_collect(request, stream, collect())

    async def run_collect(request: Request, stream: RequestStream, work: Awaitable) -> Response:
        try:
            answered, result = await _until_disconnected(request, work)
        except GenerationEnded as exc:
            return exc.api_error.response()
        finally:
            engine.abort(stream.request_id)  # a no-op once it finished; a client that left is aborted here
        if not answered:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return JSONResponse(result.model_dump())  # type: ignore[attr-defined]

    return app
