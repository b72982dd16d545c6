"""Preflight's report and its phases: the labelled lines it prints, each phase timed with its failure
named in one line, the package's warnings collected once each, and the phases rank 0 runs alone (or
every rank with it, rank 0 speaking for them).
"""

from __future__ import annotations

import contextlib
import io
import logging
import textwrap
import time
from dataclasses import dataclass, field

from dapo_train.errors import UserError
from dapo_train.train import distributed


@dataclass
class Report:
    """What preflight prints: labelled lines in order, the phases' seconds, the warnings the run gave."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def add(self, label: str, text: str) -> None:
        self.rows.append((label, text))

    def render(self, columns: int = 118) -> str:
        """Labels in a column, each text wrapped beside its label (the prompt's lines kept as they are)."""
        width = max(len(label) for label, _ in self.rows)
        lines = []
        for label, text in self.rows:
            wrapped = [part for line in text.splitlines() or [""] for part in
                       (textwrap.wrap(line, columns - width - 2, subsequent_indent="  ") if label != "prompt"
                        else [line])]
            lines += [f"{label if i == 0 else '':<{width}}  {line}" for i, line in enumerate(wrapped)]
        return "\n".join(lines)


class CollectedWarnings(logging.Handler):
    """Collects the package's warnings while preflight runs, once each, for the report (the rehearsal's
    own resume, and a warning about a key the rehearsal set, are no news)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.ignored: tuple[str, ...] = ("resuming ",)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0]
        if message not in self.messages and not message.startswith(self.ignored):
            self.messages.append(message)


@contextlib.contextmanager
def phase(report: Report, name: str, log: io.StringIO):
    """Time a phase; its stdout goes to the rehearsal's log, and any failure becomes one UserError that
    names the phase (a UserError keeps its own words)."""
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            yield
    except UserError as exc:
        raise UserError(f"preflight {name}: {exc}") from exc
    except Exception as exc:  # the rehearsal's job is to find what breaks: say where, in one line
        raise UserError(f"preflight {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from exc
    finally:
        report.seconds[name] = time.perf_counter() - start


@contextlib.contextmanager
def on_main(report: Report, name: str, log: io.StringIO, every_rank: bool = False):
    """A phase that rank 0 runs alone (yields whether this rank runs it); the others wait, and a
    problem found there stops every rank with the same line. every_rank: every rank runs it too (it
    starts something that all ranks start together: vllm's engines under several processes), and
    rank 0's outcome is the phase's."""
    problem = None
    try:
        with phase(report, name, log):
            yield distributed.is_main() or every_rank
    except UserError as exc:
        problem = str(exc)
    problem = distributed.broadcast(problem)
    if problem is not None:
        raise UserError(problem)
