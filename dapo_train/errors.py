"""User-facing errors.

Anything the user can fix (a config key, a path, a dataset column, a reward plugin) is raised as
`UserError`; the CLI prints its one-line message and exits with code 2, with no traceback unless
`--debug` is given. Everything else is a bug and keeps its traceback.
"""

from pathlib import Path

_LISTING_MAX = 20


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or holds an impossible value."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


class TrainingAborted(Exception):
    """The run cannot go on (e.g. too many non-finite steps): one line, exit code 1."""


def folder_listing(path: Path) -> str:
    """'<nearest existing folder> holds: a/, b.json, ...' for error messages."""
    folder = path
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()) if folder.is_dir() else []
    shown = ", ".join(entries[:_LISTING_MAX]) or "nothing"
    more = f" and {len(entries) - _LISTING_MAX} more" if len(entries) > _LISTING_MAX else ""
    return f"{folder if str(folder) != '.' else 'the current folder'} holds: {shown}{more}"
