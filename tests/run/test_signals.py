"""The stop handler: the first signal asks for a graceful stop, a second Ctrl-C stops at once."""

import os
import signal

import pytest

from dapo_train.run.signals import StopRequested


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_first_signal_requests_a_graceful_stop(restore_handlers, capsys):
    stop = StopRequested().install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested and stop.exit_code == 128 + signal.SIGTERM
    assert "finishing this step" in capsys.readouterr().err


def test_second_ctrl_c_stops_at_once(restore_handlers):
    stop = StopRequested().install()
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested and stop.exit_code == 128 + signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_sigterm_after_a_stop_request_does_not_interrupt(restore_handlers, capsys):
    stop = StopRequested().install()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)  # still graceful: only a second Ctrl-C is urgent
    assert stop.requested and stop.exit_code == 128 + signal.SIGINT
    assert capsys.readouterr().err.count("finishing this step") == 1


def test_a_notice_holds_only_while_its_phase_lasts(restore_handlers, capsys):
    """The end-of-run eval says what a signal then does; after it (a sweep's next point shares the handler) a
    signal finishes a step again."""
    stop = StopRequested().install()
    with stop.during("ending the final eval"):
        assert stop.notice == "ending the final eval"
    os.kill(os.getpid(), signal.SIGTERM)
    assert "SIGTERM received: finishing this step and saving a checkpoint" in capsys.readouterr().err


def test_a_hangup_is_a_graceful_stop_as_sigterm_is(restore_handlers, capsys):
    """Issue 59, item 6: a closed terminal or a dropped SSH session (SIGHUP) killed the run at once, its steps since
    the last checkpoint lost; now it finishes the step and saves, and the exit status is 128 + 1 = 129."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a run started from a terminal has it
    stop = StopRequested().install()
    os.kill(os.getpid(), signal.SIGHUP)
    assert stop.requested and stop.exit_code == 129
    assert "SIGHUP received: finishing this step and saving a checkpoint" in capsys.readouterr().err


def test_a_hangup_ignored_at_start_stays_ignored(restore_handlers):
    """`nohup dapo-train run ...` asks that a closed terminal not stop the run at all: that choice stands."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stop = StopRequested().install()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGHUP)
    assert not stop.requested
