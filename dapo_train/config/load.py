"""Settings files: defaults <- YAML file <- dotted `KEY=VALUE` overrides (`dapo.eps_high=0.4`).

The schema (dataclasses, defaults, help texts) is config/schema.py and its invariants
config/validate.py. Unknown keys fail naming the closest valid key, wrong types and impossible values
fail naming the key and what is allowed, all before any model loads (`ConfigError`, exit code 2).
Retired keys (old run folders' configs) are config/retired.py's tables; the keys as listed to the
user, config/keys.py's.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from dapo_train.config.keys import schema_keys, unknown_key
from dapo_train.config.naming import check_folder_name, default_run_name
from dapo_train.config.retired import RENAMED_KEYS, renamed_override, upgrade_retired
from dapo_train.config.schema import (
    Config,
)
from dapo_train.errors import ConfigError, UserError, special_file

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"  # the resolved config a run saves in its folder and in each checkpoint (save_config)


# --------------------------------------------------------------------------------------------
# Earlier runs' configs.


def read_saved_config(path: str | Path, notify: bool = True) -> dict:
    """An earlier run's config.yaml as this version reads it: retired keys dropped and old values
    renamed, each notice naming the file (none with notify=False)."""
    saved = read_yaml(path)
    upgrade_retired(saved, str(path), notify)
    return saved


# --------------------------------------------------------------------------------------------
# Building a Config from nested dicts, strictly.


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is dict or origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(item, item_type) for item in value)
    return False


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _as_float(value: Any) -> Any:
    """Ints, and exponent forms like 1e-6 that YAML 1.1 reads as strings, become floats."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        return float(value)
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a dict, checking every key and type."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise unknown_key(full, [f"{prefix}.{n}" if prefix else n for n in fields])
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value, full)
        elif typing.get_origin(annotation) is list:
            kwargs[key] = _build_list(typing.get_args(annotation)[0], value, full)
        else:
            kwargs[key] = _scalar(value, annotation, fields[key].metadata.get("choices") or (), full)
    return cls(**kwargs)


def _scalar(value: Any, annotation: Any, choices: tuple, key: str) -> Any:
    """One plain value checked against its annotation: ints and exponent texts read as floats, a
    bare on/off as the switch word; the text 'None' where null is meant, and NaN/inf, are refused."""
    if annotation in (float, float | None):
        value = _as_float(value)
    if isinstance(value, bool) and annotation is str and ("on" if value else "off") in choices:
        value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
    if isinstance(value, str) and value.strip() in ("None", "none") and _type_ok(None, annotation):
        raise ConfigError(key, f"got the text {value!r}; write null for no value ({key}=null)")
    if not _type_ok(value, annotation):
        raise ConfigError(key, f"expected {_type_name(annotation)}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"got {value}; must be a finite number")
    return value


def _build_list(item_type: type, value: Any, key: str) -> list:
    """A list field: dataclass items (rewards) are built strictly; plain items (names: trackers,
    target modules) are type-checked, and one name alone is a list of one
    (`logging.trackers=tensorboard`)."""
    if isinstance(value, str) and item_type is str:
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(key, f"expected a list, got {type(value).__name__}")
    if dataclasses.is_dataclass(item_type):
        return [_build(item_type, item, f"{key}.{i}") for i, item in enumerate(value)]
    for i, item in enumerate(value):
        if not _type_ok(item, item_type):
            raise ConfigError(f"{key}.{i}", f"expected {_type_name(item_type)}, got {item!r} ({type(item).__name__})")
    return list(value)


# --------------------------------------------------------------------------------------------
# YAML files and KEY=VALUE overrides.


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: plain YAML keeps
    the last one without a word, so the first setting would be silently ignored. A merge key
    (`<<: *anchor`) is no key of its own: the safe loader copies the anchored keys in, and the mapping's
    own keys override them."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, collections.abc.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice (first on line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict:
    """Parse a YAML config file into a dict; errors name the file, line and column."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a folder; give a YAML file (a run's settings are RUN/config.yaml)")
    if (kind := special_file(path)) is not None:
        raise UserError(f"config file {path} is not a file but {kind}; give a YAML file")
    if not path.is_file():
        key = str(path)
        hint = f"; to set that key write KEY=VALUE: {key}=..." if key in {info.key for info in schema_keys()} else ""
        raise UserError(f"config file not found: {path}{hint}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"invalid YAML in {path}{where}: {problem}") from None
    if data is None:
        raise UserError(f"config file {path} is empty; for the defaults, give no CONFIG")
    if not isinstance(data, dict):
        raise UserError(f"invalid config {path}: the top level must be a mapping of sections")
    return data


def is_override(arg: str) -> bool:
    """KEY=VALUE, unless the argument names an existing path: every sweep run's folder has '=' in
    its name (`outputs/sweep_x/eps_high=0.1_seed1`), and a path must never be read as a key. A text
    that no file system could hold (a name past its limit, a NUL byte) names no path: it is a value."""
    if "=" not in arg:
        return False
    try:
        return not Path(arg).exists()
    except (OSError, ValueError):
        return True


def apply_override(data: dict, item: str) -> None:
    """Set a dotted KEY=VALUE in a nested dict; VALUE is parsed as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise UserError(f"override '{item}' is not KEY=VALUE (e.g. dapo.eps_high=0.4)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(key, f"index {part} is out of range for a list of {len(node)}")
            node = node[int(part)]
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, (dict, list)):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section")
        node = child
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(key, f"index {last} is out of range for a list of {len(node)}")
        node[int(last)] = value
        return
    section = node.get(last)
    if isinstance(section, dict) and not isinstance(value, dict):
        example = f"{key}.{next(iter(section))}=..." if section else f"{key}.KEY=VALUE"
        raise ConfigError(key, f"is a section, not a value; set its keys, e.g. {example}")
    node[last] = value


def refuse_repeated_keys(overrides: list[str]) -> None:
    """A key given twice in one command line's KEY=VALUE overrides is a ConfigError: the last would win
    silently (and both would name the run). A retired name counts as the key it became."""
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        key = RENAMED_KEYS[key][0] if key in RENAMED_KEYS else key
        if key in seen:
            raise ConfigError(key, f"given twice on the command line ({seen[key]}, then {item}); give it once")
        seen[key] = item


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def load_config(config_path: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Defaults (or `base`, e.g. a checkpoint's saved config) <- YAML file <- KEY=VALUE overrides,
    validated; derived names filled in.

    Starts from the dataclass defaults (as a dict) so that overriding one field of one reward
    (`rewards.0.weight=2`) works; the result is rebuilt strictly from the merged dict.
    """
    overrides = list(overrides or [])
    if base is None:
        data = config_to_dict(Config())
    else:
        data = base
        upgrade_retired(data, "saved config")
    if config_path is not None:
        from_file = read_yaml(config_path)
        upgrade_retired(from_file, str(config_path))
        deep_merge(data, from_file, prefix="")
    configured, overrides = flatten_config(data), [renamed_override(item) for item in overrides]
    for item in overrides:
        apply_override(data, item)
    upgrade_retired(data, "KEY=VALUE")
    expand_home(data)
    automatic = data.get("run_name") in (None, "")  # anything else is the user's, and its type is checked
    if automatic:
        data["run_name"] = default_run_name(config_path, overrides, configured)
    named_by_run = data.get("output_dir") in (None, "") and isinstance(data["run_name"], str)
    if named_by_run:
        data["output_dir"] = str(Path("outputs") / data["run_name"])
    cfg = config_from_dict(data)
    if named_by_run:
        check_folder_name(cfg.output_dir, "run_name", "set run_name= or output_dir=" if automatic else
                          "choose a shorter run_name")
    else:
        check_folder_name(cfg.output_dir, "output_dir", "choose a shorter output_dir")
    return cfg


# Keys that hold a local path, and the args of a reward that do (a reward model's): a leading ~ is a home folder.
# Keys that hold a local path, as (section or None, name), and the args of a reward that do (a reward model's).
PATH_KEYS = ((None, "output_dir"), ("model", "name_or_path"), ("data", "path"))
REWARD_PATH_ARGS = ("path", "tokenizer_path")


def expand_home(data: dict) -> None:
    """A leading ~ in every path key read as a shell reads it (the home folder, ~user's), where no shell did: a
    quoted 'output_dir=~/x' or a YAML file made a folder named ~. One that names no home folder is refused."""
    places = [(data if section is None else data.get(section), name, ".".join(filter(None, (section, name))))
              for section, name in PATH_KEYS]
    rewards = data.get("rewards")
    for index, reward in enumerate(rewards if isinstance(rewards, list) else []):  # a wrong type: its key's error
        args = reward.get("args") if isinstance(reward, dict) else None
        places += [(args, name, f"rewards.{index}.args.{name}") for name in REWARD_PATH_ARGS]
    for holder, name, key in places:
        value = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(value, str) and value.startswith("~"):
            holder[name] = os.path.expanduser(value)  # unchanged where ~user names no one
            if holder[name].startswith("~"):
                raise ConfigError(key, f"{value!r}: {value.split('/')[0]} is no home folder here; give the whole path")


def deep_merge(base: dict, update: dict, prefix: str) -> None:
    """Merge `update` into `base`; sections merge key by key, lists and values replace."""
    for key, value in update.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in base:
            raise unknown_key(full, [f"{prefix}.{k}" if prefix else k for k in base])
        if isinstance(base[key], dict) and isinstance(value, dict):
            deep_merge(base[key], value, full)
        else:
            base[key] = value


def flatten_config(data: object, prefix: str = "") -> dict:
    """Nested config dict -> {dotted key: value}, lists by index (`rewards.0.weight`), the same
    names KEY=VALUE overrides use."""
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list):
        items = enumerate(data)
    else:
        return {prefix: data}
    flat: dict = {}
    for key, value in items:
        flat.update(flatten_config(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat or {prefix: data}


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config saved with save_config (strict: unknown keys still fail)."""
    return _build(Config, data, prefix="")


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, in field order."""
    return yaml.safe_dump(config_to_dict(cfg), allow_unicode=True, sort_keys=False)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(dump_config(cfg), encoding="utf-8")
