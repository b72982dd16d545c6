"""The embedded world shipped inside the package: a tiny Qwen2-architecture model and a generated
Chinese word-problem task, so that the whole loop runs offline on a CPU.

`builtin:tiny` (model) and `builtin:tiny-zh-math` (data) resolve to folders under
dapo_train/assets/tiny/; scripts/make_tiny_model.py rebuilds both.
"""

from __future__ import annotations

from pathlib import Path

from dapo_train.config import BUILTIN_DATA, BUILTIN_MODEL

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TINY_MODEL_DIR = ASSETS_DIR / "tiny" / "model"
TINY_DATA_DIR = ASSETS_DIR / "tiny" / "data"


def resolve_model_path(name_or_path: str) -> str:
    """builtin:tiny -> the shipped model folder; anything else unchanged."""
    return str(TINY_MODEL_DIR) if name_or_path == BUILTIN_MODEL else name_or_path


def resolve_data_path(path: str) -> str:
    """builtin:tiny-zh-math -> the shipped data folder (train.jsonl, test.jsonl); else unchanged."""
    return str(TINY_DATA_DIR) if path == BUILTIN_DATA else path


def looks_like_path(name: str) -> bool:
    """A name meant as a local path even if it does not exist: it starts with '.', '/' or '~', or
    has more than one '/' (a hub id is 'owner/name')."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1
