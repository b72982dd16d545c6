"""The package's modules form layers: no import cycle, counting imports inside functions too (a
lazy import hides a cycle from Python, not from a reader)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dapo_train"


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """Package modules `source` imports anywhere (top level, functions, methods): `import
    dapo_train.x`, `from dapo_train.x import y`, `from dapo_train import x`, and relative forms."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("dapo_train.")}
        elif isinstance(node, ast.ImportFrom):
            parts = ("dapo_train." * (node.level > 0) + (node.module or "")).strip(".").split(".")
            if parts[0] != "dapo_train":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found |= {alias.name for alias in node.names if alias.name in modules}
    return found & modules


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the package modules it imports."""
    files = {path.stem: path for path in sorted(package.glob("*.py"))}
    names = set(files)
    return {name: imported_modules(path.read_text(encoding="utf-8"), names) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, modules in name order)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every import below it is cycle-free
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "open"
        path.append(name)
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def test_every_kind_of_import_is_an_edge():
    modules = {"a", "b", "c", "d", "e"}
    source = (
        "import dapo_train.a\n"
        "from dapo_train.b import thing\n"
        "def f():\n"
        "    from dapo_train import c, not_a_module\n"
        "class K:\n"
        "    def m(self):\n"
        "        from . import d\n"
        "import torch\n"
    )
    assert imported_modules(source, modules) == {"a", "b", "c", "d"}


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),  # a diamond is no cycle
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
    ],
)
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert {"trainer", "config", "modeling", "lora"} <= set(graph)  # the graph is the package's
    assert "lora" in graph["modeling"]  # and holds its edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
