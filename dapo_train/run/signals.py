"""Graceful stop on SIGINT/SIGTERM/SIGHUP: the first signal lets the current step finish, then the
trainer writes a checkpoint and exits non-zero with the command that resumes; a second SIGINT
stops at once (KeyboardInterrupt). A hangup (the terminal closed, the SSH session dropped) would
otherwise kill the process on the spot, its steps since the last checkpoint lost; under nohup it stays
ignored, as asked. After the last step the checkpoint is already written: a signal
during the end-of-run eval ends that eval, and the process still exits with the signal's status
(128 + its number: what was asked of it, the eval, was cut short), naming the command that evaluates
the checkpoint instead of a resume."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path

# The signals that ask a run to stop: Ctrl-C, a scheduler's or kill's TERM, a hangup. Under torchrun the launcher
# passes each of them on to the ranks.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequested:
    """Set by a signal handler; polled by the training loop between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.notice = "finishing this step and saving a checkpoint"  # what the first signal's line says happens

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int) -> None:
        self.signum = signum

    @contextlib.contextmanager
    def during(self, notice: str):
        """Inside, the first signal's line says `notice` happens instead (a sweep's next point says its own)."""
        before, self.notice = self.notice, notice
        try:
            yield self
        finally:
            self.notice = before

    def install(self) -> StopRequested:
        for signum in STOP_SIGNALS:
            if signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:
                continue  # nohup: the user asked that a hangup not stop the run at all
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # already stopping: keep the first signal's exit code and message
        self.request(signum)
        if os.environ.get("RANK", "0") != "0":
            return  # a Ctrl-C reaches every rank of a launcher (torchrun, accelerate launch): rank 0 says it once
        name = signal.Signals(signum).name
        print(
            f"\n{name} received: {self.notice} (Ctrl-C again to stop now)",
            file=sys.stderr, flush=True,
        )

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def resume_line(self, run_dir: Path, processes: int = 1) -> str:
        """The exact command that continues the run: --resume RUN_DIR reads the run's own saved config;
        a run of several processes resumes under the same launcher with as many."""
        from dapo_train.run.folder import resume_command

        command = resume_command(run_dir)
        if processes > 1:
            command = command.replace("dapo-train", f"torchrun --nproc_per_node {processes} -m dapo_train", 1)
            command += f" (or accelerate launch with --num_processes {processes})"
        return f"stopped early; resume with: {command}"

    def final_eval_line(self, checkpoint: Path | None) -> str:
        """What a stop after the last step cut short, and the command that evaluates the run's last checkpoint."""
        name = signal.Signals(self.signum).name if self.signum else "a stop"
        if checkpoint is None:
            return f"{name}: the training finished without a checkpoint; the final eval was stopped, nothing recorded"
        return (f"{name}: the training finished and its last checkpoint is {checkpoint}; the final eval was stopped, "
                f"nothing of it recorded; evaluate the checkpoint with: dapo-train eval {shlex.quote(str(checkpoint))}")
