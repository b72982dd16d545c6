"""The package's modules form layers: no import cycle, counting imports inside functions too (a
lazy import hides a cycle from Python, not from a reader)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dapo_train"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package and any subpackage ("dapo_train.config")."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(module: str, is_package: bool, source: str, modules: set[str]) -> set[str]:
    """Package modules `source` imports anywhere (top level, functions, methods): `import
    dapo_train.x`, `from dapo_train.x import y`, `from dapo_train import x`, and relative forms.
    The package's own __init__ is not an edge: every submodule import runs it."""
    root = module.split(".")[0]
    here = module if is_package else module.rpartition(".")[0]

    def owner(dotted: str) -> str | None:  # the module that defines `dotted` (itself, or its longest prefix)
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted if dotted and dotted != root else None

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            package = here.split(".")
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source_module = ".".join(part for part in (base, node.module) if part)
            for alias in node.names:  # `from package import module` names a module; else a name in one
                target = f"{source_module}.{alias.name}"
                found.add(owner(target if target in modules else source_module))
    return found - {None, module}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the package modules it imports."""
    files = module_files(package)
    names = set(files)
    return {
        name: imported_modules(name, path.name == "__init__.py", path.read_text(encoding="utf-8"), names)
        for name, path in files.items()
    }


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
    modules = {"dapo_train", "dapo_train.a", "dapo_train.b", "dapo_train.c", "dapo_train.d", "dapo_train.sub",
               "dapo_train.sub.e", "dapo_train.sub.f"}
    source = (
        "import dapo_train.a\n"
        "from dapo_train.b import thing\n"
        "def f():\n"
        "    from dapo_train import c, not_a_module\n"
        "class K:\n"
        "    def m(self):\n"
        "        from .. import d\n"
        "        from .f import g\n"
        "import torch\n"
        "from dapo_train.sub.e import h\n"
    )
    assert imported_modules("dapo_train.sub.x", False, source, modules) == {
        "dapo_train.a", "dapo_train.b", "dapo_train.c", "dapo_train.d", "dapo_train.sub.e", "dapo_train.sub.f"
    }


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
    assert {"dapo_train.config", "dapo_train.modeling", "dapo_train.lora"} <= set(graph)  # the package's modules
    assert "dapo_train.lora" in graph["dapo_train.modeling"]  # and their imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
