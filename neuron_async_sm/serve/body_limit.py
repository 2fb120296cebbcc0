"""A cap on request bodies (ASGI middleware): a body over the limit is answered 413 and never kept.

A body that declares its length is judged on the header; one sent in chunks is counted as it
arrives (kept only up to the limit). The refused body is read and dropped before the 413 is sent,
so that the client, which is still sending, gets the answer instead of a reset connection; reading
stops after `DRAIN_MAX_BYTES` or `DRAIN_MAX_S`, whichever comes first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuron_async_sm.serve.errors import ApiError

DRAIN_MAX_BYTES = 1 << 30
DRAIN_MAX_S = 5.0


class BodyLimit:
    """Refuse (via `refuse(size)`, an ApiError) every HTTP request whose body exceeds `limit` bytes."""

    def __init__(self, app: ASGIApp, *, limit: int, refuse: Callable[[str], ApiError]) -> None:
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.limit:
                await _drain(receive, 0)
                await self.refuse(str(declared)).response()(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the client to its declared length
            return
        # Chunked: read it here, up to the limit, then hand it on as one message.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                total = await _drain(receive, size) if message.get("more_body") else size
                await self.refuse(f"at least {total}").response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, size: int) -> int:
    """Read and drop the rest of the body (bounded); the bytes seen in all."""
    deadline = time.monotonic() + DRAIN_MAX_S
    while size <= DRAIN_MAX_BYTES and time.monotonic() < deadline:
        message = await receive()
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    return size


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then http.disconnect, when it comes

    return replay
