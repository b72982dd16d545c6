"""The generated configuration reference must not drift from the code."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    path = ROOT / "scripts" / "update_config_reference.py"
    spec = importlib.util.spec_from_file_location("update_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_matches_the_code():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert _generator().render(page) == page, "run: python scripts/update_config_reference.py"
    # Every default whole: the longest one (the system prompt) ends as the schema's does.
    assert "</answer>'` |" in page and "...` |" not in page
