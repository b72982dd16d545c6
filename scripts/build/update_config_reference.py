"""Rewrite the generated part of docs/configuration.md (every config key, every registered reward) from
the config dataclasses and the reward registry.

    python scripts/build/update_config_reference.py

tests/test_docs.py fails when the page and the code disagree.
"""

from pathlib import Path

from dapo_train.config.keys import reference_table
from dapo_train.rewards.catalogue import reward_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
REWARDS_START, REWARDS_END = "<!-- reward-reference:start -->", "<!-- reward-reference:end -->"


def _replace(page: str, start: str, end: str, body: str) -> str:
    head, rest = page.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def render(page: str) -> str:
    return _replace(_replace(page, START, END, reference_table()), REWARDS_START, REWARDS_END, reward_table())


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
