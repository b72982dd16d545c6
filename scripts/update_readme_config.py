"""Rewrite the README's configuration reference table from the config dataclasses.

    python scripts/update_readme_config.py

tests/test_docs.py fails when the README and the dataclasses disagree.
"""

from pathlib import Path

from dapo_train.config import reference_table

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_table()}\n{END}{tail}"


if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "README.md"
    path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
