"""`preflight --keep DIR` (issue 38 point 1, issue 47 items 2 and 3): it writes only into a folder that is new,
empty or one it marked, removes of an earlier rehearsal only what that rehearsal wrote (inside run/, model/,
export/ too), refuses anything else in one line with every file left byte for byte, and names what it removed."""

import hashlib
import json
import logging
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.preflight import command
from dapo_train.preflight.command import preflight


def tree(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` -> its content's sha256 ('dir' for a folder)."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def write(path: Path, text: str = "x\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def marker(path: Path, kind: str, entries: list[str] | None = None) -> None:
    """A marker as dapo-train writes it (written here by hand: the test does not trust the code it checks); a
    folder written whole (a model, an export) lists what it holds."""
    data = {"written_by": "dapo-train", "version": "0", "kind": kind, **({"entries": entries} if entries else {})}
    write(path, json.dumps(data) + "\n")


def earlier_rehearsal(kept: Path) -> Path:
    """What a rehearsal leaves in --keep DIR: its marker and log, the rehearsal model, a reward model's
    stand-in, the run and the export (tests/preflight/test_verdicts.py checks a real one is all of that)."""
    marker(kept / ".dapo-train-preflight", "dapo-train preflight folder")
    write(kept / "preflight.log")
    for folder in (kept / "model", kept / "reward_model_0"):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            write(folder / name)
        marker(folder / ".dapo-train-rehearsal-model", "rehearsal model folder",
               ["config.json", "model.safetensors", "tokenizer.json"])
    run = kept / "run"
    marker(run / ".dapo-train-run", "dapo-train run folder")
    for name in ("config.yaml", "metrics.jsonl", "training_losses.txt", "accuracy_losses.txt",
                 "checkpoint_2/trainer_state.pt", "checkpoint_3/trainer_state.pt", "eval_items/step_0.jsonl",
                 "eval_items/final_3.jsonl", "rollouts/step_1.jsonl"):
        write(run / name)
    for checkpoint in ("checkpoint_2", "checkpoint_3"):
        marker(run / checkpoint / ".dapo-train-checkpoint", "checkpoint folder")
    for name in ("config.json", "model.safetensors"):
        write(kept / "export" / name)
    marker(kept / "export" / ".dapo-train-export", "dapo-train export folder", ["config.json", "model.safetensors"])
    return kept


@pytest.fixture
def no_rehearsal(monkeypatch):
    """The folder checks alone: the rehearsal itself (a minute of training) must not run after a refusal."""
    def refuse(*args, **kwargs):
        raise AssertionError("the rehearsal ran")

    monkeypatch.setattr(command, "_rehearse", refuse)


def refused(keep: Path, *needles: str) -> None:
    with pytest.raises(UserError) as caught:
        preflight(load_config(None, []), "the embedded demo", str(keep))
    message = str(caught.value)
    assert "\n" not in message and "nothing was changed" in message, message
    for needle in needles:
        assert needle in message, message


def test_keep_never_touches_a_folder_it_did_not_mark(tmp_path, no_rehearsal):
    """Reproduced: the user's preflight.log and run/notes.txt were deleted, exit 0, silently."""
    mine = tmp_path / "mine"
    write(mine / "preflight.log", "my own log\n")
    write(mine / "run" / "notes.txt", "my notes\n")
    before = tree(mine)
    refused(mine, "--keep", "is not empty and is not a dapo-train preflight folder", "no .dapo-train-preflight",
            "preflight.log, run/")
    assert tree(mine) == before


@pytest.mark.parametrize("added, named", [
    ("notes.txt", "(notes.txt)"),
    ("run/notes.txt", "(run/notes.txt)"),
    ("run/rollouts/notes.txt", "(run/rollouts/notes.txt)"),
    ("run/eval_items/mine.jsonl", "(run/eval_items/mine.jsonl)"),
    ("model/notes.txt", "(model/notes.txt)"),
    ("reward_model_0/tokenizer_config.json", "(reward_model_0/tokenizer_config.json)"),
    ("export/README.md", "(export/README.md)"),
    # Issue 52, item 1: names that only look like the run's, and notes inside a checkpoint it wrote
    ("run/checkpoint_1.tar.gz", "(run/checkpoint_1.tar.gz)"),
    ("run/checkpoint_1_notes.md", "(run/checkpoint_1_notes.md)"),
    ("run/abandoned_after_step_review.txt", "(run/abandoned_after_step_review.txt)"),
    ("run/checkpoint_3/notes.md", "(run/checkpoint_3/notes.md)"),
    ("run/eval_items/step_1_mine.jsonl", "(run/eval_items/step_1_mine.jsonl)"),
    ("reward_model_0x/notes.md", "(reward_model_0x/)"),
])
def test_keep_refuses_what_it_did_not_write_in_its_own_folder(tmp_path, no_rehearsal, added, named):
    """A file the user put anywhere in a kept rehearsal, its nested folders included: nothing is removed."""
    kept = earlier_rehearsal(tmp_path / "kept")
    write(kept / added, "mine\n")
    before = tree(kept)
    refused(kept, "also holds what no dapo-train preflight folder writes", named)
    assert tree(kept) == before


@pytest.mark.parametrize("unmarked", ["run/.dapo-train-run", "model/.dapo-train-rehearsal-model",
                                      "export/.dapo-train-export"])
def test_keep_refuses_a_nested_folder_it_did_not_mark(tmp_path, no_rehearsal, unmarked):
    kept = earlier_rehearsal(tmp_path / "kept")
    (kept / unmarked).unlink()
    before = tree(kept)
    folder, name = unmarked.split("/")
    refused(kept, f"({folder}/ without {name})")
    assert tree(kept) == before


def test_keep_replaces_an_earlier_rehearsal_and_says_what_it_removed(tmp_path, monkeypatch, caplog):
    kept = earlier_rehearsal(tmp_path / "kept")
    monkeypatch.setattr(command, "_rehearse", lambda *args: None)
    with caplog.at_level(logging.WARNING):
        preflight(load_config(None, []), "the embedded demo", str(kept))
    assert sorted(p.name for p in kept.iterdir()) == [".dapo-train-preflight", "preflight.log"]  # written anew
    assert (f"--keep: removed what an earlier rehearsal wrote in {kept}: 6 entries: .dapo-train-preflight, export/, "
            "model/, preflight.log, reward_model_0/, run/") in caplog.text


def test_keep_is_refused_where_run_would_be(tmp_path, monkeypatch, no_rehearsal):
    mywork = tmp_path / "mywork"
    write(mywork / "notes.txt", "my notes\n")
    before = tree(mywork)
    refused(mywork, "--keep", "is not a dapo-train preflight folder")
    monkeypatch.chdir(mywork)
    refused(Path("."), "--keep . is the current folder")
    assert tree(mywork) == before
