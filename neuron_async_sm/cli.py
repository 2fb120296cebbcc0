"""`neuron-async-sm`: generate from a JSONL file, run the demo, draw the state diagram, benchmark."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from neuron_async_sm.args import EXIT_CODES_HELP, EXIT_USAGE, HelpFormatter
from neuron_async_sm.bench.command import add_bench_parser
from neuron_async_sm.config import ConfigError
from neuron_async_sm.diagram_command import add_diagram_parser
from neuron_async_sm.generate import add_generate_parsers
from neuron_async_sm.model import ModelLoadError
from neuron_async_sm.runtime import DeviceStartupError
from neuron_async_sm.serve.command import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    """The subcommands, each registered by its own module."""
    parser = argparse.ArgumentParser(
        prog="neuron-async-sm", description=__doc__, epilog=EXIT_CODES_HELP, formatter_class=HelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine stats periodically")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parsers(sub)  # generate, demo
    add_diagram_parser(sub)
    add_bench_parser(sub)  # bench, bench serve
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse exits with EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, OSError) as exc:
        print(f"error: {exc or type(exc).__name__}", file=sys.stderr)  # never an empty message
        return EXIT_USAGE
    except DeviceStartupError as exc:
        # The model is loaded inside the device; its message ends with the device-side traceback,
        # whose last line is the cause (e.g. "ModelLoadError: model directory X has no checkpoint").
        cause = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or ["unknown cause"]
        print(f"error: the device failed to start: {cause[0]}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside a run (start-up, diagram): one line, not a traceback
        print("\ninterrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
