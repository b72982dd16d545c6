"""The docs must not drift from the code: the generated configuration reference, every registered
reward documented with its arguments, and every relative link (and anchor) resolving."""

import importlib.util
import inspect
import re
from pathlib import Path

from dapo_train.rewards import FILLED_ARGS, REWARDS
from dapo_train.rewards.scoring import CALL_KEYWORDS

from doc_markdown import broken_links, section

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _generator():
    path = ROOT / "scripts" / "build" / "update_config_reference.py"
    spec = importlib.util.spec_from_file_location("update_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_matches_the_code():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert _generator().render(page) == page, "run: python scripts/build/update_config_reference.py"
    # Every default whole: the longest one (the system prompt) ends as the schema's does.
    assert "</answer>'` |" in page and "...` |" not in page


def test_every_registered_reward_is_documented_with_its_arguments():
    """docs/rewards-and-tasks.md has a section per registered reward naming each argument it takes
    (from the function's signature, so a new reward or argument fails here until it is written up)."""
    page = (ROOT / "docs" / "rewards-and-tasks.md").read_text(encoding="utf-8")
    for name, entry in REWARDS.items():
        text = section(page, f"### {name}")
        args = [p for p in inspect.signature(entry.fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        for param in args:
            if param.name not in CALL_KEYWORDS:
                assert f"`{param.name}`" in text, (name, param.name)
        assert f"{{name: {name}" in text, f"{name}: no YAML example"
    for arg, key in FILLED_ARGS.items():  # the arguments the trainer fills in, and from where
        assert f"`{arg}`" in page and f"`{key}`" in page, arg


def test_every_relative_link_resolves():
    broken = [problem for page in PAGES for problem in broken_links(page)]
    assert not broken, broken
    assert sum(len(re.findall(r"\]\((?!https?:)", p.read_text(encoding="utf-8"))) for p in PAGES) >= 30


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A heading: with, punctuation\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [ok](other.md#a-heading-with-punctuation), [gone](missing.md), "
        "[no anchor](other.md#nowhere) and [here](#page).\n\n    [in code](not/checked.md)\n"
    )
    assert broken_links(page) == ["page.md: missing.md (no such file)", "page.md: other.md#nowhere (no such heading)"]


def test_the_trl_name_table_names_real_keys():
    """docs/peers.md maps TRL's GRPOConfig names to keys: each dotted key in its 'here' column is one
    `dapo-train config --keys` lists (a renamed key fails here until the table follows)."""
    from dapo_train.config.keys import schema_keys

    page = (ROOT / "docs" / "peers.md").read_text(encoding="utf-8")
    table = section(page, "### TRL's GRPOConfig names and the keys here")
    here = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {key for cell in here for key in re.findall(r"`([a-z_]+\.[a-z0-9_.]+)", cell)}
    assert len(named) > 20 and not named - {info.key for info in schema_keys()}  # > 20: the table was read
