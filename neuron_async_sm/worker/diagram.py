"""The state diagram, drawn by `transitions`' GraphMachine from the one transition table."""

from __future__ import annotations

import shutil
from pathlib import Path

from transitions.extensions import GraphMachine

from neuron_async_sm.worker import async_machine as sm


def state_diagram_dot() -> str:
    """DOT source of the step machine, derived from async_machine.TRANSITIONS."""
    machine = GraphMachine(
        model=_DiagramModel(),
        states=list(sm.STATES),
        transitions=[dict(row) for row in sm.TRANSITIONS],
        initial=sm.IDLE,
        auto_transitions=False,
        show_conditions=True,
        title="neuron_async_sm worker: async step machine",
        graph_engine="graphviz",
    )
    return machine.models[0].get_graph().source


def write_state_diagram(output: str) -> list[Path]:
    """Write OUTPUT.dot, plus OUTPUT.svg and OUTPUT.png where the `dot` program is installed."""
    base = Path(output)
    base = base.with_suffix("") if base.suffix in (".dot", ".svg", ".png") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    dot_path = base.with_suffix(".dot")
    source = state_diagram_dot()
    dot_path.write_text(source, encoding="utf-8")
    written = [dot_path]
    if shutil.which("dot"):
        import graphviz

        for fmt in ("svg", "png"):
            graphviz.Source(source).render(outfile=str(base.with_suffix(f".{fmt}")), format=fmt, cleanup=True)
            written.append(base.with_suffix(f".{fmt}"))
    return written


class _DiagramModel:
    """A bare model for GraphMachine; the diagram needs no behaviour."""
