"""Issue 38, point 2: a full disk is a clear stop, not a crash. A checkpoint write that fails removes its
partial folder, keeps the last good checkpoint, and stops with one line, exit code 4 and the resume
command; before training, a checkpoint's size times what checkpoint.keep_last keeps is compared with
the free space."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import CheckpointNotSaved, UserError
from dapo_train.model import checkpoint as ckpt
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

def save(obj, path, *args, **kwargs):
    if ".tmp_checkpoint_2_" in str(path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(obj, path, *args, **kwargs)

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
    ckpt.load_state(run / "checkpoint_1")  # whole: it loads
    resumed = subprocess.run([sys.executable, "-m", "dapo_train", "run", "--resume", str(run)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]


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
    monkeypatch.setattr(ckpt, "_write_refused", lambda folder: "No space left on device")
    with pytest.raises(CheckpointNotSaved, match=r"could not write checkpoint_1 in .* \(No space left on device\)"):
        ckpt.save_checkpoint(tmp_path, 1, **save)
    assert list(tmp_path.iterdir()) == []


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
    assert ckpt.new_checkpoints_at_once(cfg, done, existing) == count


def test_keep_best_holds_one_checkpoint_more():
    """checkpoint.keep_best keeps the best beside keep_last's newest: 10 .. 150 with keep_last 3 hold 3, the
    best, and a 5th while one is written; with keep_last 0 every one is kept anyway."""
    def count(*overrides):
        cfg = load_config(None, ["train.max_steps=150", "checkpoint.every_steps=10", "checkpoint.keep_best=true",
                                 *overrides])
        return ckpt.new_checkpoints_at_once(cfg)
    assert count("checkpoint.keep_last=3") == 5
    assert count("checkpoint.keep_last=0") == 15


def test_qwen_1_5b_checkpoint_is_18_5_gb():
    """1,543,714,304 parameters (Qwen2.5-1.5B, tied embeddings) saved in float32 (4 bytes) plus AdamW's two
    float32 moments (8 bytes): 18.52e9 bytes, and the tokenizer's allowance."""
    size = ckpt.checkpoint_bytes(weights=1_543_714_304 * 4, trainable=1_543_714_304 * 4)
    assert size == 1_543_714_304 * 12 + ckpt.TOKENIZER_ALLOWANCE
    assert round(size / GB, 1) == 18.5


@pytest.mark.parametrize("free, outcome", [(5 * GB, "refused"), (25 * GB, "warned"), (70 * GB, "quiet")])
def test_free_space_is_compared_before_training(tmp_path, monkeypatch, caplog, free, outcome):
    """Three checkpoints of 18.5 GB (qwen1.5b.yaml's): not one fits in 5 GB (refused), one but not three in
    25 GB (a warning with the numbers), all in 70 GB."""
    cfg = load_config(None, ["train.max_steps=150", "checkpoint.every_steps=50", f"output_dir={tmp_path / 'run'}"])
    usage = type("Usage", (), {"free": free})
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage)
    one = 18_524_000_000
    caplog.set_level(logging.WARNING)
    if outcome == "refused":
        with pytest.raises(UserError, match=r"output_dir .*run: 5.0 GB free, but one checkpoint needs about 18.5 GB "
                                            r"\(3 planned"):
            ckpt.check_disk_space(cfg, tmp_path / "run", one)
        return
    ckpt.check_disk_space(cfg, tmp_path / "run", one)
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
    monkeypatch.setattr(ckpt, "check_disk_space", lambda cfg, run_dir, one, *a, **k: seen.append(one))
    run = loop.train(load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={tmp_path / 'run'}"]))
    written = sum((run / "checkpoint_1" / name).stat().st_size for name in ("model.safetensors", ckpt.STATE_FILE))
    assert seen and abs(seen[0] - ckpt.TOKENIZER_ALLOWANCE - written) <= 0.02 * written, (seen, written)


def test_preflight_reports_the_real_models_checkpoints(tmp_path, monkeypatch):
    """qwen1.5b.yaml: float32 weights and AdamW state of 1,543,714,304 parameters, three checkpoints kept."""
    from dapo_train.preflight.command import checkpoint_space
    from dapo_train.preflight.memory import ModelShape

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(str(root / "configs" / "qwen1.5b.yaml"), [f"output_dir={tmp_path / 'run'}"])
    shape = ModelShape(1_543_714_304, 1_543_714_304, 151_936, 1536, 8960, 28, 2, 128)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 40 * GB}))
    assert checkpoint_space(cfg, shape) == (
        f"one checkpoint about 18.5 GB (weights 6.2 GB, AdamW state 12.3 GB, tokenizer); 3 at once "
        f"(checkpoint.every_steps=50, checkpoint.keep_last=0): 55.6 GB; 40.0 GB free for output_dir "
        f"{tmp_path / 'run'}: does NOT fit: the run warns")
    lora = load_config(str(root / "configs" / "qwen1.5b.yaml"), ["model.lora.r=16", "model.dtype=bfloat16"])
    assert checkpoint_space(lora, ModelShape(1_543_714_304, 18_464_768, 151_936, 1536, 8960, 28, 2, 128)
                            ).startswith("one checkpoint about 238 MB (weights 74 MB, AdamW state 148 MB")
