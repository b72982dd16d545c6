"""Issue 47, point 8: a console that loses its reader (`| tee log` ended by the same Ctrl-C) never stops a
run, nor changes its exit code; run.log keeps what the run said and how it ended."""

import logging
import os
import subprocess
import sys

import pytest

from dapo_train.errors import CheckpointNotSaved, RunRegressed
from dapo_train.run.logs import RUN_LOG, RUN_STATUS, RunLog, read_status

# Writes to stdout and stderr, a log line and a flush at exit, all after the pipe's reader is gone; exits 130
# as a run stopped by Ctrl-C does. 100,000 characters: more than Python's buffer and the pipe's.
AFTER_THE_READER_WENT = """
import logging, sys
from dapo_train.run.console import steady_console
if sys.argv[1] == "steady":
    steady_console()
logging.basicConfig(level="INFO")
print("x" * 100_000)
print("finishing this step", file=sys.stderr, flush=True)
logging.getLogger("run").info("saved checkpoint_2")
print("stopped early; resume with: ...", file=sys.stderr, flush=True)
print("end of the summary")
open(sys.argv[2], "w").write("reached the end")
sys.exit(130)
"""


# Only Python's own flush of stdout at exit meets the closed pipe (stdout into a pipe is block-buffered): that
# alone turns exit code 130 into 120.
AT_EXIT = """
import sys
from dapo_train.run.console import steady_console
if sys.argv[1] == "steady":
    steady_console()
print("end of the summary")
open(sys.argv[2], "w").write("reached the end")
sys.exit(130)
"""


BUFFERED = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as a user's shell


@pytest.mark.parametrize("script", [AFTER_THE_READER_WENT, AT_EXIT], ids=["writes", "at-exit"])
@pytest.mark.parametrize("steady", [True, False], ids=["steady", "control"])
def test_writes_to_a_pipe_without_a_reader_neither_stop_the_process_nor_change_its_exit_code(tmp_path, steady, script):
    """With steady_console() the process reaches its end and exits 130. Without it (the control) the first
    print raises BrokenPipeError and the process stops there, as the run did at its progress bar's write, or
    the flush at exit fails; the exit code is 120 either way (the traceback cannot be written either)."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write, as tee after the Ctrl-C
    end = tmp_path / "end"
    try:
        done = subprocess.run([sys.executable, "-c", script, "steady" if steady else "plain", str(end)],
                              stdout=write, stderr=write, timeout=120, env=BUFFERED)
    finally:
        os.close(write)
    assert done.returncode == (130 if steady else 120)
    assert end.exists() == (steady or script is AT_EXIT)


def test_the_run_log_keeps_log_lines_what_the_run_says_and_how_it_ended(tmp_path, capsys):
    """A first session's log line, its summary (said: console and file) and the stop it raised, in the command's
    words; a resumed session appends; outside the session nothing more is written there."""
    logging.getLogger().setLevel(logging.INFO)
    with pytest.raises(CheckpointNotSaved), RunLog(tmp_path, resumed=False) as run_log:
        logging.getLogger("dapo_train.test").info("saved checkpoint_1")
        run_log.say("stopped at step 2")
        raise CheckpointNotSaved("could not write checkpoint_2 (No space left on device)")
    logging.getLogger("dapo_train.test").warning("after the session")
    with RunLog(tmp_path, resumed=True) as run_log:
        run_log.say("finished at step 3", sys.stderr)
    lines = (tmp_path / RUN_LOG).read_text().splitlines()
    assert lines[0].endswith(" INFO dapo_train.test: saved checkpoint_1"), lines
    assert lines[1:] == ["stopped at step 2", "stopped: could not write checkpoint_2 (No space left on device)",
                         "finished at step 3"]
    said = capsys.readouterr()
    assert said.out == "stopped at step 2\n" and said.err.endswith("finished at step 3\n")


def test_the_run_status_says_how_the_last_session_ended(tmp_path):
    """Issue 59 item 16: `compare`'s status column reads run_status.json, a record, not run.log's prose."""
    assert read_status(tmp_path) is None  # a run from before the record
    with RunLog(tmp_path, resumed=False) as run_log:
        assert read_status(tmp_path) == {"status": "running", "step": None}  # a kill leaves it so
        run_log.end("finished", 40)
    assert read_status(tmp_path) == {"status": "finished", "step": 40}
    with pytest.raises(RunRegressed), RunLog(tmp_path, resumed=True) as run_log:
        run_log.end("regressed", 12)  # the summary first, then the verdict raised: the step stays
        raise RunRegressed("step 12: worse than at step 0")
    assert read_status(tmp_path) == {"status": "regressed", "step": 12}
    for error, status in ((CheckpointNotSaved("disk full"), "stopped"), (KeyboardInterrupt(), "interrupted"),
                          (RuntimeError("a bug"), "crashed")):
        with pytest.raises(type(error)), RunLog(tmp_path, resumed=True):
            raise error
        assert read_status(tmp_path) == {"status": status, "step": None}
    (tmp_path / RUN_STATUS).write_text("{not json")
    assert read_status(tmp_path) is None
