"""The console: each log line printed once, and a console that goes away never stops a run.

console_logging() prints each log record once, through the root's handler, with the libraries' own
progress bars off.

`dapo-train run ... 2>&1 | tee log` is how a long job is logged, and Ctrl-C there reaches tee too: it
dies with the same SIGINT that asks the run to finish its step and save, and every later write to the
console (the signal's own message, the bar, log lines, the summary, Python's flush at exit) meets a pipe
without a reader. A closed terminal or a full disk under `> log` does the same. steady_console() wraps
sys.stdout and sys.stderr so that the first write or flush that fails points the stream at os.devnull
and the run goes on, saves and exits with its own code; what it says from then on is still in its
folder's run.log (run/logs.py).

A command whose result is what it prints (config, compare, show, ...) has no such copy: print_result writes it
past that forgiveness, and a result that cannot be written (`> /dev/full`, a full disk, a closed stdout) ends the
command with one line and exit 2 instead of 0 having written nothing.
"""

from __future__ import annotations

import logging
import os
import sys

from dapo_train.errors import UserError

# A pipe without a reader (BrokenPipeError), an I/O error or a full disk (OSError), a closed file (ValueError).
_LOST = (OSError, ValueError)


class SteadyStream:
    """A text stream whose failures end its output instead of raising; everything else is the stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.lost = False  # a write or flush failed: the stream goes to os.devnull from then on

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except UnicodeError:  # a ValueError too, but the text's fault, not the console's: as before
            raise
        except _LOST:
            self._to_devnull()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except _LOST:
            self._to_devnull()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _to_devnull(self) -> None:
        """The stream's file descriptor onto os.devnull, so that the text still in its buffer and the
        interpreter's flush at exit go nowhere instead of failing again (a BrokenPipeError there would
        turn the exit code into 120); then write to os.devnull from here on."""
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
        except _LOST:  # no descriptor (closed, or not a file): nothing else can write through it
            pass
        self._stream = open(os.devnull, "w", encoding="utf-8")  # the stream for the rest of the process
        self.lost = True

    def write_result(self, text: str) -> None:
        """Write and flush `text` as a result must be: a failure raises (the stream still goes to os.devnull, so
        that the exit's flush does not fail again)."""
        if self.lost:
            raise OSError("an earlier write to it failed")
        try:
            self._stream.write(text)
            self._stream.flush()
        except UnicodeError:
            raise
        except _LOST:
            self._to_devnull()
            raise


def steady_console() -> None:
    """Wrap sys.stdout and sys.stderr (once; one that is None, closed at start, stays None) before anything
    keeps a reference to them: the logging handlers and the progress bar write through what sys.stderr is
    when they are made."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SteadyStream):
            setattr(sys, name, SteadyStream(stream))


def print_result(text: str) -> None:
    """Print a command's result and a newline on stdout, or end the command (UserError, exit 2) naming why it
    could not be written: a result has no copy a reader could turn to, as a run's console has run.log."""
    stream = sys.stdout
    try:
        if stream is None:  # closed before the start (`>&-`)
            raise OSError("it is closed")
        if isinstance(stream, SteadyStream):
            stream.write_result(text + "\n")
        else:
            stream.write(text + "\n")
            stream.flush()
    except UnicodeError:
        raise
    except _LOST as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise UserError(f"standard output cannot be written ({reason}): the result was not printed whole") from None


def console_logging(level: str = "INFO") -> None:
    """One handler (the root's) prints every log line once: transformers and datasets add their own
    stderr handlers to their loggers (and to huggingface_hub's), which doubled each Hub warning."""
    import datasets
    import transformers

    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "transformers", "huggingface_hub"):
        library = logging.getLogger(noisy)
        library.setLevel(logging.WARNING)
        library.handlers.clear()
        library.propagate = True
    # Library progress bars (dataset generation, weight loading) would bury our own bar and errors.
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
