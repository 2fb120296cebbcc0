"""uvicorn, run so that a signal drains the server instead of cutting its streams.

On SIGTERM / SIGINT uvicorn closes the listening socket and waits for open connections; the server's
drain (started from the same signal) aborts whatever is still open after `shutdown_timeout_s`, so
those connections end too. uvicorn's own graceful timeout is only a backstop behind it.
"""

from __future__ import annotations

import asyncio
import signal

import uvicorn
from fastapi import FastAPI

from neuron_async_sm.serve.app import Server

BACKSTOP_S = 10.0  # uvicorn cancels the tasks still running this long after the server's own deadline


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handler also starts the server's shutdown deadline."""

    def __init__(self, config: uvicorn.Config, server: Server) -> None:
        super().__init__(config)
        self.app_server = server

    def handle_exit(self, sig: int, frame: object) -> None:
        super().handle_exit(sig, frame)  # type: ignore[arg-type]
        try:
            loop = asyncio.get_running_loop()  # a signal handler runs on the main thread, inside the loop
        except RuntimeError:
            return
        loop.call_soon_threadsafe(self.app_server.begin_drain)


def serve(app: FastAPI, server: Server, *, host: str, port: int, log_level: str) -> bool:
    """Run until a signal has drained the server; False if it never started (e.g. the port is taken)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=server.settings.shutdown_timeout_s + BACKSTOP_S,
    )
    uv = DrainingServer(config, server)

    def stop() -> None:  # the engine died: stop serving; run_serve then exits non-zero
        uv.should_exit = True

    server.exit = stop
    received: list[int] = []
    # uvicorn re-raises the signal it caught once it has shut down. With this handler in place the
    # re-raised SIGTERM is recorded instead of killing the process: a drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        uv.run()
    except SystemExit:  # uvicorn exits this way when it cannot bind or its lifespan fails
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)
    return uv.started
