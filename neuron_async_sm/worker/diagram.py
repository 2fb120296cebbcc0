"""The state diagram, drawn by `transitions`' GraphMachine from the one transition table and the plans."""

from __future__ import annotations

import shutil
from pathlib import Path

from transitions.extensions import GraphMachine
from transitions.extensions.states import Tags, add_state_features

from neuron_async_sm.worker import async_machine as sm


def state_diagram_dot() -> str:
    """DOT source of the step machine, derived from async_machine.TRANSITIONS; a path state's node
    also shows its plan (async_machine.PLANS)."""
    machine = _PlanGraphMachine(
        model=_DiagramModel(),
        states=[{"name": state, "tags": plan_tags(state)} for state in sm.STATES],
        transitions=[dict(row) for row in sm.TRANSITIONS],
        initial=sm.IDLE,
        auto_transitions=False,
        show_conditions=True,
        show_state_attributes=True,
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


def plan_tags(state: str) -> list[str]:
    """A path state's plan as node tags, e.g. `[materialize first, input: cpu]`; none for a rest state."""
    plan = sm.PLANS.get(state)
    if plan is None:
        return []
    return [*(["materialize first"] if plan.materialize_first else []), f"input: {plan.input_source.value}"]


@add_state_features(Tags)
class _PlanGraphMachine(GraphMachine):
    """GraphMachine whose states carry tags; the diagram prints them in the node."""


class _DiagramModel:
    """A bare model for GraphMachine; the diagram needs no behaviour."""
