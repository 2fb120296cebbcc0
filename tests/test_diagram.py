"""The committed state diagram is generated from the transition table and must not go stale."""

from pathlib import Path

from neuron_async_sm.worker import async_machine as sm
from neuron_async_sm.worker.diagram import state_diagram_dot

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_committed_diagram_matches_the_transition_table():
    committed = (DOCS / "state_machine.dot").read_text(encoding="utf-8")
    assert committed == state_diagram_dot(), "run: neuron-async-sm diagram --output docs/state_machine"


def test_diagram_draws_every_state_and_transition():
    dot = state_diagram_dot()
    for state in sm.STATES:
        assert f"\t{state} [" in dot
    for row in sm.TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for source in sources:
            assert f"\t{source} -> {row['dest']} [" in dot


def test_state_page_documents_every_state():
    page = (DOCS / "state_machine.md").read_text(encoding="utf-8")
    for state in sm.STATES:
        assert f"**{state}**" in page, state
