"""Issue 59 item 2: only a budget an out-of-memory error lowered carries over a resume (train/lowered_budgets.py).
End to end on the shipped tiny model, a fault injected as a card raises it (dapo_train/faults.py) showing which
budget a session trains at: a micro-batch over 200 positions fails, and a step's mini-batch in one micro-batch at
1,024 tokens holds about 240 (tests/train/update/test_out_of_memory.py). And the rule on hand-made records: auto on
a card with more free memory, a value set for the resume, an older checkpoint's record."""

import logging
import re
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_train import SMALL

from dapo_train.config.load import load_config
from dapo_train.faults import UPDATE_TOKENS
from dapo_train.run.checkpoint import SAVED_CONFIG_KEY
from dapo_train.train.loop import train
from dapo_train.train.lowered_budgets import LOWERED_KEY, OLD_KEY, keep_lowered
from dapo_train.train.update.batching import Batching


def _run(out, *extra, resume=None):
    return train(load_config(None, [*SMALL, f"output_dir={out}", *extra]), resume=resume)


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _state(run_dir, step: int) -> dict:
    return torch.load(run_dir / f"checkpoint_{step}" / "trainer_state.pt", weights_only=False)


def _halved(caplog) -> int:
    """The budget the update's out-of-memory lines lowered it to, the last of them (the guard halves until the
    budget's largest micro-batch fits: train/update/out_of_memory.py)."""
    said = _lines(caplog, "out of memory in the update")
    assert said
    return int(re.search(r"redone .* at train.micro_batch_tokens=(\d+),", said[-1])[1])


def test_a_resume_trains_at_the_budget_set_for_it_when_no_out_of_memory_error_lowered_one(tmp_path, monkeypatch,
                                                                                          caplog):
    """Every checkpoint recorded the budgets in use and a resume applied any smaller one, saying the run "lowered it
    out of memory" when none had: train.micro_batch_tokens=1024 set for the resume ran at the first session's 128.
    Now it runs at 1,024, which the fault shows: its update runs out at 1,024."""
    out = tmp_path / "run"
    _run(out, "train.max_steps=1", "train.micro_batch_tokens=128")
    monkeypatch.setenv(UPDATE_TOKENS, "400")  # one 214-position sequence fits
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(out, "train.max_steps=2", "train.micro_batch_tokens=1024", resume=True)
    assert not _lines(caplog, "lowered it out of memory")
    assert "at train.micro_batch_tokens=1024)" in _lines(caplog, "out of memory in the update")[0]
    assert _state(out, 1)[LOWERED_KEY] == []  # nothing lowered: nothing recorded


def test_a_budget_lowered_out_of_memory_is_recorded_named_in_config_yaml_and_yields_to_a_value_set_for_the_resume(
        tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    monkeypatch.setenv(UPDATE_TOKENS, "400")  # one 214-position sequence fits
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(out, "train.max_steps=1", "train.micro_batch_tokens=1024")
    halved = _halved(caplog)
    assert _state(out, 1)[LOWERED_KEY] == [{"key": "train.micro_batch_tokens", "value": halved, "replaced": 1024,
                                            "setting": 1024}]
    text = (out / "config.yaml").read_text()
    assert text.startswith(f"# train.micro_batch_tokens: this run uses {halved}, not the 1024 set here: an "
                           "out-of-memory error lowered it")
    assert yaml.safe_load(text)["train"]["micro_batch_tokens"] == 1024  # the setting as given
    assert not (out / "checkpoint_1" / "config.yaml").read_text().startswith("#")  # the resume's base: settings

    caplog.clear()  # the same setting: the lowered budget carried, so the fault finds nothing over it
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(out, "train.max_steps=2", "train.micro_batch_tokens=1024", resume=True)
    said = _lines(caplog, "as the checkpoint's run lowered it out of memory from 1024")
    assert len(said) == 1 and said[0].startswith(f"train.micro_batch_tokens={halved}, ")
    assert not _lines(caplog, "out of memory in the update")
    assert _state(out, 2)[LOWERED_KEY][0]["value"] == halved
    assert (out / "config.yaml").read_text().startswith(f"# train.micro_batch_tokens: this run uses {halved}")

    caplog.clear()  # another value set for the resume stands: it runs at 2,048, and the fault shows it
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(out, "train.max_steps=3", "train.micro_batch_tokens=2048", resume=True)
    assert _lines(caplog, f"train.micro_batch_tokens=2048, as set for this session: the {halved} checkpoint_2 ran "
                          "at is not kept")
    assert "at train.micro_batch_tokens=2048)" in _lines(caplog, "out of memory in the update")[0]


def test_an_older_checkpoints_budgets_never_raise_a_budget_and_the_line_says_it_cannot_tell(tmp_path, monkeypatch,
                                                                                            caplog):
    """A checkpoint written before the record kept every budget in force under "budgets": the resume keeps a
    smaller one (here the one the fault lowered: the resume, under the same fault, runs out nowhere)."""
    out = tmp_path / "run"
    monkeypatch.setenv(UPDATE_TOKENS, "400")  # one 214-position sequence fits
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(out, "train.max_steps=1", "train.micro_batch_tokens=1024")
    halved = _halved(caplog)
    path = out / "checkpoint_1" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    del state[LOWERED_KEY]
    rows = load_config(None, SMALL).rollout.generation_batch_size  # in force then, as the old record held it
    state[OLD_KEY] = {"micro_batch_tokens": halved, "micro_batch_size": 4, "generation_batch_size": rows}
    torch.save(state, path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(out, "train.max_steps=2", "train.micro_batch_tokens=1024", resume=True)
    said = _lines(caplog, "as checkpoint_1 ran at it")
    assert len(said) == 1 and said[0].startswith(f"train.micro_batch_tokens={halved}, ") and "never raised" in said[0]
    assert not _lines(caplog, "out of memory in the update")


def _resumed(saved: dict, setting: str, tokens: int) -> SimpleNamespace:
    """A learner at `tokens` (this session's budget: its number, or auto's choice) after keep_lowered of `saved`."""
    learner = SimpleNamespace(batching=Batching(0, torch.device("cpu"), True, 4, max_tokens=tokens))
    cfg = load_config(None, [f"train.micro_batch_tokens={setting}"])
    keep_lowered(saved, cfg, learner, None, "checkpoint_5")
    return learner


AUTO_LOWERED = {LOWERED_KEY: [{"key": "train.micro_batch_tokens", "value": 10240, "replaced": 20480,
                               "setting": "auto"}]}


@pytest.mark.parametrize(("setting", "tokens", "expected", "said"), [
    ("auto", 20480, 10240, "as the checkpoint's run lowered it out of memory from 20480"),  # the same card
    ("auto", 19456, 10240, "as the checkpoint's run lowered it out of memory from 20480"),  # less free: no larger
    ("auto", 33792, 33792, "(a card with more free memory): the 10240 it was lowered to is not kept"),
    ("16384", 16384, 16384, "train.micro_batch_tokens=16384, as set for this session"),  # set for the resume
    ("20480", 20480, 20480, "train.micro_batch_tokens=20480, as set for this session"),  # even as auto chose then
    ("auto", 8192, 8192, None),  # this session's is smaller already: nothing to say
    ("4096", 4096, 4096, None),
])
def test_auto_on_a_card_with_more_free_memory_and_a_value_set_for_the_resume_stand(caplog, setting, tokens,
                                                                                    expected, said):
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        learner = _resumed(AUTO_LOWERED, setting, tokens)
    assert learner.batching.max_tokens == expected
    lines = _lines(caplog, "train.micro_batch_tokens")
    assert (lines == []) if said is None else (len(lines) == 1 and said in lines[0]), lines


def test_an_older_checkpoint_without_its_saved_config_keeps_a_smaller_budget_whatever_is_set():
    """Neither the record nor the setting it came from: the safe reading keeps the smaller, never raises."""
    old = {OLD_KEY: {"micro_batch_tokens": 512, "micro_batch_size": 4, "generation_batch_size": None}}
    assert _resumed(old, "2048", 2048).batching.max_tokens == 512
    with_config = {**old, SAVED_CONFIG_KEY: {"train": {"micro_batch_tokens": 1024}}}
    assert _resumed(with_config, "2048", 2048).batching.max_tokens == 2048  # set otherwise than then: stands
    assert _resumed(with_config, "1024", 1024).batching.max_tokens == 512


def test_config_yaml_is_rewritten_after_a_checkpoint_only_when_a_lowered_budget_is_new_and_a_refused_write_warns(
        tmp_path, caplog):
    """SessionBudgets.note, which state.save calls after each checkpoint: the run folder's config.yaml is left
    alone while nothing new was lowered (it may have been edited by hand since the session began); a lowered
    budget rewrites it once; a disk that refuses the write costs the comment, in one line, not the run."""
    from dapo_train.train.lowered_budgets import SessionBudgets

    cfg = load_config(None, ["train.micro_batch_tokens=1024"])
    path = tmp_path / "config.yaml"
    budgets = SessionBudgets({"train.micro_batch_tokens": 1024})
    budgets.save_config(cfg, Batching(0, torch.device("cpu"), True, 4, max_tokens=1024), None, path)
    path.write_text("edited\n")
    budgets.note(cfg, Batching(0, torch.device("cpu"), True, 4, max_tokens=1024), None, path)
    assert path.read_text() == "edited\n"
    lowered = Batching(0, torch.device("cpu"), True, 4, max_tokens=512)
    budgets.note(cfg, lowered, None, path)
    assert path.read_text().startswith("# train.micro_batch_tokens: this run uses 512, not the 1024 set here")
    path.write_text("edited again\n")
    budgets.note(cfg, lowered, None, path)
    assert path.read_text() == "edited again\n"
    with caplog.at_level(logging.WARNING, logger="dapo_train"):
        budgets.note(cfg, Batching(0, torch.device("cpu"), True, 4, max_tokens=256), None, tmp_path / "gone" / "x")
    assert _lines(caplog, "not rewritten to name a budget lowered out of memory")
