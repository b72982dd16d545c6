"""The schema's keys as the user sees them: every dotted key with its type, default, allowed values
and help (`dapo-train config --keys [KEY|SECTION ...]`, docs/configuration.md's reference table), and the
closest valid key to a mistyped one."""

from __future__ import annotations

import dataclasses
import difflib
import typing
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError

# Keys that change where a run writes and what it shows or keeps, never what it trains: compare and
# plot leave them out of the settings a point is made of (study/runs.py), so two runs that differ only
# here are one setting.
COSMETIC_KEYS = (
    "output_dir", "run_name", "logging.progress_bar", "logging.trackers", "logging.project",
    "logging.rollout_groups", "logging.rollout_every", "eval.print_samples", "checkpoint.every_steps",
    "checkpoint.keep_last", "checkpoint.keep_best",
)


@dataclass(frozen=True)
class KeyInfo:
    """One option of the schema. annotation: its type (`float | None`); choices: its fixed set of
    values, if it has one."""

    key: str
    annotation: Any
    default: Any
    help: str
    choices: tuple | None


def schema_keys(cls: type = Config, prefix: str = "") -> Iterator[KeyInfo]:
    """Every option of the schema, in field order, nested sections (model.lora) walked."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_keys(hints[f.name], key + ".")
            continue
        text = f.metadata.get("help", "") + _item_help(hints[f.name])
        yield KeyInfo(key, hints[f.name], getattr(defaults, f.name), text, f.metadata.get("choices"))


def _item_help(annotation: Any) -> str:
    """For a list of records (rewards: list[RewardSpec]), what each item's fields are, from their own help."""
    items = typing.get_args(annotation) if typing.get_origin(annotation) is list else ()
    item = items[0] if items else None
    if not dataclasses.is_dataclass(item):
        return ""
    defaults = item()
    fields = [f"{f.name} (default {show_value(getattr(defaults, f.name))}): {f.metadata.get('help', '')}"
              for f in dataclasses.fields(item)]
    return " Each item: " + " ".join(fields)


def show_value(value: Any) -> str:
    """A default as `config --keys` and docs/configuration.md show it: strings quoted, None as the null a YAML
    file or KEY=VALUE must write."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return str([dataclasses.asdict(item) if dataclasses.is_dataclass(item) else item for item in value])
    return str(value)


def _allowed(info: KeyInfo) -> str:
    if info.choices:
        return ", ".join(show_value(c) if c is None else str(c) for c in info.choices)
    return "true, false" if info.annotation is bool else ""


def describe_keys(with_choices: bool = False) -> list[tuple]:
    """(dotted key, default, help) for every option: used by `config --keys` and docs/configuration.md; with
    `with_choices`, a fourth item lists the allowed values of a key that has a fixed set ('' if none)."""
    rows: list[tuple] = []
    for info in schema_keys():
        row = (info.key, show_value(info.default), info.help)
        rows.append(row + (_allowed(info),) if with_choices else row)
    return rows


def select_keys(rows: list[tuple], wanted: list[str]) -> list[tuple]:
    """The rows of the keys `wanted` names (a key, or a section: `dapo`, `model.lora`), in schema
    order; every name must match something, else a ConfigError naming the closest key."""
    names: dict[str, None] = {}  # every key and section, in schema order
    for key in (row[0] for row in rows):
        parts = key.split(".")
        names.update(dict.fromkeys(".".join(parts[: i + 1]) for i in range(len(parts))))
    for name in wanted:
        prefix = ""
        for part in name.split("."):
            if prefix + part not in names:
                siblings = [n for n in names if n.startswith(prefix) and "." not in n[len(prefix) :]]
                raise unknown_key(prefix + part, siblings)
            prefix += part + "."
    return [row for row in rows if not wanted or any(row[0] == n or row[0].startswith(n + ".") for n in wanted)]


def _describe(char: str) -> str:
    """'U+FEFF (a byte-order mark, ZERO WIDTH NO-BREAK SPACE)': an invisible character by its code and name."""
    name = unicodedata.name(char, "unnamed")
    return f"U+{ord(char):04X} ({'a byte-order mark, ' if char == chr(0xFEFF) else ''}{name})"


def unknown_key(key: str, valid: list[str]) -> ConfigError:
    """A ConfigError for `key`, naming the closest of `valid` (dotted keys of the same section), or the
    key of another section with its very name (a top-level `max_steps:` belongs under `train:`); a valid
    key written with its dots as one YAML key is shown nested; a valid key but for an invisible character (a
    byte-order mark an editor saved) is named with that character."""
    hidden = [char for char in key if not char.isprintable()]
    if hidden and "".join(char for char in key if char.isprintable()) in valid:
        return ConfigError(key, f"unknown key: it holds an invisible {_describe(hidden[0])}; delete it: "
                                f"'{''.join(char for char in key if char.isprintable())}'")
    leaf = key.rsplit(".", 1)[-1]
    elsewhere = [info.key for info in schema_keys() if info.key.rsplit(".", 1)[-1] == leaf]
    if key in elsewhere:  # a valid key, unknown only as one YAML key with dots in it (`train.max_steps: 5`)
        *sections, last = key.split(".")
        nested = " and under it ".join([*(f"'{section}:'" for section in sections), f"'{last}: ...'"])
        return ConfigError(key, f"a YAML file nests its keys: write {nested}, each indented under the one "
                                "before (the dotted form is for KEY=VALUE on the command line)")
    close = difflib.get_close_matches(leaf, [v.rsplit(".", 1)[-1] for v in valid], n=1)
    hint = ""
    if elsewhere:
        hint = f"; did you mean {' or '.join(repr(name) for name in elsewhere)}?"
    elif close:
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        hint = f"; did you mean '{parent}{close[0]}'?"
    return ConfigError(key, f"unknown key{hint} (valid: {', '.join(v.rsplit('.', 1)[-1] for v in valid)})")


def markdown_cell(text: str) -> str:
    """Prose in a Markdown table cell: `|` would end the cell and `<name>` would be read as an HTML tag."""
    return text.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")


def reference_table() -> str:
    """Markdown table of every key, each default written whole (docs/configuration.md embeds it; a test
    keeps the two in step)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, text in describe_keys():
        default = default.replace("\n", "\\n").replace("|", "\\|")
        lines.append(f"| `{key}` | `{default}` | {markdown_cell(text)} |")
    return "\n".join(lines)
