"""Issue 38, point 2: a full disk is a clear stop, not a crash. A checkpoint write that fails removes its
partial folder, keeps the last good checkpoint, and stops with one line, exit code 4 and the resume
command; before training, a checkpoint's size times what checkpoint.keep_last keeps is compared with
the free space."""

import contextlib
import errno
import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from dapo_train.config.load import load_config
from dapo_train.errors import CheckpointNotSaved, UserError
from dapo_train.run import checkpoint as ckpt
from dapo_train.run import disk_space
from dapo_train.run.logs import read_metrics
from dapo_train.train import loop

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=8",
    "train.updates_per_step=1", "train.num_threads=1", "eval.every_steps=0", "eval.final_full=false",
    "logging.progress_bar=false", "logging.rollout_groups=0",
]
GB = 10**9

# The run, with torch.save failing for checkpoint_2's trainer state after the weights, tokenizer and
# config were written (as a disk that fills mid-checkpoint does); every other save is the real one.
FILLS_AT_CHECKPOINT_2 = """
import errno, sys, torch
from dapo_train import cli

real_save = torch.save

def save(obj, f, *args, **kwargs):
    path = getattr(f, "name", f)  # the checkpoint saves into an open file
    if ".tmp_checkpoint_2_" in str(path):
        with open(path, "wb") as partial:
            partial.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(obj, f, *args, **kwargs)

torch.save = save
sys.argv = ["dapo-train", *sys.argv[1:]]
cli.main()
"""


def test_a_full_disk_at_a_checkpoint_stops_in_one_line_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    args = ["run", *SMALL, "train.max_steps=3", "checkpoint.every_steps=1", f"output_dir={run}"]
    result = subprocess.run([sys.executable, "-c", FILLS_AT_CHECKPOINT_2, *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == CheckpointNotSaved.exit_code == 4, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"stopped: could not write checkpoint_2 in {run} (No space left on device); its partial folder "
                    f"was removed and checkpoint_1, the last saved, is intact: free space, then resume with: "
                    f"dapo-train run --resume {run}"), last
    assert [p.name for p in run.iterdir() if "checkpoint" in p.name] == ["checkpoint_1"]  # no partial one left
    assert (run / "run.log").read_text().splitlines()[-1] == last  # the run folder keeps the line too
    ckpt.load_state(run / "checkpoint_1")  # whole: it loads
    resumed = subprocess.run([sys.executable, "-m", "dapo_train", "run", "--resume", str(run)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    run_log = (run / "run.log").read_text()  # the resumed session appends
    assert run_log.index(last) < run_log.index(f"resumed from {run / 'checkpoint_1'} at step 1") < run_log.index(
        f"finished {run}: 3 steps")


def test_a_write_error_that_is_not_the_disks_stays_a_bug(tmp_path, monkeypatch, random_model):
    """torch.save reports a full disk as a RuntimeError ('unexpected pos'): a failure counts as the disk's
    when it is an OSError or the folder then refuses a small write; otherwise it keeps its traceback."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(ckpt.__file__).parents[1] / "assets" / "tiny" / "model")
    cfg = load_config(None, [])

    def broken(*args, **kwargs):
        raise RuntimeError("unexpected pos 576 vs 534")

    monkeypatch.setattr(ckpt.torch, "save", broken)
    save = {"model": random_model, "tokenizer": tokenizer, "cfg": cfg, "state": {"step": 1}}
    with pytest.raises(RuntimeError, match="unexpected pos"):
        ckpt.save_checkpoint(tmp_path, 1, **save)
    monkeypatch.setattr(disk_space, "write_refused", lambda folder: "No space left on device")
    with pytest.raises(CheckpointNotSaved, match=r"could not write checkpoint_1 in .* \(No space left on device\)"):
        ckpt.save_checkpoint(tmp_path, 1, **save)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# What torch.save and safetensors really raise on a full disk (seen on a 2 MiB tmpfs): neither is an OSError.
# torch.save into a file object: RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 704
# vs 598') whose __context__ is the file's OSError(28); into a path: the same RuntimeError over
# RuntimeError('basic_ios::clear: iostream error'), no errno anywhere. safetensors (model.save_pretrained):
# SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)').


class FullFile(io.RawIOBase):
    """A file on a disk with `room` bytes left: the write past them fails as the kernel's does."""

    def __init__(self, target, room: int) -> None:
        self.target, self.room = target, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.target.write(data)


def _torch_save_fills(monkeypatch, model):
    """torch.save of the trainer state meets a full disk after 1,000 bytes: the real torch.save, so the error is
    the one torch raises."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            target = stack.enter_context(open(f, "wb")) if isinstance(f, (str, os.PathLike)) else f
            real_save(obj, FullFile(target, 1000), *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)


def _safetensors_fills(monkeypatch, model):
    """model.save_pretrained writes part of model.safetensors, then raises what safetensors raises."""
    def save_pretrained(folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", save_pretrained)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(ckpt.__file__).parents[1] / "assets" / "tiny" / "model")


@pytest.mark.parametrize("fills", [_torch_save_fills, _safetensors_fills], ids=["torch.save", "safetensors"])
def test_a_full_disk_named_only_in_the_errors_cause_stops_the_save(tmp_path, monkeypatch, random_model, fills):
    """Read from the error itself while this disk has room (the probe would find it): the run stops with the
    one line, the partial folder is gone and checkpoint_1 is byte for byte what it was. Before the fix both
    kept their traceback (neither error is an OSError, and the probe found room)."""
    save = {"model": random_model, "tokenizer": _tiny_tokenizer(), "cfg": load_config(None, [])}
    state = {"step": 1, "moments": torch.zeros(10_000)}  # a tensor: the write that fails is one of its records
    first = ckpt.save_checkpoint(tmp_path, 1, state=state, **save)
    before = _hashes(first)
    fills(monkeypatch, random_model)
    with pytest.raises(CheckpointNotSaved, match=r"^could not write checkpoint_2 in .* \(No space left on device\); "
                                                 r"its partial folder was removed$"):
        ckpt.save_checkpoint(tmp_path, 2, state={**state, "step": 2}, **save)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_1"]
    assert _hashes(first) == before


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A real file system of `size` (tmpfs) at `folder`, where this machine lets the test mount one (root on
    Linux); elsewhere the test is skipped, and the injected errors above still run."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs a tmpfs mounted as root on Linux; the injected errors above stand in")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the injected errors above stand in")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _fill(disk: Path, leave: int) -> None:
    """Take all the free space of `disk` but `leave` bytes."""
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(disk).free - leave))


@pytest.mark.parametrize("leave, failing", [(3 * 10**6, "model.safetensors"), (6 * 10**6, ckpt.STATE_FILE)])
def test_a_real_full_disk_stops_the_save_and_keeps_the_last_checkpoint(tmp_path, leave, failing):
    """On a 16 MiB tmpfs, the shipped tiny model (4.2 MB of weights) and a 4 MB trainer state: with 3 MB left the
    weights do not fit, with 6 MB they do and the state does not. Either way the partial folder goes and the
    earlier checkpoint is untouched. Before the fix: a traceback, the probe ran after the partial folder was
    removed and found the room it had taken."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(ckpt.__file__).parents[1] / "assets" / "tiny" / "model")
    save = {"model": model, "tokenizer": _tiny_tokenizer(), "cfg": load_config(None, [])}
    state = {"step": 1, "moments": torch.zeros(10**6)}  # 4 MB
    with small_disk(tmp_path / "disk", "16m") as disk:
        run = disk / "run"
        first = ckpt.save_checkpoint(run, 1, state=state, **save)
        before, sizes = _hashes(first), {p.name: p.stat().st_size for p in first.iterdir()}
        ahead = sum(size for name, size in sizes.items() if name not in ("model.safetensors", ckpt.STATE_FILE))
        if failing == "model.safetensors":  # the small files fit, the weights do not
            assert ahead < leave < ahead + sizes["model.safetensors"], sizes
        else:  # the weights fit, the state does not
            assert ahead + sizes["model.safetensors"] < leave < sum(sizes.values()), sizes
        _fill(disk, leave)
        with pytest.raises(CheckpointNotSaved, match=r"could not write checkpoint_2 in .* \(No space left on device\)"):
            ckpt.save_checkpoint(run, 2, state={**state, "step": 2}, **save)
        assert [p.name for p in run.iterdir()] == ["checkpoint_1"]
        assert _hashes(first) == before


def test_a_run_that_fills_a_real_disk_exits_4_with_the_resume_command_and_resumes(tmp_path):
    """`dapo-train run` on a 34 MiB tmpfs: the start's estimate (28.7 MB a checkpoint, its 16 MB tokenizer
    allowance included) lets it train; checkpoints of 12.8 MB (4.2 MB of weights, an 8.5 MB trainer state) fill
    it at checkpoint_3's state. One line, exit code 4, checkpoint_2 whole; after the disk grows (free space),
    the command it gave finishes the run. Before the fix: a traceback and exit code 1."""
    with small_disk(tmp_path / "disk", "34m") as disk:
        run = disk / "run"
        args = ["run", *SMALL, "train.max_steps=3", "checkpoint.every_steps=1", f"output_dir={run}"]
        result = subprocess.run([sys.executable, "-m", "dapo_train", *args], cwd=tmp_path, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 4, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last == (f"stopped: could not write checkpoint_3 in {run} (No space left on device); its partial folder "
                        f"was removed and checkpoint_2, the last saved, is intact: free space, then resume with: "
                        f"dapo-train run --resume {run}"), last
        assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint_1", "checkpoint_2"]
        assert (run / "run.log").read_text().splitlines()[-1] == last
        ckpt.load_state(run / "checkpoint_2")
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = subprocess.run([sys.executable, "-m", "dapo_train", "run", "--resume", str(run)], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [row["step"] for row in read_metrics(run)] == [1, 2, 3]
        assert (run / "checkpoint_3" / ckpt.STATE_FILE).is_file()


# --------------------------------------------------------------------------------------------
# Before training: the estimate against the free space.


@pytest.mark.parametrize("every, keep, done, existing, count", [
    (0, 0, 0, 0, 1),  # only the final checkpoint
    (50, 0, 0, 0, 3),  # qwen1.5b.yaml: 50, 100 and the final 150, all kept
    (10, 3, 0, 0, 4),  # 10 .. 150: keep 3, and a 4th while it is written, before pruning
    (10, 3, 120, 3, 1),  # resumed at 120 with three on disk: one more at a time
    (50, 3, 100, 2, 1),  # resumed at 100: only the final one is left to save
])
def test_checkpoints_at_once(every, keep, done, existing, count):
    cfg = load_config(None, ["train.max_steps=150", f"checkpoint.every_steps={every}", f"checkpoint.keep_last={keep}"])
    assert disk_space.new_checkpoints_at_once(cfg, done, existing) == count


def test_keep_best_holds_one_checkpoint_more():
    """checkpoint.keep_best keeps the best beside keep_last's newest: 10 .. 150 with keep_last 3 hold 3, the
    best, and a 5th while one is written; with keep_last 0 every one is kept anyway."""
    def count(*overrides):
        cfg = load_config(None, ["train.max_steps=150", "checkpoint.every_steps=10", "checkpoint.keep_best=true",
                                 *overrides])
        return disk_space.new_checkpoints_at_once(cfg)
    assert count("checkpoint.keep_last=3") == 5
    assert count("checkpoint.keep_last=0") == 15


def test_qwen_1_5b_checkpoint_is_18_5_gb():
    """1,543,714,304 parameters (Qwen2.5-1.5B, tied embeddings) saved in float32 (4 bytes) plus AdamW's two
    float32 moments (8 bytes): 18.52e9 bytes, and the tokenizer's allowance."""
    size = disk_space.checkpoint_bytes(weights=1_543_714_304 * 4, trainable=1_543_714_304 * 4)
    assert size == 1_543_714_304 * 12 + disk_space.TOKENIZER_ALLOWANCE
    assert round(size / GB, 1) == 18.5


@pytest.mark.parametrize("free, outcome", [(5 * GB, "refused"), (25 * GB, "warned"), (70 * GB, "quiet")])
def test_free_space_is_compared_before_training(tmp_path, monkeypatch, caplog, free, outcome):
    """Three checkpoints of 18.5 GB (qwen1.5b.yaml's): not one fits in 5 GB (refused), one but not three in
    25 GB (a warning with the numbers), all in 70 GB."""
    cfg = load_config(None, ["train.max_steps=150", "checkpoint.every_steps=50", f"output_dir={tmp_path / 'run'}"])
    usage = type("Usage", (), {"free": free})
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: usage)
    one = 18_524_000_000
    caplog.set_level(logging.WARNING)
    if outcome == "refused":
        with pytest.raises(UserError, match=r"output_dir .*run: 5.0 GB free, but one checkpoint needs about 18.5 GB "
                                            r"\(3 planned"):
            disk_space.check_disk_space(cfg, tmp_path / "run", one)
        return
    disk_space.check_disk_space(cfg, tmp_path / "run", one)
    warned = [r.getMessage() for r in caplog.records if "free" in r.getMessage()]
    if outcome == "warned":
        assert warned == [f"output_dir {tmp_path / 'run'}: 25.0 GB free, but 3 checkpoints of about 18.5 GB each "
                          "(checkpoint.every_steps=50, checkpoint.keep_last=0) need 55.6 GB at once; the run will stop "
                          "at the first checkpoint that does not fit (exit code 4)"]
    else:
        assert warned == []


def test_a_run_says_the_space_it_needs_from_its_own_model(tmp_path, monkeypatch):
    """The estimate a run makes from its loaded model is the size of the checkpoint it then writes, to 2%."""
    seen = []
    monkeypatch.setattr(disk_space, "check_disk_space", lambda cfg, run_dir, one, *a, **k: seen.append(one))
    run = loop.train(load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={tmp_path / 'run'}"]))
    written = sum((run / "checkpoint_1" / name).stat().st_size for name in ("model.safetensors", ckpt.STATE_FILE))
    assert seen and abs(seen[0] - disk_space.TOKENIZER_ALLOWANCE - written) <= 0.02 * written, (seen, written)


def test_preflight_reports_the_real_models_checkpoints(tmp_path, monkeypatch):
    """qwen1.5b.yaml: float32 weights and AdamW state of 1,543,714,304 parameters, three checkpoints kept."""
    from dapo_train.preflight.real_run import checkpoint_space
    from dapo_train.train.memory import ModelShape

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(str(root / "configs" / "qwen1.5b.yaml"), [f"output_dir={tmp_path / 'run'}"])
    shape = ModelShape(1_543_714_304, 1_543_714_304, 151_936, 1536, 8960, 28, 2, 128)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 40 * GB}))
    assert checkpoint_space(cfg, shape) == (
        f"one checkpoint about 18.5 GB (weights 6.2 GB, AdamW state 12.3 GB, tokenizer); 3 at once "
        f"(checkpoint.every_steps=50, checkpoint.keep_last=0): 55.6 GB; 40.0 GB free for output_dir "
        f"{tmp_path / 'run'}: does NOT fit: the run warns")
    lora = load_config(str(root / "configs" / "qwen1.5b.yaml"), ["model.lora.r=16", "model.dtype=bfloat16"])
    assert checkpoint_space(lora, ModelShape(1_543_714_304, 18_464_768, 151_936, 1536, 8960, 28, 2, 128)
                            ).startswith("one checkpoint about 238 MB (weights 74 MB, AdamW state 148 MB")
