"""`neuron-async-sm serve`: the OpenAI-compatible server on FastAPI + uvicorn (`pip install '.[serve]'`).

The engine (and its spawned device process) is built here, on the CLI's `__main__`-guarded path,
before uvicorn starts. SIGTERM / SIGINT: uvicorn stops accepting connections, in-flight requests get
`--shutdown-timeout-s` to finish, then every open one is aborted (its client gets an error); the
engine shuts down and the process exits 0 (SIGTERM) or 130 (SIGINT). `--stats FILE` gets the
engine's statistics then.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from neuron_async_sm.args import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    add_engine_args,
    create_output_file,
    engine_config,
)

SERVE_HELP = """Serve the model over HTTP with the OpenAI API.

Routes: POST /v1/completions, POST /v1/chat/completions (the model's chat template from
chat_template.jinja or tokenizer_config.json), GET /v1/models, POST /tokenize, POST /detokenize,
GET /tokenizer_info, GET /version, GET /health, GET /metrics (Prometheus, vLLM's names). Text needs
a tokenizer.json in the model directory; without one (tiny-llama) prompts are token ids and every
choice carries `token_ids`. --trace records the machine's transitions while it serves; --stats
writes the engine's statistics as JSON when it stops."""

SERVE_EXIT_CODES_HELP = """exit codes: 0 stopped by SIGTERM (new connections refused, open requests given
--shutdown-timeout-s, then aborted); 130 the same on SIGINT (Ctrl-C); 1 the engine died (every open
request ended with an error; restart the server); 2 usage or configuration error, or the port could not
be bound (nothing served)."""


DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # app.py's default (not imported: it needs the extra)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (needs the 'serve' extra)",
        description=SERVE_HELP,
        formatter_class=HelpFormatter,
        epilog=SERVE_EXIT_CODES_HELP,
    )
    add_engine_args(p, progress=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="the `model` clients pass (default: --model)")
    p.add_argument(
        "--max-waiting", type=int, default=256, help="requests beyond this many waiting for a slot get 503 at once"
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="a request body larger than this gets 413 without being kept",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may still run before they are aborted",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        from neuron_async_sm.serve.app import Server, ServeSettings, build_app
        from neuron_async_sm.serve.metrics import ServerMetrics
        from neuron_async_sm.serve.server import serve
    except ImportError as exc:
        extra = "pip install -e '.[serve]' in the checkout"
        print(f"error: serve needs the 'serve' extra ({extra}): {exc}", file=sys.stderr)
        return EXIT_USAGE
    from neuron_async_sm.engine.async_llm import AsyncLLM
    from neuron_async_sm.engine.llm import LLM
    from neuron_async_sm.serve.tokenizer import ServedTokenizer

    if args.max_waiting < 0 or not args.shutdown_timeout_s >= 0 or not 0 <= args.port < 65536:
        print("error: --max-waiting and --shutdown-timeout-s must be >= 0, --port in [0, 65536)", file=sys.stderr)
        return EXIT_USAGE
    if args.max_request_body_bytes < 1:
        print("error: --max-request-body-bytes must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    create_output_file(args.stats, "--stats")  # before the device starts
    tokenizer = ServedTokenizer.load(args.model)
    llm = LLM.from_config(engine_config(args))
    name = args.served_model_name or args.model
    metrics = ServerMetrics(llm, name)
    llm.engine.tracer.subscribe(metrics.on_engine_event)  # step path states, materializations by thread
    engine = AsyncLLM(llm, max_waiting=args.max_waiting, observers=(metrics.observe_turn,))
    try:
        settings = ServeSettings(name, llm.config.max_model_len, args.shutdown_timeout_s, args.max_request_body_bytes)
        server = Server(engine, tokenizer, metrics, settings)
        started = serve(build_app(server), server, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()  # a no-op after the lifespan's shutdown; otherwise stops the engine thread or the LLM
        if args.stats:
            Path(args.stats).write_text(json.dumps(llm.stats(), indent=2) + "\n", encoding="utf-8")
    if not started:
        print(f"error: the server could not start on {args.host}:{args.port}", file=sys.stderr)
        return EXIT_USAGE
    if engine.dead_reason is not None:
        print(f"error: the engine died: {engine.dead_reason}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
