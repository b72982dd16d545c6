"""The folders a command writes into (`run`'s output_dir, `sweep --dir`, `preflight --keep`, `export -o`):
the one rule that keeps every such command off what the user owns.

A command may write into a folder that does not exist, an empty one, or one it marked: the kind's marker
file, written when the output starts (a folder written whole, such as an export, lists in its marker what it
holds). A folder without the marker is an output only where the kind can tell one its older versions wrote
(`OutputKind.older`, which says why not); anything else is refused. Replacing an output removes only what
that kind writes, and inside the folders it writes into (`OutputKind.nested`: a preflight's run/) only what
they hold of theirs; it is refused while the folder holds anything else, named, and it names what it removed.
Never a folder to write into, whatever it holds: the current folder, a parent of it, the home folder, the
root, or a folder that is, contains or lies inside one of the command's inputs (data.path,
model.name_or_path, a reward model's path, the checkpoint it reads); nor one that is, or lies under, a
symbolic link to nothing (making it would fail there). Every check runs before anything is written or loaded,
and a refusal is one line that says nothing was changed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dapo_train.errors import UserError

logger = logging.getLogger(__name__)

_SHOWN = 6  # entries named in a message; the count of the rest follows
# The lock a command holds on the folder it writes (run/lock.py): every kind's own, never the user's, and never
# removed in place of an earlier output (the command replacing it holds it); a folder holding only it is empty.
LOCK_FILE = ".dapo-train.lock"


@dataclass(frozen=True)
class OutputKind:
    """What one command writes in its folder. names: exact names (a user's setting such as logging.project is
    a name, never a pattern); patterns: regular expressions that a generated name matches whole, in the exact
    form the command writes it (checkpoint_\\d+: checkpoint_1.tar.gz is the user's); nested: (pattern, kind) of the
    folders it writes into, each holding only what that kind writes; listed: written whole, its marker lists
    its entries; older: for a folder without the marker, why it is not an output of this kind from before the
    marker (None: it is one), or None when no such output ever existed."""

    name: str  # "dapo-train run folder": how messages call it
    marker: str | None  # the file written when the output starts; None: a folder inside one, known by its place
    names: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    nested: tuple[tuple[str, OutputKind], ...] = ()
    listed: bool = False
    older: Callable[[Path], str | None] | None = None

    def inner(self, name: str) -> OutputKind | None:
        """The kind of the nested folder `name`, or None."""
        return next((kind for pattern, kind in self.nested if re.fullmatch(pattern, name)), None)

    def owns(self, folder: Path, name: str) -> bool:
        """Whether `name`, an entry of `folder`, is one this kind writes."""
        if name in (self.marker, LOCK_FILE) or name in self.names or self.inner(name) is not None:
            return True
        return any(re.fullmatch(pattern, name) for pattern in self.patterns) or (
            self.listed and name in _listed(folder / self.marker))


def _listed(marker: Path) -> list[str]:
    """The entries a folder written whole says it holds (its marker's "entries")."""
    try:
        entries = json.loads(marker.read_text(encoding="utf-8")).get("entries", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [entry for entry in entries if isinstance(entry, str)] if isinstance(entries, list) else []


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
    dangling = _dangling_link(folder)
    if dangling is not None:
        raise UserError(f"{where}{'' if dangling == folder else f': {dangling}'} is a symbolic link to "
                        f"{os.readlink(dangling)}, which does not exist; make its target, remove the link, or choose "
                        "another folder (nothing was changed)")
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise UserError(f"{where} exists and is not a folder; choose another path (nothing was changed)")
    names = sorted(name for name in os.listdir(folder) if name != LOCK_FILE)
    if not names:
        return False
    why = _not_marked(folder, kind)
    if why is not None:
        raise UserError(f"{where} is not empty and is not a {kind.name}: {why}; it holds "
                        f"{_listing([_shown(folder, name) for name in names])}; choose a new or empty folder "
                        "(nothing was changed)")
    foreign = _foreign(folder, kind) if replace else []
    if foreign:
        raise UserError(f"{where} is a {kind.name} but also holds what no {kind.name} writes ({_listing(foreign)}); "
                        "move that out, or choose another folder (nothing was changed)")
    return True


def _dangling_link(folder: Path) -> Path | None:
    """`folder`, or a parent of it, that is a symbolic link to nothing: making the folder would fail there."""
    return next((path for path in (folder, *folder.parents) if path.is_symlink() and not path.exists()), None)


def _not_marked(folder: Path, kind: OutputKind) -> str | None:
    """Why `folder` is not an output of `kind` (no marker, and not one from before the marker), or None."""
    why = _why_unmarked(folder, kind)
    return None if why is None else f"no {kind.marker}" + (f", and {why}" if why else "")


def _why_unmarked(folder: Path, kind: OutputKind) -> str | None:
    """None when `folder` is `kind`'s (its marker, or an output from before the marker); else why it is not one
    from before the marker ('' where the kind had no such outputs)."""
    if (folder / kind.marker).is_file():
        return None
    return "" if kind.older is None else kind.older(folder)


def _foreign(folder: Path, kind: OutputKind, prefix: str = "") -> list[str]:
    """What `folder` holds that `kind` did not write, as paths from the folder checked first: 'notes.txt',
    'plots/', 'run/notes.txt', and 'run/ without .dapo-train-run' for a nested folder it did not mark (with why it
    is not one from before the marker either, where its kind can tell: 'checkpoint_9/ without ...: its ...')."""
    found = []
    for name in sorted(os.listdir(folder)):
        path, inner = folder / name, kind.inner(name)
        if not kind.owns(folder, name):
            found.append(prefix + _shown(folder, name))
        elif inner is None:
            continue
        elif not path.is_dir() or path.is_symlink():
            found.append(f"{prefix}{name} (not a folder)")
        elif inner.marker is not None and (unmarked := _unmarked(path, inner)) is not None:
            found.append(f"{prefix}{name}/ {unmarked}")
        else:
            found += _foreign(path, inner, f"{prefix}{name}/")
    return found


def _unmarked(folder: Path, kind: OutputKind) -> str | None:
    """'without .dapo-train-run' for a nested `folder` that `kind` did not mark, with why it is not one from before
    the marker either where the kind can tell ('without .dapo-train-checkpoint: its trainer_state.pt is step 1's');
    None: it is the kind's."""
    why = _why_unmarked(folder, kind)
    return None if why is None else f"without {kind.marker}" + (f": {why}" if why else "")


def _shown(folder: Path, name: str) -> str:
    return name + ("/" if (folder / name).is_dir() else "")


def _listing(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _owned(folder: Path, kind: OutputKind) -> list[str]:
    return [name for name in sorted(os.listdir(folder)) if name != LOCK_FILE and kind.owns(folder, name)] \
        if folder.is_dir() else []


def _own_paths(folder: Path, kind: OutputKind) -> list[Path]:
    """What `kind` wrote in `folder`: its entries, whole, and of each nested folder what that one's kind wrote."""
    paths = []
    for name in _owned(folder, kind):
        path, inner = folder / name, kind.inner(name)
        paths += _own_paths(path, inner) if inner is not None and _is_folder(path) else [path]
    return paths


def _is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def remove_own(folder: Path, kind: OutputKind, say: str) -> list[str]:
    """Remove what `kind` wrote in `folder` (the marker too) and nothing else: the folder stays, with anything
    another program put there since the check, and so does a nested folder that still holds something. Logs
    `say` with each top-level entry it removed (or their count and the first few). -> those entries."""
    shown = [_shown(folder, name) for name in _owned(folder, kind)]
    _remove(folder, kind)
    if shown:
        count = f"{len(shown)} entr{'y' if len(shown) == 1 else 'ies'}"
        logger.warning("%s in %s: %s: %s", say, folder, count, _listing(shown))
    return [name.rstrip("/") for name in shown]


def remove_folder(folder: Path, kind: OutputKind) -> list[str]:
    """Remove `folder`, which `kind` wrote, whole, unless it holds what `kind` never writes: then only what `kind`
    wrote goes and the folder stays. -> what was kept ('notes.md', 'plots/'), as _foreign names it."""
    kept = _foreign(folder, kind)
    _remove(folder, kind)
    if not kept:
        folder.rmdir()
    return kept


def _remove(folder: Path, kind: OutputKind) -> None:
    for name in _owned(folder, kind):  # listed before removing: a folder written whole lists them in its marker
        path, inner = folder / name, kind.inner(name)
        if inner is not None and _is_folder(path):
            _remove(path, inner)
            if not any(path.iterdir()):
                path.rmdir()
        elif _is_folder(path):
            shutil.rmtree(path)
        else:
            path.unlink()


def owned_bytes(folder: Path, kind: OutputKind) -> int:
    """The bytes remove_own would free in `folder`."""
    files = []
    for path in _own_paths(folder, kind):
        files += [p for p in path.rglob("*") if p.is_file()] if _is_folder(path) else [path]
    return sum(p.lstat().st_size for p in files)


def mark(folder: Path, kind: OutputKind) -> None:
    """Create `folder` (and its parents) and write `kind`'s marker, which later commands recognise it by. A
    folder written whole (kind.listed) is marked last, and its marker lists what it holds."""
    from dapo_train import __version__

    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / kind.marker
    if not marker.exists():
        entries = {"entries": sorted(os.listdir(folder))} if kind.listed else {}
        marker.write_text(json.dumps({"written_by": "dapo-train", "version": __version__, "kind": kind.name,
                                      **entries}) + "\n", encoding="utf-8")
