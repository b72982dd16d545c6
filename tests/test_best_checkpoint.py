"""checkpoint.keep_best end to end on the shipped tiny model: the checkpoint of the best periodic eval
survives keep_last, a resume keeps knowing it, a resume from an earlier checkpoint goes back to the best
as of that one, and the summary and `dapo-train eval RUN --best` name it. The periodic evals' accuracies
are set by hand (the tiny model's own are too noisy over 4 steps to say which step wins)."""

import json

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.evaluation.command import EvalOptions, run_eval
from dapo_train.run import checkpoint as ckpt
from dapo_train.run.eval_items import PERIODIC
from dapo_train.train import evals
from dapo_train.train.loop import train

# 2 prompts x G=4, short completions, a checkpoint and an eval every step, keep the newest and the best.
SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "logging.progress_bar=false", "eval.final_full=false",
    "logging.rollout_groups=0", "eval.every_steps=1", "checkpoint.every_steps=1", "checkpoint.keep_best=true",
]


@pytest.fixture
def accuracies(monkeypatch):
    """The periodic evals' accuracies by step (the dict the test fills), instead of generating."""
    by_step: dict[int, float] = {}

    def evaluate(run, prompts, kind=PERIODIC, records=None):
        return {"accuracy": by_step.get(run.step, 0.0), "eval/num_items": len(prompts)}, []

    monkeypatch.setattr(evals, "evaluate", evaluate)
    return by_step


def _run(out, *extra, resume=None):
    return train(load_config(None, [*SMALL, f"output_dir={out}", *extra]), resume=resume)


def _kept(out) -> list[str]:
    return [p.name for p in ckpt.checkpoint_dirs(out)]


def test_the_best_survives_keep_last_and_a_tie_keeps_the_earlier(tmp_path, accuracies, capsys):
    """0.5 at step 1 stays the best: 0.3 is worse and step 3's 0.5 only ties; keep_last 1 keeps it beside
    checkpoint_4, and the summary names it."""
    accuracies.update({1: 0.5, 2: 0.3, 3: 0.5, 4: 0.2})
    out = _run(tmp_path / "run", "train.max_steps=4", "checkpoint.keep_last=1")
    assert _kept(out) == ["checkpoint_1", "checkpoint_4"]
    assert ckpt.best_checkpoint(out) == (out / "checkpoint_1", ckpt.CheckpointScore(1, 0.5))
    said = capsys.readouterr().out
    assert f"best checkpoint (checkpoint.keep_best): checkpoint_1, eval accuracy 0.500 at step 1; evaluate it: " \
           f"dapo-train eval {out} --best" in said


def test_without_keep_best_keep_last_prunes_the_best_and_the_summary_names_none(tmp_path, accuracies, capsys):
    """The knob off, the same evals: keep_last 1 keeps checkpoint_4 alone, and nothing records a best."""
    accuracies.update({1: 0.5, 2: 0.3, 3: 0.5, 4: 0.2})
    out = _run(tmp_path / "run", "train.max_steps=4", "checkpoint.keep_last=1", "checkpoint.keep_best=false")
    assert _kept(out) == ["checkpoint_4"]
    assert "best checkpoint" not in capsys.readouterr().out
    with pytest.raises(UserError, match="records no best checkpoint"):
        ckpt.best_checkpoint(out)


def test_a_resume_keeps_knowing_the_best(tmp_path, accuracies):
    """The same run in two sessions: after the resume, step 3's tie must not displace checkpoint_1 (a
    resume that forgot it would keep checkpoint_3 and prune checkpoint_1)."""
    accuracies.update({1: 0.5, 2: 0.3, 3: 0.5, 4: 0.2})
    out = tmp_path / "run"
    _run(out, "train.max_steps=2", "checkpoint.keep_last=1")
    assert _kept(out) == ["checkpoint_1", "checkpoint_2"]
    _run(out, "train.max_steps=4", "checkpoint.keep_last=1", resume=True)
    assert _kept(out) == ["checkpoint_1", "checkpoint_4"]
    assert ckpt.best_checkpoint(out)[0] == out / "checkpoint_1"


def test_a_resume_from_an_earlier_checkpoint_goes_back_to_its_best(tmp_path, accuracies):
    """checkpoint_3 (0.6) was the best; resuming from checkpoint_2 moves 3 and 4 aside, and the best is
    checkpoint_1 again, as it was at step 2, until a later step beats it."""
    accuracies.update({1: 0.3, 2: 0.2, 3: 0.6, 4: 0.1})
    out = _run(tmp_path / "run", "train.max_steps=4")
    assert ckpt.best_checkpoint(out)[0] == out / "checkpoint_3"
    accuracies.update({3: 0.2, 4: 0.25})
    _run(out, "train.max_steps=4", resume=out / "checkpoint_2")
    assert _kept(out) == ["checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_4"]
    assert ckpt.best_checkpoint(out) == (out / "checkpoint_1", ckpt.CheckpointScore(1, 0.3))


def test_eval_best_evaluates_the_best_checkpoint(tmp_path, accuracies, monkeypatch):
    accuracies.update({1: 0.5, 2: 0.3})
    out = _run(tmp_path / "run", "train.max_steps=2", "checkpoint.keep_last=1")
    monkeypatch.chdir(tmp_path)
    run_eval(["run"], EvalOptions(best=True, limit=2, max_new_tokens=4))
    saved = json.loads((out / "checkpoint_1" / "eval_test_limit2_len4.json").read_text())
    assert saved["target"] == "run/checkpoint_1 (best: eval accuracy 0.500 at step 1)"
    assert saved["metrics"]["num_items"] == 2
    with pytest.raises(UserError, match="run/checkpoint_1 holds no checkpoint_<step> folder; --best takes a run"):
        run_eval(["run/checkpoint_1"], EvalOptions(best=True, limit=2))
