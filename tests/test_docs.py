"""The README's configuration table is generated from the dataclasses and must not drift."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_reference_matches_the_dataclasses():
    spec = importlib.util.spec_from_file_location("update_readme_config", ROOT / "scripts" / "update_readme_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert module.render(readme) == readme, "run: python scripts/update_readme_config.py"
