"""The package's modules form layers: its folders import only the folders below them, nothing but the
entry points and two helpers live at its root, and no module imports a cycle, counting imports inside
functions too (a lazy import hides a cycle or an upward edge from Python, not from a reader)."""

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dapo_train"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package and any subpackage ("dapo_train.config.load")."""
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
    assert {"dapo_train.config.load", "dapo_train.model.loading", "dapo_train.model.lora"} <= set(graph)  # modules
    assert "dapo_train.model.lora" in graph["dapo_train.model.loading"]  # and their imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Each layer folder -> the folders it may import, besides itself and the root helpers (errors, plugins).
# Read bottom up: the maths and the settings know nothing else; the loop and the studies know everything
# below them; nothing but cli.py imports a command's whole stack.
LAYERS = {
    "algo": set(),
    "config": set(),
    "task": {"config"},
    "model": {"config", "task"},
    "tools": set(),
    "rollout": {"config", "model", "tools"},
    "rewards": {"algo", "config", "task", "model", "tools"},  # tool_format reads calls as the rollout does
    "run": {"config", "model"},
    "evaluation": {"config", "task", "model", "tools", "rollout", "rewards", "run"},
    "train": {"algo", "config", "task", "model", "tools", "rollout", "rewards", "run", "evaluation"},
    "study": {"algo", "config", "task", "model", "tools", "rollout", "rewards", "run", "evaluation", "train"},
    "preflight": {"algo", "config", "task", "model", "tools", "rollout", "rewards", "run", "evaluation", "train"},
}
ROOT_MODULES = {"__init__", "__main__", "cli", "errors", "faults", "plugins"}
# import nothing of the package but each other
HELPERS = {"dapo_train.errors", "dapo_train.faults", "dapo_train.plugins"}


def layer_of(module: str) -> str | None:
    """'dapo_train.train.collect.rounds' -> 'train'; a root module -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks LAYERS, as 'importer -> imported'."""
    found = []
    for module, imported in graph.items():
        layer = layer_of(module)
        for target in sorted(imported):
            target_layer = layer_of(target)
            if module in HELPERS:
                allowed = target in HELPERS
            elif layer is None:  # cli.py and the entry points call into every layer
                allowed = True
            elif target_layer is None:  # a layer imports no entry point, only the helpers
                allowed = target in HELPERS
            else:
                allowed = target_layer in LAYERS[layer] | {layer}
            if not allowed:
                found.append(f"{module} -> {target}")
    return found


def test_the_layer_rule_catches_an_upward_import():
    graph = {"dapo_train.rollout.engines": {"dapo_train.train.update.passes", "dapo_train.model.scoring"},
             "dapo_train.algo.objectives": {"dapo_train.plugins", "dapo_train.config.schema"},
             "dapo_train.plugins": {"dapo_train.errors", "dapo_train.config.keys"},
             "dapo_train.model.loading": {"dapo_train.cli", "dapo_train.task.locations"}}
    assert upward_imports(graph) == [
        "dapo_train.rollout.engines -> dapo_train.train.update.passes",
        "dapo_train.algo.objectives -> dapo_train.config.schema",
        "dapo_train.plugins -> dapo_train.config.keys",
        "dapo_train.model.loading -> dapo_train.cli",
    ]


def test_each_folder_imports_only_the_layers_below_it():
    graph = import_graph(PACKAGE)
    assert {layer_of(module) for module in graph} - {None} == set(LAYERS)  # every folder has its rule
    assert upward_imports(graph) == []


def test_only_entry_points_and_helpers_live_at_the_root_and_every_folder_says_what_it_is_for():
    root = {path.stem for path in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert folders == set(LAYERS)
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc.splitlines()) >= 3, folder
        for path in (PACKAGE / folder).glob("*.py"):  # and each module what it owns
            assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), path


def test_the_maths_imports_torch_and_the_standard_library_only():
    third_party = set()
    for path in (PACKAGE / "algo").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            third_party |= {name.split(".")[0] for name in names}
    assert third_party - sys.stdlib_module_names == {"torch", "dapo_train"}


# What plugin authors are told to import (DESIGN.md's interfaces, docs/training.md, docs/benchmarks.md,
# docs/rewards-and-tasks.md, docs/tools.md): these paths are kept whatever moves inside the package.
PUBLIC = {
    "dapo_train.algo": ("policy_loss", "group_advantages", "overlong_penalty", "is_informative_group",
                        "register_policy_loss", "POLICY_LOSSES", "LossSettings", "loss_normalizer",
                        "register_loss_reduction", "RolloutCorrection", "register_rollout_correction"),
    "dapo_train.rewards": ("register", "REWARDS", "extract_answer", "is_correct", "RewardError", "build_rewards",
                           "score"),
    "dapo_train.tools": ("register", "TOOLS", "Tool", "resolve_tools", "tool_schemas", "require_tool_template"),
    "dapo_train.rollout": ("Completion", "EngineSetup", "SamplingSettings", "RolloutEngine", "DecodeLoopEngine",
                           "register_engine", "build_engine", "engine_factory"),
}
DOCUMENTED = re.compile(r"from (dapo_train(?:\.\w+)*) import ([\w, ]+)|(dapo_train(?:\.\w+)+)\.(\w+)")


def test_the_public_import_paths_work_and_cover_what_the_docs_name():
    for module, names in PUBLIC.items():
        package = importlib.import_module(module)
        assert set(names) <= set(package.__all__) and all(hasattr(package, name) for name in names), module
    docs = PACKAGE.parent / "docs"
    named = set()
    for text in [path.read_text(encoding="utf-8") for path in docs.glob("*.md")] + [(PACKAGE.parent / "README.md")
                                                                                    .read_text(encoding="utf-8")]:
        for match in DOCUMENTED.finditer(text):
            module, names = (match[1], match[2].split(",")) if match[1] else (match[3], [match[4]])
            named |= {(module, name.strip()) for name in names}
    assert named and all(name in PUBLIC.get(module, ()) for module, name in named), named
    assert importlib.import_module("dapo_train.rewards").extract_answer("<answer>\n-1,250\n</answer>") == "-1250"
