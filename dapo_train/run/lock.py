"""One command at a time in a folder: a run's output_dir, a sweep's --dir, a kept preflight.

Two runs into one folder would interleave their logs and overwrite each other's checkpoints, and every
later reader (compare, plot, --resume) would take the mixture for one run. So the command that writes a
folder holds an OS lock on LOCK_FILE inside it (fcntl.flock, which the kernel releases when the process
ends, however it ends) for as long as it writes there; the file says who holds it (pid, host, start), for
the line that refuses a second command. A lock file nobody holds (its process killed with -9) is taken
over, saying whose it was and what this host can tell of it: whether that pid still runs here, nothing of
another host's processes. A file system that refuses flock itself (NFS without a lock daemon, some
cluster file systems) stops the command in one line naming NO_LOCK_ENV, the switch that runs without the
lock there (nothing then refuses a second command into the folder). Under several ranks (torchrun,
accelerate launch) only the main process (RANK 0) takes it: the other ranks write into the folder only what
the main one asks them to. run/outputs.py counts the file as every output folder's own, which
--overwrite never removes; released, it is removed, and so is the folder when the command made it and left
it empty (a start that failed in its setup).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dapo_train.errors import UserError
from dapo_train.run.outputs import LOCK_FILE

logger = logging.getLogger(__name__)

# Set to 1: no folder lock at all (a file system that refuses flock); docs/training.md says what it risks.
NO_LOCK_ENV = "DAPO_TRAIN_NO_FOLDER_LOCK"
# A command's check_free holds the lock shared for an instant: a start that meets it tries again a few times
# before it takes the folder for held, which a run holds for the whole of its work.
_TRIES, _PAUSE_S = 5, 0.05


def _is_main_rank() -> bool:
    """Rank 0 of a launcher, or a single process (RANK unset); read before any process group exists."""
    return os.environ.get("RANK", "0") == "0"


def _holder(fd: int) -> dict:
    """What the lock file says of the process that wrote it ({} when empty or not ours)."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _who(holder: dict) -> str:
    """'pid 4242 on host gpu-7, started 2026-12-06 05:20:11 UTC' (what the file says of it)."""
    if "pid" not in holder:
        return "a process that has not written its pid yet"
    started = holder.get("started")
    when = time.strftime(", started %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) \
        if isinstance(started, (int, float)) else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{when}"


def _unlocked() -> bool:
    """NO_LOCK_ENV=1: the user runs without the folder lock."""
    return os.environ.get(NO_LOCK_ENV) == "1"


def _refused(folder: Path, option: str, exc: OSError) -> UserError:
    """flock itself refused (not held by another command): the file system keeps no locks."""
    return UserError(f"{option} {folder}: this file system refuses the folder lock (flock: {exc.strerror or exc}); "
                     f"use a folder on a file system with locks (a local disk), or set {NO_LOCK_ENV}=1 to run "
                     "without the lock, which then refuses no second command into the folder (docs/training.md) "
                     "(nothing was changed)")


def _taken_over(holder: dict) -> str:
    """What this host can tell of the process a free lock file names: only whether its pid runs here."""
    if holder.get("host") != socket.gethostname():
        return (f"took over the lock left by {_who(holder)}: this host cannot check whether it still runs (a file "
                "system whose locks do not reach across hosts would not show its lock here); if it does, stop one")
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return f"took over the lock left by {_who(holder)}, which no longer runs"
    except (OSError, ValueError, TypeError, OverflowError):
        pass  # another user's process (it runs), or a pid that is no number: no more is known
    return f"took over the lock left by {_who(holder)}, which no longer holds it (a process of that pid runs here)"


def _in_use(folder: Path, option: str, holder: dict) -> UserError:
    return UserError(f"{option} {folder} is in use by another dapo-train command ({_who(holder)}); wait for it to end, "
                     "or choose another folder (nothing was changed)")


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UserError(f"{path}: cannot open the folder's lock file ({exc.strerror or exc}); remove it if it is "
                        "not dapo-train's (nothing was changed)") from None


def check_free(folder: Path, option: str) -> None:
    """Refuse (one line naming the holder) a `folder` another command holds; writes nothing. For a check
    before the others, whose own refusals would otherwise speak of a folder in use as of a finished one."""
    path = folder / LOCK_FILE
    if not _is_main_rank() or _unlocked() or not path.is_file() or path.is_symlink():
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # gone since, or unreadable: hold_folder says so if it matters
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(folder, option, _holder(fd)) from None
    except OSError as exc:
        raise _refused(folder, option, exc) from None
    finally:
        os.close(fd)


def _locked(fd: int) -> bool:
    """Take the lock on `fd`; False when another command holds it (after a few tries: see _TRIES). OSError:
    the file system refuses flock."""
    for _ in range(_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(_PAUSE_S)
    return False


def _lock(path: Path, folder: Path, option: str) -> tuple[int, dict]:
    """-> (the locked file's descriptor, what it said before). A holder that releases by removing the file
    between our open and our lock leaves us a removed file: lock the one at the path then."""
    while True:
        made = not path.exists()
        fd = _open(path)
        try:
            locked = _locked(fd)
        except OSError as exc:
            os.close(fd)
            if made:  # ours, and the folder's only trace of this command
                path.unlink(missing_ok=True)
            raise _refused(folder, option, exc) from None
        if not locked:
            holder = _holder(fd)
            os.close(fd)
            raise _in_use(folder, option, holder)
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            return fd, _holder(fd)
        os.close(fd)


@contextlib.contextmanager
def hold_folder(folder: Path, option: str) -> Iterator[None]:
    """Hold `folder` (made if absent) for the command's writes; a second command that tries refuses at
    once (UserError, exit 2) naming this one. Only the main rank locks; the others pass through, and so does
    the main rank under NO_LOCK_ENV=1, saying so."""
    if not _is_main_rank():
        yield
        return
    made = [path for path in (folder, *folder.parents) if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if _unlocked():
            logger.warning("%s %s is not locked (%s=1): a second command into it is not refused, and two writing at "
                           "once would mix their files; run one at a time there", option, folder, NO_LOCK_ENV)
            yield
        else:
            with _held(folder / LOCK_FILE, folder, option):
                yield
    finally:
        for created in made:  # the folder, and the parents made for it, when the command left them empty
            try:
                created.rmdir()
            except OSError:
                break


@contextlib.contextmanager
def _held(path: Path, folder: Path, option: str) -> Iterator[None]:
    """The lock file at `path` locked and holding this process's record, while the command runs."""
    fd, before = _lock(path, folder, option)
    try:
        if before.get("pid") not in (None, os.getpid()):
            logger.warning("%s %s: %s", option, folder, _taken_over(before))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: the next command makes its own
        os.close(fd)
