"""`neuron-async-sm diagram`: the worker's state machine drawn from its transition table."""

from __future__ import annotations

import argparse
import sys

from neuron_async_sm.args import EXIT_OK, HelpFormatter


def add_diagram_parser(sub: argparse._SubParsersAction) -> None:
    diagram = sub.add_parser(
        "diagram", help="draw the worker's state machine from its transition table", formatter_class=HelpFormatter
    )
    diagram.add_argument("--output", default="docs/state_machine", help="path without suffix (.dot/.svg/.png)")
    diagram.set_defaults(func=run_diagram)


def run_diagram(args: argparse.Namespace) -> int:
    from neuron_async_sm.worker.diagram import write_state_diagram

    written = write_state_diagram(args.output)
    for path in written:
        print(f"wrote {path}")
    if len(written) == 1:  # only the DOT source: Graphviz's `dot` is missing
        svg = written[0].with_suffix(".svg")
        print(
            f"note: SVG/PNG need Graphviz's `dot` (apt-get install graphviz, then rerun), or render the "
            f"source elsewhere: dot -Tsvg {written[0]} -o {svg}",
            file=sys.stderr,
        )
    return EXIT_OK
