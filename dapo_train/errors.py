"""User-facing errors, and how each ends a command.

Anything the user can fix (a config key, a path, a dataset column, a reward plugin) is raised as
`UserError`; a run that stops on its own because it is broken (it diverged or collapsed) is
`TrainingAborted`; a checkpoint that could not be written (a full disk) is `CheckpointNotSaved`, with
the resume command; a run whose model answers every prompt correctly is `TaskSolved`; a run stopped
because its model got worse than at step 0 (eval.stop_on_regression) is `RunRegressed`; one completion (or
one group's generation) that does not fit the card even alone is `DoesNotFit`. The console script prints
each as one line on stderr and exits with its code, 2, 3, 4, 5, 6 and 7 (one_line_exits), with the
traceback only under `--debug`. Everything else is a bug and keeps its traceback.
"""

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

_LISTING_CHARS = 160  # the names shown of a folder in an error line; the count of the rest follows


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""

    exit_code = 2
    verdict = "error"  # its line: `error: <message>`


def visible(text: str) -> str:
    """`text` with each character that prints as nothing or as a blank (a byte-order mark, a zero-width or
    no-break space, a control character) written as its escape, so an error line shows it."""
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)


class ConfigError(UserError):
    """A config key is unknown, mistyped or holds an impossible value; the key is shown with any invisible
    character escaped (visible)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{visible(key)}': {message}" if key else message)


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


class RunRegressed(Exception):
    """The run stopped because an eval's accuracy was worse than step 0's by the regression test, whose false
    alarms over a run are bounded (eval.stop_on_regression; train/regression.py): its checkpoint is saved and
    the summary names the best. One line, exit code 6, the one place a stopped run says its verdict."""

    exit_code = 6
    verdict = "regressed"  # its line: `regressed: <message>`


class DoesNotFit(Exception):
    """Out of memory where nothing is left to halve or to redo from (train/update/out_of_memory.py): one completion
    alone in the update, one group alone in a generate call, an optimizer step, the weight sync. The run stops
    at the checkpoint of its last good step with one line naming the settings that cut memory, exit code 7.
    kept: the model still holds the last good step's weights (train/loop.py saves them); False when the failed
    step had moved them (the last checkpoint on disk is what is left)."""

    exit_code = 7
    verdict = "out of memory"  # its line: `out of memory: <message>`

    def __init__(self, message: str, kept: bool = True) -> None:
        super().__init__(message)
        self.kept = kept


# What ends a command with one line, `<verdict>: <message>`, and its exit code instead of a traceback.
_ONE_LINE = (UserError, TrainingAborted, CheckpointNotSaved, TaskSolved, RunRegressed, DoesNotFit)


@contextlib.contextmanager
def one_line_exits(debug: bool) -> Iterator[None]:
    """A command's end for the console script: bad input (a UserError, and a path past the file system's
    name limit wherever it was first looked up) 2, TrainingAborted 3, CheckpointNotSaved 4, TaskSolved 5,
    RunRegressed 6, DoesNotFit 7, each as one line on stderr; Ctrl-C `interrupted`, 130. With `debug` (--debug)
    the errors raise with their traceback instead; TaskSolved and RunRegressed are verdicts, not errors, and
    never do. Anything else is a bug: it raises."""
    try:
        try:
            yield
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            raise _name_too_long(exc) from exc
    except _ONE_LINE as exc:
        if debug and not isinstance(exc, (TaskSolved, RunRegressed)):
            raise
        _say(f"{exc.verdict}: {exc}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        _say("interrupted")
        sys.exit(130)  # 128 + SIGINT, as a shell reports a process Ctrl-C stopped


def _name_too_long(exc: OSError) -> UserError:
    """A path past the file system's name limit, wherever it was first looked up, is bad input (a UserError
    naming it), not a traceback."""
    path = str(exc.filename or "a path")
    shown = path if len(path) <= 80 else f"{path[:60]}...{path[-16:]}"
    return UserError(f"{shown}: a file or folder name in it is longer than the file system allows (255 bytes on "
                     "most); give a shorter path")


def _say(line: str) -> None:
    import typer  # the console script's own echo; a library user importing the errors never loads it

    typer.echo(line, err=True)


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
