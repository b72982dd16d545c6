"""The regression verdict (train/regression.py) driven by hand-set eval outcomes: every case where it must
not fire (flat, noisy, improving, one bad eval then recovery, an interval touching 0, the two accuracies bad
at different evals, a single bad eval) and those where it must; said once per run; rebuilt on resume; and
where eval.stop_on_regression cannot act."""

import pytest

from dapo_train.config.load import load_config
from dapo_train.run.checkpoint import CheckpointScore
from dapo_train.train.regression import (
    Change,
    EvalOutcome,
    RegressionWatch,
    eval_outcome,
    regressed,
    regression_line,
    stop_note,
)

FLAT = Change(0.0, 0.0, 0.0)  # every item graded as at step 0: the interval is the point 0
DOWN = Change(-0.10, -0.16, -0.04)  # below step 0, the whole interval under 0
NOISE_DOWN = Change(-0.05, -0.11, 0.01)  # below, but the interval reaches above 0
NOISE_UP = Change(0.03, -0.02, 0.08)
UP = Change(0.08, 0.03, 0.13)
TOUCHING = Change(-0.06, -0.12, 0.0)  # the upper bound is 0 itself: not under 0


def _outcomes(*evals):
    """Evals at steps 10, 20, ...: each a Change for both accuracies, or (strict, answer)."""
    return [EvalOutcome(10 * (i + 1), dict(zip(("strict", "answer"), e if isinstance(e, tuple) else (e, e))))
            for i, e in enumerate(evals)]


@pytest.mark.parametrize("evals", [
    pytest.param((FLAT,) * 6, id="flat"),
    pytest.param((NOISE_DOWN, NOISE_UP, NOISE_DOWN, NOISE_DOWN, NOISE_UP, NOISE_DOWN), id="noisy"),
    pytest.param((NOISE_UP, UP, UP, UP), id="improving"),
    pytest.param((DOWN, NOISE_DOWN, DOWN, FLAT, DOWN, UP), id="one-bad-eval-then-recovery"),
    pytest.param((TOUCHING, TOUCHING, TOUCHING), id="interval-touching-0"),
    pytest.param(((DOWN, FLAT), (FLAT, DOWN), (DOWN, FLAT)), id="strict-and-answer-bad-at-different-evals"),
    pytest.param((DOWN,), id="one-eval-only"),
    pytest.param((), id="no-eval-yet"),
])
def test_it_must_not_fire(evals):
    outcomes = _outcomes(*evals)
    for end in range(len(outcomes) + 1):  # at no eval along the way either
        assert regressed(outcomes[:end]) == []


@pytest.mark.parametrize("evals, names", [
    pytest.param((DOWN, DOWN), ["strict", "answer"], id="both-twice"),
    pytest.param(((DOWN, FLAT), (DOWN, NOISE_UP)), ["strict"], id="strict-twice"),
    pytest.param(((UP, DOWN), (NOISE_DOWN, DOWN)), ["answer"], id="answer-twice"),
    pytest.param((UP, UP, NOISE_DOWN, DOWN, DOWN), ["strict", "answer"], id="after-a-good-start"),
    pytest.param((Change(-0.01, -0.02, -0.001),) * 2, ["strict", "answer"], id="just-under-0"),
])
def test_it_fires(evals, names):
    assert regressed(_outcomes(*evals)) == names


def test_an_accuracy_without_a_change_never_regresses():
    """Records from before answer_correct: only the strict change is known, and only it can fire."""
    outcomes = [EvalOutcome(10, {"strict": FLAT}), EvalOutcome(20, {"strict": DOWN}), EvalOutcome(30, {"strict": DOWN})]
    assert regressed(outcomes[:2]) == [] and regressed(outcomes) == ["strict"]


def test_the_outcome_of_an_evals_metrics():
    metrics = {"eval/change": -0.1, "eval/change_low": -0.16, "eval/change_high": -0.04, "eval/answer_change": 0.0,
               "eval/answer_change_low": 0.0, "eval/answer_change_high": 0.0, "accuracy": 0.5}
    assert eval_outcome(20, metrics) == EvalOutcome(20, {"strict": DOWN, "answer": FLAT})
    assert eval_outcome(20, {"accuracy": 0.5}) is None  # step 0, or an eval without a start to pair with
    assert eval_outcome(20, {"loss": 0.1}) is None  # a step without an eval


def _metrics(change: Change) -> dict:
    return {f"eval/{name}{end}": value for name in ("change", "answer_change")
            for end, value in (("", change.difference), ("_low", change.low), ("_high", change.high))}


def test_the_watch_says_it_once_with_the_figures_and_the_best_checkpoint():
    watch, best = RegressionWatch(), CheckpointScore(10, 0.72)
    assert watch.record(10, _metrics(UP), best, True) is None
    assert watch.record(15, {"loss": 0.1}, best, True) is None  # no eval this step
    assert watch.record(20, _metrics(DOWN), best, True) is None  # one bad eval
    line = watch.record(30, _metrics(DOWN), best, True)
    assert line == ("step 30: the model is worse than at step 0 at 2 evals in a row, the 95% interval below 0 "
                    "(change from step 0 on the same eval items): strict accuracy -0.100 [-0.160, -0.040] at step 20, "
                    "-0.100 [-0.160, -0.040] at step 30; answer accuracy -0.100 [-0.160, -0.040] at step 20, "
                    "-0.100 [-0.160, -0.040] at step 30; the best checkpoint is checkpoint_10 (eval accuracy 0.720 "
                    "at step 10)")
    assert watch.record(40, _metrics(DOWN), best, True) is None  # said once per run


@pytest.mark.parametrize("best, keep_best, said", [
    (None, False, "no best checkpoint is kept (checkpoint.keep_best=false)"),
    (None, True, "no checkpoint has been saved at an eval step yet (checkpoint.keep_best ranks those)"),
])
def test_the_line_without_a_best_checkpoint(best, keep_best, said):
    assert regression_line(_outcomes(DOWN, DOWN), ["strict"], best, keep_best).endswith(said)


def test_a_resumed_watch_knows_the_evals_before_its_checkpoint():
    """Rebuilt from metrics.jsonl: one bad eval before the checkpoint and one after make two in a row; a run
    that had already said it does not say it again."""
    rows = [{"step": 0, "accuracy": 0.5}, {"step": 5, "loss": 0.1}, {"step": 10, **_metrics(DOWN)}]
    watch = RegressionWatch.from_rows(rows)
    assert not watch.said and watch.record(20, _metrics(DOWN), None, False) is not None
    said = RegressionWatch.from_rows([*rows, {"step": 20, **_metrics(DOWN)}])
    assert said.said and said.record(30, _metrics(DOWN), None, False) is None


@pytest.mark.parametrize("settings, note", [
    (["eval.stop_on_regression=true", "eval.every_steps=0"], "makes 0"),
    (["eval.stop_on_regression=true", "eval.every_steps=10", "train.max_steps=10"], "makes 1"),
    (["eval.stop_on_regression=true", "eval.every_steps=10", "train.max_steps=11"], None),  # steps 10 and 11
    (["eval.stop_on_regression=false", "eval.every_steps=0"], None),  # off: nothing to say
])
def test_when_stop_on_regression_cannot_act(settings, note):
    said = stop_note(load_config(None, settings))
    assert said is None if note is None else note in said


def test_a_resumed_run_reads_its_step_0_records_and_its_evals_so_far(tmp_path):
    """evals.resume_start: eval_items/step_0.jsonl (every later eval's change is paired on it) and the evals in
    metrics.jsonl up to the checkpoint; a run folder without step-0 records has no start to pair with."""
    import json
    from types import SimpleNamespace

    from dapo_train.run.eval_items import PERIODIC, write_items
    from dapo_train.train import evals

    start = [{"uid": "test:0", "gold": "1", "correct": True, "answer_correct": True}]
    write_items(tmp_path, PERIODIC, 0, start)
    rows = [{"step": 0, "accuracy": 1.0}, {"step": 10, "accuracy": 0.0, **_metrics(DOWN)}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = SimpleNamespace(run_dir=tmp_path)
    evals.resume_start(run)
    assert run.start_records == start
    assert run.regression.outcomes == [EvalOutcome(10, {"strict": DOWN, "answer": DOWN})]
    (tmp_path / "eval_items" / "step_0.jsonl").unlink()
    evals.resume_start(run)
    assert run.start_records is None
