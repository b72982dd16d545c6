"""Checkpoints are atomic, pruned, never hold NaN weights, and report disk errors clearly."""

import errno

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.errors import CheckpointNotSaved, UserError
from dapo_train.model.random_state import rng_state
from dapo_train.run import checkpoint as ckpt

from conftest import make_random_model


class NoTokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def _save(run_dir, step, model, good=True, best=None, overrides=(), **kw):
    # The keys every trainer state holds (load_state refuses a file without them); empty where unused here.
    state = {"step": step, "bad_steps": 0, "sampler": {}, "buffer": {}, "rng": rng_state(), "optimizer": {},
             "good": good, ckpt.BEST_KEY: best}
    return ckpt.save_checkpoint(
        run_dir, step, model=model, tokenizer=NoTokenizer(), cfg=load_config(None, list(overrides)), state=state, **kw
    )


def test_save_writes_model_config_and_state_loadable_weights_only(tmp_path):
    path = _save(tmp_path, 3, make_random_model())
    assert path.name == "checkpoint_3"
    assert {"config.yaml", "model.safetensors", "trainer_state.pt", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    state = ckpt.load_state(path)  # torch.load(weights_only=True) inside
    assert state["step"] == 3
    assert ckpt.latest_checkpoint(tmp_path) == path


def test_a_crash_during_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model = make_random_model()
    first = _save(tmp_path, 1, model)
    before = sorted(p.name for p in first.iterdir())

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C or a kill arriving mid-write

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_1"]
    assert sorted(p.name for p in first.iterdir()) == before
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_a_leftover_temporary_folder_is_never_taken_for_a_checkpoint(tmp_path):
    _save(tmp_path, 1, make_random_model())
    (tmp_path / ".tmp_checkpoint_2_999").mkdir()  # what a kill -9 mid-save leaves behind
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint_1"


def test_disk_full_is_one_clear_error(tmp_path, monkeypatch):
    model = make_random_model()
    _save(tmp_path, 1, model)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model, "save_pretrained", full)
    with pytest.raises(CheckpointNotSaved, match=r"could not write checkpoint_2 .*\(No space left on device\); its "
                                                 "partial folder was removed"):
        _save(tmp_path, 2, model)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_1"]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_nan_weights_are_never_saved(tmp_path):
    model = make_random_model()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        _save(tmp_path, 1, model)
    assert ckpt.checkpoint_dirs(tmp_path) == []


def test_keep_last_prunes_the_oldest(tmp_path):
    model = make_random_model()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, keep_last=2)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_3", "checkpoint_4"]


def test_keep_last_prunes_only_the_checkpoints_the_run_wrote(tmp_path):
    """Issue 59, item 7, in pruning: a checkpoint_1/ of the user's (its trainer_state.pt a 5-byte text file) lost that
    file to keep_last as a checkpoint of the run's would. It is not the run's: pruning leaves it whole."""
    mine = tmp_path / "checkpoint_1" / "trainer_state.pt"
    mine.parent.mkdir()
    mine.write_text("mine\n")
    model = make_random_model()
    for step in (2, 3):
        _save(tmp_path, step, model, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1", "checkpoint_3"]
    assert mine.read_text() == "mine\n"


def test_keep_last_never_prunes_the_last_checkpoint_of_good_weights(tmp_path):
    """checkpoint_2 holds good weights, 3 and 4 suspect ones (a stop after a non-finite step saved them):
    keep_last=1 keeps 4 and the newest good one; once a good one is newer, the old good one goes. A
    checkpoint from before the flag is good when it counted no non-finite step."""
    model = make_random_model()
    for step, good in ((1, True), (2, True), (3, False), (4, False)):
        _save(tmp_path, step, model, good=good, keep_last=1)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_2", "checkpoint_4"]
    _save(tmp_path, 5, model, keep_last=1)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_5"]
    old = ckpt.load_state(tmp_path / "checkpoint_5")
    del old["good"]
    assert ckpt.holds_good_weights(old) and not ckpt.holds_good_weights({**old, "bad_steps": 1})


def test_keep_last_never_prunes_the_best_checkpoint_its_state_records(tmp_path):
    """checkpoint.keep_best: checkpoint_2 is the best from step 2 on, so keep_last=1 keeps it beside the
    newest; once a later one is the best, it goes at the next save. The run's best is what its newest
    checkpoint records."""
    model = make_random_model()
    _save(tmp_path, 1, model, keep_last=1)
    for step in (2, 3, 4):
        _save(tmp_path, step, model, best={"step": 2, "accuracy": 0.5}, keep_last=1)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_2", "checkpoint_4"]
    assert ckpt.best_checkpoint(tmp_path) == (tmp_path / "checkpoint_2", ckpt.CheckpointScore(2, 0.5))
    _save(tmp_path, 5, model, best={"step": 5, "accuracy": 0.6}, keep_last=1)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["checkpoint_5"]


def test_a_run_without_a_recorded_best_checkpoint_says_so(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path} holds no checkpoint_<step> folder; --best takes a run folder"):
        ckpt.best_checkpoint(tmp_path)
    model = make_random_model()
    _save(tmp_path, 1, model)
    with pytest.raises(UserError, match=r"records no best checkpoint: it ran without checkpoint.keep_best; its "
                                        "checkpoints: checkpoint_1"):
        ckpt.best_checkpoint(tmp_path)
    _save(tmp_path, 2, model, best={"step": 1, "accuracy": 0.5})
    (tmp_path / "checkpoint_1" / "model.safetensors").unlink()
    (tmp_path / "checkpoint_1").rename(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="its best checkpoint, checkpoint_1 .eval accuracy 0.500., is gone"):
        ckpt.best_checkpoint(tmp_path)


def test_a_keep_best_run_without_a_ranked_checkpoint_says_why(tmp_path):
    """Issue 52, item 14: a run with checkpoint.keep_best records no best when no periodic eval ranked a
    checkpoint it saved; `eval RUN --best` said it "ran without checkpoint.keep_best". It names the cause, read
    in the checkpoint's config: eval.every_steps=0, or no checkpoint saved at an eval step (a run stopped early)."""
    model = make_random_model()
    _save(tmp_path / "off", 40, model, overrides=["checkpoint.keep_best=true", "eval.every_steps=0"])
    with pytest.raises(UserError, match=r"records no best checkpoint: checkpoint.keep_best cannot act: "
                                        r"eval.every_steps=0, no periodic eval ranks the checkpoints; its "
                                        r"checkpoints: checkpoint_40; name one$"):
        ckpt.best_checkpoint(tmp_path / "off")
    _save(tmp_path / "early", 3, model, overrides=["checkpoint.keep_best=true", "eval.every_steps=5"])
    with pytest.raises(UserError, match=r"records no best checkpoint: checkpoint.keep_best ranks a checkpoint saved "
                                        r"at a periodic eval's step \(eval.every_steps=5\), and none of its "
                                        r"checkpoints was saved at one; its checkpoints: checkpoint_3; name one$"):
        ckpt.best_checkpoint(tmp_path / "early")


def test_missing_state_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="trainer_state.pt is missing"):
        ckpt.load_state(tmp_path)


def test_checkpoint_files_get_the_mode_the_umask_gives_new_files(tmp_path):
    """safetensors writes model.safetensors as 0600; the checkpoint's files follow the umask like
    every other file of the run (0644 under the usual 022), so the weights can be shared."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = _save(tmp_path, 1, make_random_model())
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert modes["model.safetensors"] == 0o644, modes
    assert set(modes.values()) == {0o644}


def test_keep_last_keeps_what_the_user_put_in_an_old_checkpoint(tmp_path, caplog):
    """A user's notes (and a folder of theirs) inside checkpoint_1/ survive keep_last byte for byte: the pruning
    removes the files the run wrote there and keeps the folder with the notes, saying so; a checkpoint holding
    only the run's files goes whole."""
    model = make_random_model()
    first = _save(tmp_path, 1, model, keep_last=1)
    (first / "notes.md").write_bytes(b"step 1 looked good\n")
    (first / "plots").mkdir()
    (first / "plots" / "loss.png").write_bytes(b"\x89PNG fake")
    _save(tmp_path, 2, model, keep_last=1)
    _save(tmp_path, 3, model, keep_last=1)
    assert (first / "notes.md").read_bytes() == b"step 1 looked good\n"
    assert (first / "plots" / "loss.png").read_bytes() == b"\x89PNG fake"
    assert sorted(p.name for p in first.iterdir()) == ["notes.md", "plots"]  # the weights and state went
    assert not (tmp_path / "checkpoint_2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1", "checkpoint_3"]
    kept = [r.getMessage() for r in caplog.records if "checkpoint_1" in r.getMessage()]  # said once, not at each save
    assert len(kept) == 1 and "notes.md" in kept[0] and "plots/" in kept[0]
