"""A run's folder name: the automatic run_name, and the file system's limit on a folder name, both
settled before anything loads.

The automatic name is the config file's stem and one `label=value` part per KEY=VALUE override that
changes what is trained, sorted by key (the order on the command line does not matter):
`qwen1.5b_eps_high=0.4_max_steps=200`. Overrides that leave the experiment as it was name nothing, so
the same experiment keeps its folder (and a bare `--resume` finds it): where the run writes and what
it shows, evaluates or keeps (COSMETIC_KEYS, the eval, checkpoint and logging sections), the data's
column names, and settings that change only speed or memory, not the numbers (UNNAMED_KEYS). A model
or data path names the run by its last part, and only where that differs from the config's own: a
local copy (`./Qwen2.5-1.5B-Instruct` for `Qwen/Qwen2.5-1.5B-Instruct`) is the same experiment. A
value that is long or not plain text (a system prompt) is named by a 6-digit hash of itself, and a
name past NAME_LENGTH keeps the parts that fit and ends in an 8-digit hash of every named setting, so
two runs' names differ whenever their named settings do. A YAML comment after a value (`1e-4 # why`) is
no part of it, as the config reads it. The whole overrides are in config.yaml.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import yaml

from dapo_train.config.keys import COSMETIC_KEYS
from dapo_train.errors import ConfigError

NAME_LENGTH = 80  # characters of an automatic name: a folder name a person reads at a glance
_VALUE_LENGTH = 24  # a value longer than this is named by its hash
_NAME_MAX = 255  # bytes of one file or folder name where the file system does not say (ext4, xfs, btrfs, APFS)

# Keys (or whole sections) whose overrides never name a run: how fast or in how much memory it
# computes the same numbers, what it evaluates, keeps or shows, the data's columns.
UNNAMED_KEYS = (
    *COSMETIC_KEYS, "eval", "checkpoint", "logging", "data.prompt_field", "data.answer_field", "data.eval_split",
    "model.trust_remote_code", "model.attn_implementation", "model.gradient_checkpointing",
    "rollout.generation_batch_size", "rollout.engine", "rollout.compile", "train.micro_batch_size",
    "train.micro_batch_tokens", "train.logprob_chunk_mib", "train.shared_prefix", "train.deterministic",
    "train.num_threads", "train.max_bad_steps", "train.max_starved_steps",
)
# Paths that name a run by their last part, under a label of their own.
PATH_LABELS = {"model.name_or_path": "model", "data.path": "data"}


def _digest(text: str, digits: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:digits]


def _last_part(path: object) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _named(key: str, value: str, configured: dict) -> bool:
    """Whether an override of `key` to `value` changes the experiment (and so names the run)."""
    if any(key == unnamed or key.startswith(unnamed + ".") for unnamed in UNNAMED_KEYS):
        return False
    return key not in PATH_LABELS or _last_part(value) != _last_part(configured.get(key, ""))


def _without_comment(value: str) -> str:
    """The value text without a trailing YAML comment (`1e-4 # the paper's` -> `1e-4`), which the config drops
    when it reads the value: a comment is no setting, and must not name a run. A `#` the value holds (quoted,
    or inside a word) stays."""
    for comment in re.finditer(r"\s#", value):
        try:
            if yaml.safe_load(value[: comment.start()]) == yaml.safe_load(value):
                return value[: comment.start()].strip()
        except yaml.YAMLError:
            return value
    return value


def name_part(key: str, value: str) -> str:
    """`label=value`: a path by its last part, a value that is long or not plain text by its hash."""
    label = PATH_LABELS.get(key) or key.rsplit(".", 1)[-1]
    text = _last_part(value) if key in PATH_LABELS else value
    plain = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")
    if len(plain) > _VALUE_LENGTH or not re.search(r"[A-Za-z0-9]", plain):
        plain = _digest(value, 6)
    return f"{label}={plain}"


def default_run_name(config_path: str | None, overrides: list[str], configured: dict) -> str:
    """The run's name from its config file and KEY=VALUE overrides (see the module docstring).
    configured: the flattened config before the overrides (defaults <- file), for the paths it names."""
    stem = Path(config_path).stem if config_path else "tiny-cpu"
    settings = sorted((key.strip(), _without_comment(value))
                      for key, _, value in (item.partition("=") for item in overrides))
    settings = [(key, value) for key, value in settings if _named(key, value, configured)]
    parts = [name_part(key, value) for key, value in settings]
    name = "_".join([stem, *parts])
    if len(name) <= NAME_LENGTH:
        return name
    digest = _digest("\n".join(f"{key}={value}" for key, value in settings), 8)
    kept = stem
    for part in parts:
        if len(kept) + len(part) + len(digest) + 2 > NAME_LENGTH:
            break
        kept += "_" + part
    return f"{kept}_{digest}"


def _name_max(folder: Path) -> int:
    """The longest file name, in bytes, that the file system holding `folder` (or its nearest existing
    parent) allows."""
    for place in (folder, *folder.parents):
        try:
            if place.is_dir():
                return os.pathconf(place, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):  # a name past the limit; no pathconf on Windows
            continue
    return _NAME_MAX


def check_folder_name(output_dir: str, key: str, fix: str) -> None:
    """Refuse (ConfigError on `key`, saying `fix`) an output_dir with a file or folder name longer than
    its file system allows: creating it would fail only after the model and data had loaded."""
    folder = Path(output_dir).expanduser().absolute()
    limit = _name_max(folder)
    for name in Path(output_dir).parts:
        size = len(os.fsencode(name))
        if size > limit:
            shown = name if len(name) <= 40 else f"{name[:30]}...{name[-6:]}"
            raise ConfigError(key, f"the run folder's name {shown!r} is {size} bytes, and a folder name on this "
                                   f"file system may be at most {limit}: {fix}")
