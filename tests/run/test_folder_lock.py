"""Issue 52 item 7: one command at a time in a folder. Two runs started at once into one output_dir: one
refuses in one line naming the other (pid, host), exit 2, and the other's files are whole; a lock left by a
dead process is taken over, saying so; a sweep's folder and a kept preflight are held the same way; under
several ranks only the main process locks."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import UserError, one_line_exits
from dapo_train.run.layout import RUN_MARKER, run_kind
from dapo_train.run.lock import check_free, hold_folder
from dapo_train.run.logs import read_metrics
from dapo_train.run.outputs import holds_own, remove_own
from dapo_train.train import loop

ROOT = Path(__file__).resolve().parents[2]
LOCK = ".dapo-train.lock"
NO_LOCK = "DAPO_TRAIN_NO_FOLDER_LOCK"  # the documented switch for file systems that refuse flock
SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=8",
    "train.updates_per_step=1", "train.num_threads=1", "eval.every_steps=0", "eval.final_full=false",
    "logging.progress_bar=false", "logging.rollout_groups=0",
]


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stale_lock(folder: Path, pid: int) -> None:
    """The lock file a run killed with -9 leaves: its holder's record, no process holding it (written by hand)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": time.time()}) + "\n")


def test_two_runs_started_at_once_into_one_folder(tmp_path):
    """Reproduced: both exited 0 and their metrics interleaved (steps 1,1,2,2). Now the second refuses at start."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dapo_train", "run", *SMALL, "train.max_steps=2", "checkpoint.every_steps=1",
               f"output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    said = [run.communicate(timeout=600)[1] for run in runs]
    by_code = {run.returncode: (run.pid, err) for run, err in zip(runs, said)}
    assert sorted(by_code) == [0, 2], said
    (winner, _), (_, refusal) = by_code[0], by_code[2]
    last = refusal.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: output_dir {re.escape(str(out))} is in use by another dapo-train command \(pid "
                        rf"{winner} on host {re.escape(socket.gethostname())}, started 20[-0-9]+ [0-9:]+ UTC\); wait "
                        r"for it to end, or choose another folder \(nothing was changed\)", last), refusal
    # The winner's files are whole: its own steps once each, both checkpoints, and no lock left behind.
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    assert [line.split(",")[0] for line in (out / "training_losses.txt").read_text().splitlines()] == ["1", "2"]
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2"]
    assert not (out / LOCK).exists()


def test_a_second_command_is_refused_while_the_folder_is_held(tmp_path):
    folder = tmp_path / "run"
    with hold_folder(folder, "output_dir"):
        record = json.loads((folder / LOCK).read_text())
        assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(UserError, match=rf"output_dir {folder} is in use by another dapo-train command \(pid "
                                            rf"{os.getpid()} on host {socket.gethostname()}, started 20"):
            with hold_folder(folder, "output_dir"):
                pass
    assert not folder.exists()  # made for the lock and left empty: removed with it


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    """A run killed during setup left only its lock file: the folder is free, and the new run says whose it was."""
    out, pid = tmp_path / "run", dead_pid()
    stale_lock(out, pid)
    loop.train(load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={out}"]))
    assert f"output_dir {out}: took over the lock left by pid {pid} on host {socket.gethostname()}" in caplog.text
    assert (out / "checkpoint_1").is_dir() and not (out / LOCK).exists()


def test_only_the_main_rank_locks(tmp_path, monkeypatch):
    """Under torchrun every rank runs the same start; the lock is rank 0's, so rank 1 passes through it."""
    folder = tmp_path / "run"
    with hold_folder(folder, "output_dir"):
        monkeypatch.setenv("RANK", "1")
        with hold_folder(folder, "output_dir"):
            pass
        assert (folder / LOCK).is_file()  # rank 1 left rank 0's lock alone


def test_a_held_lock_is_no_foreign_file_and_overwrite_keeps_it(tmp_path):
    """The lock file is every output folder's own: --overwrite does not refuse it as the user's, and never removes
    it (the run replacing the folder holds it)."""
    out = tmp_path / "run"
    cfg = load_config(None, [*SMALL, f"output_dir={out}"])
    with hold_folder(out, "output_dir"):
        (out / RUN_MARKER).write_text("{}\n")
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        assert holds_own(out, run_kind(cfg), option="output_dir", replace=True)
        assert remove_own(out, run_kind(cfg), "--overwrite") == [RUN_MARKER, "metrics.jsonl"]
        assert sorted(p.name for p in out.iterdir()) == [LOCK]


def test_a_sweep_refuses_a_sweep_folder_in_use(tmp_path, monkeypatch):
    from dapo_train.run.signals import StopRequested
    from dapo_train.study.sweep import plan_sweep, run_sweep

    def train(*args, **kwargs):
        raise AssertionError("a point trained")

    monkeypatch.setattr(loop, "train", train)
    folder = tmp_path / "s"
    plan = plan_sweep(str(ROOT / "configs" / "tiny-cpu.yaml"), ["dapo.eps_high=0.1,0.5"], None, str(folder))
    with hold_folder(folder, "--dir"):
        with pytest.raises(UserError, match=rf"--dir {folder} is in use by another dapo-train command \(pid "
                                            rf"{os.getpid()} "):
            run_sweep(plan, StopRequested())


def test_preflight_keep_refuses_a_folder_in_use(tmp_path, monkeypatch):
    from dapo_train.preflight import command

    def rehearse(*args, **kwargs):
        raise AssertionError("the rehearsal ran")

    monkeypatch.setattr(command, "_rehearse", rehearse)
    kept = tmp_path / "kept"
    with hold_folder(kept, "--keep"):
        with pytest.raises(UserError, match=rf"--keep {kept} is in use by another dapo-train command \(pid "
                                            rf"{os.getpid()} "):
            command.preflight(load_config(None, []), "the embedded demo", str(kept))


def refused_flock(monkeypatch, code: int) -> None:
    """flock on the folder's lock file as a file system without locks answers it (NFS without a lock daemon:
    ENOLCK; some cluster file systems: EOPNOTSUPP); other files' locks (the datasets cache's) as before."""
    import fcntl

    original = fcntl.flock

    def flock(fd, operation):
        if os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}").endswith(LOCK):
            raise OSError(code, os.strerror(code))
        return original(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_that_refuses_flock_stops_a_run_in_one_line(tmp_path, monkeypatch, capsys, code):
    """Issue 59 item 5: where flock itself is refused every run stopped with a raw OSError traceback (exit 1) and
    no way around it. One line naming the folder and the switch, exit 2, before anything loads; nothing left."""
    out = tmp_path / "run"
    refused_flock(monkeypatch, code)
    monkeypatch.delenv(NO_LOCK, raising=False)
    with pytest.raises(SystemExit) as ended, one_line_exits(debug=False):
        loop.train(load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={out}"]))
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith(f"error: output_dir {out}: this file system refuses the folder lock (")
    assert os.strerror(code) in line and f"{NO_LOCK}=1" in line and "(nothing was changed)" in line
    assert not out.exists()


def test_check_free_on_such_a_file_system_refuses_in_one_line_too(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    stale_lock(folder, dead_pid())
    refused_flock(monkeypatch, errno.ENOLCK)
    monkeypatch.delenv(NO_LOCK, raising=False)
    with pytest.raises(UserError, match=rf"--dir {folder}: this file system refuses the folder lock .*{NO_LOCK}=1"):
        check_free(folder, "--dir")


def test_the_documented_switch_runs_without_the_lock_and_says_so(tmp_path, monkeypatch, caplog):
    """DAPO_TRAIN_NO_FOLDER_LOCK=1 (docs/training.md): no flock is asked for and no lock file written; one line
    says what that risks. The run trains as any other."""
    out = tmp_path / "run"
    refused_flock(monkeypatch, errno.ENOLCK)
    monkeypatch.setenv(NO_LOCK, "1")
    check_free(out, "output_dir")
    loop.train(load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={out}"]))
    said = [r.getMessage() for r in caplog.records if NO_LOCK in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"output_dir {out} is not locked ({NO_LOCK}=1)"), said
    assert "a second command into it is not refused" in said[0]
    assert (out / "checkpoint_1").is_dir() and not (out / LOCK).exists()


def test_a_lock_file_from_another_host_is_taken_over_saying_what_is_known(tmp_path, caplog):
    """Its process was said to "no longer run", never checked: this host cannot check another's processes. The
    line names its pid, host and start, and says so."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK).write_text(json.dumps({"pid": 4242, "host": "gpu-7", "started": 1.8e9}) + "\n")
    with caplog.at_level("WARNING", logger="dapo_train"), hold_folder(folder, "output_dir"):
        pass
    said = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(said) == 1 and "no longer runs" not in said[0], said
    assert said[0].startswith(f"output_dir {folder}: took over the lock left by pid 4242 on host gpu-7, started "
                              "2027-01-15 08:00:00 UTC")
    assert "this host cannot check whether it still runs" in said[0]


def test_a_lock_file_of_a_live_process_of_this_host_is_not_called_dead(tmp_path, caplog):
    """The lock is free, so no process holds it; but the pid it names runs (a reused pid, or a process that
    opened the folder elsewhere): the line says it no longer holds the lock, not that it has ended."""
    folder = tmp_path / "run"
    stale_lock(folder, os.getppid())
    with caplog.at_level("WARNING", logger="dapo_train"), hold_folder(folder, "output_dir"):
        pass
    said = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(said) == 1 and "no longer runs" not in said[0] and "no longer holds it" in said[0], said
