"""The package's imports run one way: downwards through the layers of docs/design.md, no import
cycle, and nothing imports the command line's entry.

Every import counts, at module level or inside a function (a cycle hidden in a function is still a
cycle: the modules cannot be understood, or moved, one without the other). The cycle and CLI checks
also run as `python3 ../shared/tools/import-cycles neuron_async_sm` where the shared tools sit
beside the clone.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neuron_async_sm"
CLI = "neuron_async_sm.cli"

LAYERS: tuple[tuple[str, ...], ...] = (
    # Top first: a module imports from its own layer and those below it. A package name covers its
    # modules; the package itself (`neuron_async_sm/__init__.py`, the public API) is "neuron_async_sm".
    ("neuron_async_sm.cli", "neuron_async_sm.__main__"),
    (
        "neuron_async_sm",
        "neuron_async_sm.generate",
        "neuron_async_sm.diagram_command",
        "neuron_async_sm.results_file",
        "neuron_async_sm.serve",
        "neuron_async_sm.bench",
        "neuron_async_sm.vllm_plugin",  # an adapter over the engine and the worker, like serve
    ),
    ("neuron_async_sm.args",),
    ("neuron_async_sm.engine",),
    ("neuron_async_sm.worker", "neuron_async_sm.scheduler"),
    (
        "neuron_async_sm.outputs",
        "neuron_async_sm.request",
        "neuron_async_sm.sampling_params",
        "neuron_async_sm.structured_output",
        "neuron_async_sm.trace",
    ),
    ("neuron_async_sm.runtime", "neuron_async_sm.model"),
    ("neuron_async_sm.config",),
    ("neuron_async_sm.errors", "neuron_async_sm.values"),
)

# Cycles and upward imports the tree still has, each to be removed by a change of its own: the lists
# only ever shrink.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package's own ancestors left out: importing
    `a.b.c` runs `a/__init__`, which is not a dependency of `a.b.c`'s design)."""
    files = {}
    for path in package.rglob("*.py"):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from ..x import y` inside a.b.c is a.x
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]  # y may be a module
            else:
                continue
            for target in targets:
                while target and target not in files:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def layer_of(module: str) -> int | None:
    """The index of `module`'s layer in LAYERS (0 is the top); None when no layer names it."""
    for depth, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name != "neuron_async_sm" and module.startswith(name + ".")):
                return depth
    return None


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    graph = import_graph()
    assert "neuron_async_sm.args" in graph[CLI]  # module level, absolute
    assert "neuron_async_sm.runtime.host_runtime" in graph["neuron_async_sm.runtime.create"]  # relative
    assert "neuron_async_sm.serve.app" in graph["neuron_async_sm.serve.command"]  # inside a function


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_package_has_no_import_cycle():
    new = [sorted(cycle) for cycle in cycles(import_graph()) if cycle not in KNOWN_CYCLES]
    assert new == [], "import cycles: move what both sides need to a module both can import downwards"


def test_nothing_in_the_package_imports_the_cli():
    graph = import_graph()
    users = sorted(name for name, imported in graph.items() if CLI in imported and not name.endswith("__main__"))
    assert users == [], f"{CLI} only registers subcommands; the shared pieces live in neuron_async_sm/args.py"


def test_every_module_has_a_layer():
    assert sorted(m for m in import_graph() if layer_of(m) is None) == [], "add it to LAYERS (and docs/design.md)"


def test_imports_go_down_the_layers():
    upward = sorted(
        (name, target)
        for name, imported in import_graph().items()
        for target in imported
        if (layer_of(name) or 0) > (layer_of(target) or 0) and (name, target) not in KNOWN_UPWARD
    )
    assert upward == [], "a lower layer imports a higher one: move what it needs down"
