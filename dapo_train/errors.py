"""User-facing errors.

Anything the user can fix (a config key, a path, a dataset column, a reward plugin) is raised as
`UserError`; the CLI prints its one-line message and exits with code 2, with no traceback unless
`--debug` is given. Everything else is a bug and keeps its traceback.
"""

import os
import stat
from pathlib import Path

_LISTING_CHARS = 160  # the names shown of a folder in an error line; the count of the rest follows


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or holds an impossible value."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


class TrainingAborted(Exception):
    """The run stopped on its own (it diverged, or starved of informative groups): one line, exit code
    3 (2 is bad input; 1 an unexpected error)."""

    exit_code = 3
    verdict = "aborted"  # its line: `aborted: <message>`


class CheckpointNotSaved(Exception):
    """A checkpoint could not be written (a full disk, an I/O error, a folder turned read-only): its partial
    folder is removed, the checkpoints before it stay, and the run stops with one line naming the last
    one and the command that resumes from it, exit code 4."""

    exit_code = 4
    verdict = "stopped"  # its line: `stopped: <message>`


class TaskSolved(Exception):
    """The run stopped because the model answers every prompt correctly (train/health.py): nothing
    left to learn at its group size; its last checkpoint is the result. One line, exit code 5."""

    exit_code = 5
    verdict = "solved"  # its line: `solved: <message>`


def folder_listing(path: Path) -> str:
    """'<nearest existing folder> holds: a/, b.json, ...' for error messages: its first names in sorted
    order, about _LISTING_CHARS characters of them, then how many are left (a temporary folder holds
    thousands)."""
    folder = path
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in os.scandir(folder)) \
        if folder.is_dir() else []
    shown: list[str] = []
    for name in names:
        if shown and sum(len(n) + 2 for n in shown) + len(name) > _LISTING_CHARS:
            break
        shown.append(name)
    more = f" and {len(names) - len(shown)} more ({len(names)} entries)" if len(shown) < len(names) else ""
    return f"{folder if str(folder) != '.' else 'the current folder'} holds: {', '.join(shown) or 'nothing'}{more}"


_SPECIAL_FILES = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def special_file(path: Path) -> str | None:
    """What `path` is when it exists but is neither a file nor a folder ('a character device' for
    /dev/null), for the error that would otherwise say it does not exist; None for anything else."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return None
    return next((what for test, what in _SPECIAL_FILES if test(mode)), None)
