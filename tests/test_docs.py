"""The docs a reviewer starts from stay current: the design's layout table names every module, the
README links every doc, and the README's state list is the machine's."""

from __future__ import annotations

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
