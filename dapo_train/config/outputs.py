"""The folders a command writes into (`run`'s output_dir, `sweep --dir`, `preflight --keep`, `export -o`):
the one rule that keeps every such command off what the user owns.

A command may write into a folder that does not exist, an empty one, or one that is recognisably its own
kind of output: it holds the kind's marker file (written when the output starts), or, for outputs from
before the marker, the files that kind always wrote (`OutputKind.signs`). Replacing an output removes
only the entries that kind writes (`OutputKind.entries`), never the folder itself, and is refused while
the folder holds anything else, named. Never a folder to write into, whatever it holds: the current
folder, a parent of it, the home folder, the root, or a folder that is, contains or lies inside one of
the command's inputs (data.path, model.name_or_path, a reward model's path, the checkpoint it reads).
Every check runs before anything is written or loaded, and a refusal is one line that says nothing
was changed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dapo_train.errors import UserError

_SHOWN = 6  # foreign entries named in a refusal; the count of the rest follows


@dataclass(frozen=True)
class OutputKind:
    """What one command writes at the top of its folder. entries: fnmatch patterns of the names it
    writes (the marker among them); signs: groups of patterns, each of which alone (every pattern
    matching an entry) recognises an output written before the marker existed."""

    name: str  # "run folder": how messages call it
    marker: str  # the file written when the output starts
    entries: tuple[str, ...]
    signs: tuple[tuple[str, ...], ...] = ()

    def owns(self, name: str) -> bool:
        return name == self.marker or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.entries)

    def recognises(self, names: list[str]) -> bool:
        return self.marker in names or any(
            all(any(fnmatch.fnmatchcase(name, pattern) for name in names) for pattern in sign) for sign in self.signs
        )


def reserved(folder: Path) -> str | None:
    """Why `folder` can never be a command's output folder, or None: the current folder, a parent of
    it, the home folder, the root."""
    resolved, cwd = folder.expanduser().resolve(), Path.cwd().resolve()
    if resolved == Path(resolved.anchor):
        return "the root folder"
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no HOME and no passwd entry: no home folder to protect
        home = None
    if resolved == home:
        return "the home folder"
    if resolved == cwd:
        return "the current folder"
    if resolved in cwd.parents:
        return "a parent of the current folder"
    return None


def overlap(folder: Path, label: str, other: Path) -> str | None:
    """How `folder` and the input `other` share files ('is', 'lies inside', 'contains' label), or None."""
    mine, theirs = folder.expanduser().resolve(), other.expanduser().resolve()
    if mine == theirs:
        return f"is {label}"
    if theirs in mine.parents:
        return f"lies inside {label}"
    if mine in theirs.parents:
        return f"contains {label}"
    return None


def local_inputs(cfg) -> dict[str, Path]:
    """The config's inputs that are local files or folders -> label ('data.path ./gsm8k'): data.path,
    model.name_or_path and every reward's path / tokenizer_path (a Hub id or a builtin: name is none)."""
    found = {"data.path": cfg.data.path, "model.name_or_path": cfg.model.name_or_path}
    for index, reward in enumerate(cfg.rewards):
        for key in ("path", "tokenizer_path"):
            if isinstance(reward.args.get(key), str):
                found[f"rewards.{index}.args.{key}"] = reward.args[key]
    return {f"{key} {value}": Path(value) for key, value in found.items()
            if value and Path(value).expanduser().exists()}


def holds_own(folder: Path, kind: OutputKind, *, option: str, inputs: dict[str, Path] | None = None,
              replace: bool = False) -> bool:
    """Refuse (UserError, one line) a `folder` that `kind`'s command must not write into, or with
    replace, not clear. -> whether it holds an output of `kind` (False: it is absent or empty)."""
    where = f"{option} {folder}"
    problem = reserved(folder)
    if problem is not None:
        raise UserError(f"{where} is {problem}: a {kind.name} needs a folder of its own; choose a new or empty one "
                        "(nothing was changed)")
    for label, path in (inputs or {}).items():
        problem = overlap(folder, label, path)
        if problem is not None:
            raise UserError(f"{where} {problem}: writing there could overwrite it; choose a folder apart from the "
                            "command's inputs (nothing was changed)")
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise UserError(f"{where} exists and is not a folder; choose another path (nothing was changed)")
    names = sorted(entry.name for entry in os.scandir(folder))
    if not names:
        return False
    if not kind.recognises(names):
        raise UserError(f"{where} is not empty and is not a {kind.name} ({_listing(folder, names)}); choose a new or "
                        f"empty folder (nothing was changed)")
    foreign = [name for name in names if not kind.owns(name)]
    if replace and foreign:
        raise UserError(f"{where} is a {kind.name} but also holds what no {kind.name} writes "
                        f"({_listing(folder, foreign)}); move that out, or choose another folder (nothing was "
                        "changed)")
    return True


def _listing(folder: Path, names: list[str]) -> str:
    shown = [name + ("/" if (folder / name).is_dir() else "") for name in names[:_SHOWN]]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(shown) + more


def remove_own(folder: Path, kind: OutputKind) -> list[str]:
    """Remove what `kind` wrote in `folder` (its entries, the marker) and nothing else: the folder
    stays, with anything another program put there since the check. -> the names removed."""
    removed = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name) if folder.is_dir() else []:
        if not kind.owns(entry.name):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
        removed.append(entry.name)
    return removed


def owned_bytes(folder: Path, kind: OutputKind) -> int:
    """The bytes remove_own would free in `folder`."""
    total = 0
    for entry in os.scandir(folder) if folder.is_dir() else []:
        if kind.owns(entry.name):
            path = Path(entry.path)
            files = [p for p in path.rglob("*") if p.is_file()] if entry.is_dir(follow_symlinks=False) else [path]
            total += sum(p.stat().st_size for p in files)
    return total


def mark(folder: Path, kind: OutputKind) -> None:
    """Create `folder` (and its parents) and write `kind`'s marker, which later runs recognise it by."""
    from dapo_train import __version__

    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / kind.marker
    if not marker.exists():
        marker.write_text(json.dumps({"written_by": "dapo-train", "version": __version__, "kind": kind.name}) + "\n",
                          encoding="utf-8")
