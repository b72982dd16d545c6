"""Tests and scripts read nothing outside the repository: a user's clone has no folder beside it (the GSM8K
files they read ship in data/gsm8k). Every path built from `__file__` in tests/ and scripts/ is followed
through `.parent`, `.parents[k]`, `os.path.dirname` and `/ "part"` (also through module names such as
`ROOT = Path(__file__).resolve().parents[1]`), and must never climb above the repository root; no string
may hold a `..` component or a path of this machine's workspace."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ESCAPING_TEXT = re.compile(r"(^|[\s\"'=(/\\])\.\.([/\\]|$)|(^|[\s\"'=(])/work/|\bshared/data\b", re.MULTILINE)


def _escapes(source: str, relative: str) -> list[str]:
    """The expressions and strings of `source` (the file at `relative` in the repository) that point above
    the repository root, as 'line N: text'."""
    tree = ast.parse(source)
    file_level = len(Path(relative).parts)  # tests/x.py: 2; its .parent is tests (1), the root is 0
    names: dict[str, int] = {}

    def level(node: ast.AST) -> int | None:
        """How many folders below the repository root `node` points, where it derives from __file__."""
        if isinstance(node, ast.Name):
            return file_level if node.id == "__file__" else names.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            base = level(node.value)
            return None if base is None else base - 1
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            base, index = level(node.value.value), node.slice
            if base is not None and isinstance(index, ast.Constant) and isinstance(index.value, int):
                return base - index.value - 1
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base = level(node.left)
            if base is not None and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str):
                return base + len(Path(node.right.value).parts)
            return None
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("resolve", "absolute") and isinstance(func, ast.Attribute) and not node.args:
                return level(func.value)
            if name in ("Path", "PurePath", "abspath", "realpath") and len(node.args) == 1:
                return level(node.args[0])
            if name == "dirname" and len(node.args) == 1:
                base = level(node.args[0])
                return None if base is None else base - 1
        return None

    for _ in range(3):  # names defined from names: settle in a few passes
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                found = level(node.value)
                if found is not None:
                    names[node.targets[0].id] = found
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.expr) and (depth := level(node)) is not None and depth < 0:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ESCAPING_TEXT.search(node.value):
            found.append(f"line {node.lineno}: {node.value[:80]!r}")
    return found


def _files() -> list[Path]:
    """Every Python file of tests/ and scripts/ but this one (its examples below escape on purpose)."""
    return sorted(path for folder in ("tests", "scripts") for path in (ROOT / folder).rglob("*.py")
                  if path != Path(__file__).resolve())


def test_no_test_or_script_reads_outside_the_repository():
    files = _files()
    assert len(files) > 50 and ROOT / "tests" / "task" / "test_answers.py" in files
    found = {str(path.relative_to(ROOT)): _escapes(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
             for path in files}
    assert {name: hits for name, hits in found.items() if hits} == {}
    shell = {str(path.relative_to(ROOT)) for path in (ROOT / "scripts").rglob("*.sh")
             if ESCAPING_TEXT.search(path.read_text(encoding="utf-8"))}
    assert shell == set()


@pytest.mark.parametrize("relative, source", [
    # The reads this test replaced, as they were written.
    ("tests/task/test_answers.py", 'GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"'),
    ("tests/test_qwen_offline.py", 'ROOT = Path(__file__).resolve().parents[1]\nGSM8K = ROOT.parent / "shared"'),
    ("tests/test_preflight.py", 'ROOT = Path(__file__).resolve().parent.parent\nG = ROOT.parent / "shared" / "x"'),
    ("scripts/bench_vs_trl.py", 'SCRIPTS = Path(__file__).resolve().parent\nG = SCRIPTS.parents[1] / "shared"'),
    ("scripts/rollout_record_size.py", 'ROOT = Path(__file__).resolve().parent.parent\nG = ROOT.parent / "x"'),
    ("scripts/x.py", 'HERE = os.path.dirname(os.path.abspath(__file__))\nUP = os.path.dirname(os.path.dirname(HERE))'),
    ("scripts/x.py", 'parser.add_argument("--gsm8k", default="../shared/data/gsm8k")'),
    ("tests/x.py", 'DATA = os.path.join(HERE, "..", "..", "data")'),
    ("tests/x.py", 'DATA = "/work/shared/data/gsm8k/test.jsonl"'),
])
def test_a_path_above_the_repository_is_found(relative, source):
    assert _escapes(source, relative), source


@pytest.mark.parametrize("relative, source", [
    ("tests/task/test_answers.py", 'GSM8K = Path(__file__).resolve().parents[2] / "data" / "gsm8k"'),
    ("tests/test_preflight.py", 'ROOT = Path(__file__).resolve().parent.parent\nG = ROOT / "data" / "gsm8k"'),
    ("scripts/bench_vs_trl.py", 'SCRIPTS = Path(__file__).resolve().parent\nG = SCRIPTS.parent / "data"'),
    ("scripts/bench/bench_vs_trl.py", 'HERE = Path(__file__).resolve().parent\nG = HERE.parents[1] / "data"'),
    ("tests/x.py", 'text = "a..b" + "1...5" + "x.. y"'),
])
def test_a_path_inside_the_repository_is_not_found(relative, source):
    assert _escapes(source, relative) == []


def test_the_shipped_gsm8k_files_are_whole():
    """The counts the tests rely on, with the licence and the source beside them."""
    folder = ROOT / "data" / "gsm8k"
    lines = {name: (folder / name).read_text(encoding="utf-8").count("\n")
             for name in ("test.jsonl", "example_model_solutions.jsonl")}
    assert lines == {"test.jsonl": 1319, "example_model_solutions.jsonl": 1319}
    assert "MIT License" in (folder / "LICENSE").read_text() and "openai/grade-school-math" in (
        folder / "README.md").read_text()
