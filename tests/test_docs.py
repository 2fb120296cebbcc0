"""The docs a reviewer starts from stay current: the design's layout table names every module, the
README links every doc, the README's state list is the machine's, and docs/testing.md's tables name
every rule and invariant of the two stateful machines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from neuron_async_sm.worker.async_machine import STATES

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "neuron_async_sm"


def layout_table() -> set[str]:
    """The `file` column of docs/design.md's Layout table, as paths relative to the package."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for row in re.findall(r"^\| ([^|]+) \|", section, flags=re.M):
        named |= set(re.findall(r"`([\w/.]+\.py)`", row))
    return named


def test_the_layout_table_names_every_module_and_only_modules_that_exist():
    skip = ("__init__.py", "__main__.py")
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name not in skip}
    named = layout_table()
    assert sorted(modules - named) == [], "modules missing from docs/design.md's Layout table"
    assert sorted(named - modules) == [], "docs/design.md's Layout table names files that do not exist"


def test_the_readme_links_every_doc():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    docs = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert sorted(d for d in docs if f"({d})" not in readme) == []


def test_the_readme_names_every_state_of_the_machine():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert sorted(s for s in STATES if s not in readme) == []


def _decorated(path: Path, cls: str, decorator: str) -> set[str]:
    """Methods of `cls` in `path` decorated with hypothesis's `@decorator(...)`, read from the source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {
        f.name
        for f in node.body
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == decorator for d in f.decorator_list)
    }


def _first_column(section: str, header: str) -> set[str]:
    """The backticked names in the first column of the table under `| header |` in docs/testing.md's `section`."""
    text = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    table = body.split(f"| {header} |", 1)[1].split("\n\n", 1)[0]
    return {name for cell in re.findall(r"^\| ([^|]+) \|", table, flags=re.M) for name in re.findall(r"`(\w+)`", cell)}


def test_testing_md_lists_every_rule_and_invariant_of_the_stateful_machines():
    engine = REPO / "tests" / "test_stateful_engine.py"
    section = "The engine against a reference"
    assert _first_column(section, "rule") == _decorated(engine, "EngineVsReference", "rule")
    assert _first_column(section, "invariant") == _decorated(engine, "EngineVsReference", "invariant")
    machine = REPO / "tests" / "test_stateful_machine.py"
    section = "The machine alone"
    assert _first_column(section, "rule") == _decorated(machine, "AsyncStepMachineVsTable", "rule")
