"""The OpenAI-compatible HTTP app: routes, request -> engine -> response, errors, the app's lifespan.

Every request ends, whatever happens to it: its stream finishes, or its client leaves (the request is
aborted wherever it is in the engine's two-deep pipeline), or the server's shutdown deadline aborts
it (an error event / 503), or the engine dies (an error event / 500; the server then exits non-zero,
as vLLM's API server does, so that a supervisor restarts it).

Bad input must not hurt the other clients: bodies are capped (`body_limit.py`), text longer than the
context could hold is refused before it is tokenized, and tokenizing and chat rendering run in a
thread, off the event loop that serves every stream and /health.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from neuron_async_sm.engine.async_llm import AsyncLLM, EngineOverloadedError, RequestStream
from neuron_async_sm.engine.core import EngineDeadError
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams
from neuron_async_sm.serve import protocol as p
from neuron_async_sm.serve.body_limit import BodyLimit
from neuron_async_sm.serve.detokenizer import IncrementalText
from neuron_async_sm.serve.errors import ApiError, invalid
from neuron_async_sm.serve.generation import (
    ChatFormat,
    Choice,
    CompletionFormat,
    Format,
    Generation,
    GenerationStreamingResponse,
    collect,
)
from neuron_async_sm.serve.metrics import ServerMetrics
from neuron_async_sm.serve.structured_protocol import structured_outputs_of
from neuron_async_sm.serve.tokenizer import ChatTemplateError, ServedTokenizer
from neuron_async_sm.values import is_int

logger = logging.getLogger("uvicorn.error")  # uvicorn's own: shown beside its "Shutting down" at --log-level

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


def _package_version() -> str:
    try:
        return importlib.metadata.version("neuron_async_sm")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


VERSION = _package_version()


@dataclass(frozen=True)
class ServeSettings:
    model_name: str  # the id clients pass as `model` (and /v1/models lists)
    max_model_len: int  # the engine's, resolved against the model
    shutdown_timeout_s: float  # after SIGTERM, in-flight requests get this long, then are aborted
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get 413 unread


class Server:
    """The routes' shared state: the engine, the text codec, the metrics and the settings."""

    def __init__(
        self, engine: AsyncLLM, tokenizer: ServedTokenizer | None, metrics: ServerMetrics, settings: ServeSettings
    ) -> None:
        self.engine, self.tokenizer, self.metrics, self.settings = engine, tokenizer, metrics, settings
        self._deadline: asyncio.TimerHandle | None = None
        self.exit: Callable[[], None] | None = None  # set by the HTTP server: stop serving (engine died)
        engine.on_dead.append(self._engine_died)

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

    def _engine_died(self, reason: str) -> None:
        """On the loop, once: every open stream already has its error; stop serving and exit non-zero."""
        logger.error("The engine died (%s): the server exits so that its supervisor can restart it", reason)
        if self.exit is not None:
            self.exit()

    def describe(self) -> str:
        """The start-up line: what this server was configured with."""
        config = self.engine.llm.config
        return (
            f"Serving {self.settings.model_name!r} (model {config.model}): max_model_len={config.max_model_len}, "
            f"KV capacity {config.max_num_seqs} sequences x {config.max_model_len} tokens, "
            f"async scheduling {'on' if config.async_scheduling else 'off'}, device {config.device}, "
            f"tensor parallel {config.tensor_parallel_size}, dtype {config.dtype}, "
            f"tokenizer {'yes' if self.tokenizer is not None else 'none (token ids only)'}, "
            f"chat template {'yes' if self.tokenizer is not None and self.tokenizer.chat_template else 'none'}, "
            f"max request body {self.settings.max_request_body_bytes} bytes"
        )

    # -- one request --------------------------------------------------------------------------------

    def check(self, body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        _check_model(self, body.model)
        unsupported = body.unsupported()
        if unsupported is not None:
            raise ApiError(400, f"{unsupported[0]}: {unsupported[1]}", param=unsupported[0])

    def needs_tokenizer(self, param: str, what: str) -> ServedTokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"{param}: {what} need a tokenizer.json in the model directory", param=param)
        return self.tokenizer

    def _too_long(self, prompt_len: int | str, param: str) -> ApiError:
        limit = self.settings.max_model_len
        return ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this model's maximum context length is {limit} "
            "tokens, and at least one must be left for output",
            param=param,
            code="context_length_exceeded",
        )

    async def encode(
        self, text: str, param: str, *, add_special_tokens: bool = True, truncated: bool = False
    ) -> list[int]:
        """Text -> token ids in a thread; text too long to fit is refused without being tokenized,
        unless the request truncates it (truncate_prompt_tokens; the body limit still bounds it)."""
        tokenizer = self.needs_tokenizer(param, "text prompts")
        if not truncated and not tokenizer.may_fit(len(text), self.settings.max_model_len):
            raise self._too_long(f"more than {self.settings.max_model_len}", param)
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_chat(
        self,
        chat: list[p.ChatMessage],
        *,
        add_generation_prompt: bool,
        add_special_tokens: bool = False,
        truncated: bool = False,
    ) -> list[int]:
        """Render the chat template and encode, in a thread; a chat too long to fit is refused unrendered
        unless the request truncates it."""
        tokenizer = self.needs_tokenizer("messages", "chat and its template")
        messages = [{"role": m.role, "content": m.text()} for m in chat]
        chars = sum(len(m["content"]) for m in messages)
        if not truncated and not tokenizer.may_fit(chars, self.settings.max_model_len):
            raise self._too_long(f"more than {self.settings.max_model_len}", "messages")
        try:
            return await asyncio.to_thread(
                tokenizer.encode_chat,
                messages,
                add_generation_prompt=add_generation_prompt,
                add_special_tokens=add_special_tokens,
            )
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from exc

    async def prompt_text(self, prompt: p.Prompt, ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            return ""
        # vLLM's renderer decodes a token-id prompt with its special tokens ("<s>") kept.
        return await asyncio.to_thread(self.tokenizer.decode, ids, skip_special_tokens=False)

    def sampling_params(
        self, body: p.CompletionRequest | p.ChatCompletionRequest, prompt_len: int, max_tokens: int | None
    ) -> SamplingParams:
        limit = self.settings.max_model_len
        if prompt_len >= limit:
            raise self._too_long(prompt_len, "messages" if isinstance(body, p.ChatCompletionRequest) else "prompt")
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
        logprobs = self.logprobs_count(body.logprobs_count, body.logprobs_param)
        prompt_logprobs = self.logprobs_count(body.prompt_logprobs_count, body.prompt_logprobs_param)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k_or_off,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                n=body.n,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                min_p=body.min_p,
                min_tokens=body.min_tokens,
                logit_bias=body.token_bias,
                allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
                bad_words=tuple(body.bad_words),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs_of(body.response_format, body.structured_outputs),
            )
        except InvalidRequestError as exc:
            raise invalid(exc) from exc

    def _truncated(self, ids: list[int], keep: int, side: str | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len - 1), or
        its first with truncation_side "right"."""
        limit = self.settings.max_model_len
        if keep > limit:
            raise ApiError(
                400,
                f"truncate_prompt_tokens: {keep} is more than this model's maximum context length of {limit} tokens",
                param="truncate_prompt_tokens",
            )
        keep = limit - 1 if keep == -1 else keep
        return ids[:keep] if side == "right" else ids[-keep:]

    def _check_sequences(self, count: int) -> None:
        """A request's sequences must fit what the server would ever hold at once (the KV slots and the
        waiting queue), or it could never run: a 400, not a 503 to retry."""
        limit = self.engine.llm.config.max_num_seqs + (self.engine.max_waiting or 0)
        if self.engine.max_waiting is not None and count > limit:
            raise ApiError(
                400,
                f"n: {count} sequences (n times the prompts) exceed the {limit} this server holds at once "
                "(--max-num-seqs + --max-waiting)",
                param="n",
            )

    def logprobs_count(self, count: int | None, param: str) -> int | None:
        """The candidates per token a request's field `param` asks for (vLLM's -1: the whole
        vocabulary), checked against the engine's max_logprobs with a 400 naming the field."""
        if count is None:
            return None
        llm = self.engine.llm
        limit = llm.config.max_logprobs
        resolved = llm.vocab_size if count == -1 else count
        if not is_int(count) or resolved < 0 or resolved > limit:
            raise ApiError(
                400,
                f"{param}: must be an integer in [0, {limit}] (the server's --max-logprobs; -1: the whole "
                f"vocabulary of {llm.vocab_size}), got {count!r}",
                param=param,
            )
        return resolved

    async def _start(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        try:
            return await self.engine.add_request(prompt_ids, params, request_id)
        except InvalidRequestError as exc:
            raise invalid(exc) from exc
        except EngineOverloadedError as exc:
            raise ApiError(
                503, f"the server is overloaded: {exc}; retry later", "service_unavailable", code="overloaded"
            ) from exc
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), "service_unavailable", code="engine_dead") from exc

    async def generate(
        self,
        request: Request,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        make_format: Callable[..., Format],
        prefix: str,
        prompt_texts: list[str] | None = None,
    ) -> Response:
        """Run `n` choices per prompt; answer streamed or collected.

        Every prompt's parameters are checked before any starts; if the engine refuses one, those
        already started are aborted and the whole request gets the refusal.
        """
        if body.truncate_prompt_tokens is not None:
            prompts = [self._truncated(ids, body.truncate_prompt_tokens, body.truncation_side) for ids in prompts]
        params = [self.sampling_params(body, len(ids), max_tokens) for ids in prompts]
        self._check_sequences(len(prompts) * body.n)
        # n sequences of each prompt (vLLM's parallel sampling), prompt-major: choice index = prompt
        # index * n + child, child i seeded seed + i.
        prompts = [ids for ids in prompts for _ in range(body.n)]
        params = [child for sampling in params for child in sampling.children()]
        request_id = f"{prefix}-{body.request_id if body.request_id is not None else uuid.uuid4().hex}"
        choices: list[Choice] = []
        generation = Generation(self.engine, request_id, choices, sequences=body.n)
        try:
            for index, (ids, sampling) in enumerate(zip(prompts, params, strict=True)):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                stream = await self._start(ids, sampling, engine_id)
                text = IncrementalText(self.tokenizer, body.stop_strings, prompt_ids=ids, **body.text_options)
                choice = Choice(index, len(ids), stream, text, prompt_ids=ids)
                choice.prompt_text = prompt_texts[index // body.n] if prompt_texts is not None else ""
                choices.append(choice)
        except BaseException:
            generation.abort()  # the prompts that started before one was refused
            raise
        fmt = make_format(
            request_id,
            self.settings.model_name,
            body.return_token_ids or self.tokenizer is None,
            tokenizer=None if body.return_tokens_as_token_ids else self.tokenizer,  # None: "token_id:<id>"
            logprobs=params[0].logprobs,  # the candidates shown per token (every prompt asks the same)
            echo=getattr(body, "echo", False),
        )
        if body.stream:
            return GenerationStreamingResponse(generation, fmt, body.stream_options)
        return await collect(request, generation, fmt)


def _server(request: Request) -> Server:
    return request.app.state.server


Body = TypeVar("Body", bound=BaseModel)


def json_body(model: type[Body]) -> Callable[[Request], Awaitable[Body]]:
    """A route's body, parsed and validated in one pass over the bytes.

    Hazard: parsing runs on the event loop and holds it for the whole body (a thread would not help:
    the parser keeps the GIL), so --max-request-body-bytes bounds how long one body stalls the other
    streams and /health. One pass (pydantic's own JSON parser) holds it less than json.loads followed
    by validation, FastAPI's way.
    """

    async def parse(request: Request) -> Body:
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            if not any(e["type"] == "json_invalid" for e in exc.errors()):
                raise RequestValidationError(_in_body(exc)) from exc
        # Python's json takes what pydantic's refuses (a lone surrogate "\ud800"): its error says more.
        try:
            data = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise RequestValidationError(
                [{"type": "json_invalid", "loc": ("body",), "ctx": {"error": str(exc)}}]
            ) from exc
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(_in_body(exc)) from exc

    return parse


def _in_body(exc: ValidationError) -> list[dict]:
    return [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]


CompletionBody = Annotated[p.CompletionRequest, Depends(json_body(p.CompletionRequest))]
ChatCompletionBody = Annotated[p.ChatCompletionRequest, Depends(json_body(p.ChatCompletionRequest))]
TokenizeBody = Annotated[p.TokenizeRequest, Depends(json_body(p.TokenizeRequest))]
DetokenizeBody = Annotated[p.DetokenizeRequest, Depends(json_body(p.DetokenizeRequest))]


router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    engine = _server(request).engine
    if engine.dead_reason is not None:
        return ApiError(
            503, f"engine is dead: {engine.dead_reason}", "service_unavailable", code="engine_dead"
        ).response()
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.scrape(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/v1/models")
async def models(request: Request) -> p.ModelList:
    settings = _server(request).settings
    return p.ModelList(data=[p.ModelCard(id=settings.model_name, max_model_len=settings.max_model_len)])


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionBody) -> Response:
    server = _server(request)
    server.check(body)
    prompts = [
        await server.encode(
            prompt,
            "prompt",
            add_special_tokens=body.add_special_tokens,
            truncated=body.truncate_prompt_tokens is not None,
        )
        if isinstance(prompt, str)
        else list(prompt)
        for prompt in body.prompts
    ]
    texts = None
    if body.echo:  # the prompt as written; a token-id prompt decoded (empty without a tokenizer)
        texts = [await server.prompt_text(prompt, ids) for prompt, ids in zip(body.prompts, prompts, strict=True)]
    return await server.generate(request, body, prompts, body.max_tokens, CompletionFormat, "cmpl", texts)


@router.post("/v1/chat/completions")
async def chat(request: Request, body: ChatCompletionBody) -> Response:
    server = _server(request)
    server.check(body)
    prompt = await server.encode_chat(
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        add_special_tokens=body.add_special_tokens,
        truncated=body.truncate_prompt_tokens is not None,
    )
    return await server.generate(request, body, [prompt], body.token_limit, ChatFormat, "chatcmpl", [body.echoed])


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeBody) -> p.TokenizeResponse:
    server = _server(request)
    _check_model(server, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: give either `prompt` (text) or `messages` (a chat)", param="prompt")
    if body.messages is not None:
        add_special = bool(body.add_special_tokens)
        ids = await server.encode_chat(
            body.messages, add_generation_prompt=body.add_generation_prompt, add_special_tokens=add_special
        )
    else:
        add_special = body.add_special_tokens is not False
        ids = await server.encode(body.prompt, "prompt", add_special_tokens=add_special)  # type: ignore[arg-type]
    strs = server.tokenizer.token_strs(ids) if body.return_token_strs and server.tokenizer is not None else None
    return p.TokenizeResponse(count=len(ids), max_model_len=server.settings.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeBody) -> p.DetokenizeResponse:
    server = _server(request)
    _check_model(server, body.model)
    tokenizer = server.needs_tokenizer("tokens", "detokenizing")
    vocab = server.engine.llm.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return p.DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    return _server(request).needs_tokenizer("model", "tokenizer info").info()


def _check_model(server: Server, model: str | None) -> None:
    if model is not None and model != server.settings.model_name:
        raise ApiError(
            404,
            f"model: the model {model!r} does not exist; this server serves {server.settings.model_name!r}",
            param="model",
            code="model_not_found",
        )


# -- errors -----------------------------------------------------------------------------------------


def _refused(request: Request, error: ApiError) -> JSONResponse:
    """Every refusal passes here (the route's own checks, validation, the engine): counted once, logged."""
    code = error.body.error.code
    server = _server(request)
    server.metrics.rejected(code if code in ("overloaded", "engine_dead", "request_too_large") else "invalid")
    logger.info("%s %s -> %d: %s", request.method, request.url.path, error.status, error.message)
    return error.response()


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _refused(request, exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
    # In a union (`stop: str | list[str]`) every member's error is listed: a value's own check says more.
    error = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None  # OpenAI's `param` is the request's field
    where = f" (at {'.'.join(loc)})" if len(loc) > 1 else ""  # e.g. prompt.list[int].1: the union member too
    if error.get("type") == "json_invalid":
        message, param = f"malformed JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    elif error.get("type") == "extra_forbidden":
        what = "not supported by this server" if len(loc) == 1 and loc[0] in p.NOT_SUPPORTED else "unknown field"
        message = f"{'.'.join(loc)}: {what}"
    else:
        message = f"{param}: {error.get('msg')}{where}" if param else str(error.get("msg"))
    return _refused(request, ApiError(400, message, param=param))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: a JSON 500 (never a plain-text traceback), the traceback in the log."""
    logger.exception("%s %s failed", request.method, request.url.path)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()


def build_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        logger.info(server.describe())
        try:
            yield
        finally:
            await server.engine.shutdown()

    app = FastAPI(title="neuron_async_sm", version=VERSION, lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)

    def too_large(size: str) -> ApiError:
        limit = server.settings.max_request_body_bytes
        server.metrics.rejected("request_too_large")
        message = f"the request body is {size} bytes; this server takes at most {limit} (--max-request-body-bytes)"
        logger.info("-> 413: %s", message)
        return ApiError(413, message, code="request_too_large")

    app.add_middleware(BodyLimit, limit=server.settings.max_request_body_bytes, refuse=too_large)
    return app
