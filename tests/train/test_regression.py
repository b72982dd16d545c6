"""The regression stop (train/regression.py) through the code a run calls (train/evals.py: evaluate, then
regression) on hand-made eval records: step 0 right on 73 of 100 items (Qwen's start), each later eval losing
and gaining chosen items, so that every verdict rests on counts whose p-values are computed here by hand.

The bound (0.01 spread over 30 evals x 2 accuracies, `qwen1.5b.yaml`'s schedule): 0.01 / 60 = 1.67e-4; an eval
that gains nothing reaches it only at 13 items lost (2^-13 = 1.2e-4; 2^-12 = 2.4e-4 does not)."""

import json
from types import SimpleNamespace

import pytest

from dapo_train.config.load import load_config
from dapo_train.run.checkpoint import CheckpointScore
from dapo_train.train import evals
from dapo_train.train.regression import RegressionWatch, Rule, eval_test, stop_note

START_RIGHT = 73  # items 0-72 right at step 0, 73-99 wrong
QWEN_SCHEDULE = ["eval.every_steps=5", "train.max_steps=150", "eval.num_items=100", "eval.print_samples=0",
                 "eval.stop_on_regression=true"]  # 30 periodic evals after step 0, as qwen1.5b.yaml


def _records(lost: int, gained: int, answer: tuple[int, int] | None = None) -> list[dict]:
    """100 items: the first `lost` of step 0's right items wrong, the first `gained` of its wrong items right;
    `answer` (lost, gained) for the answer accuracy where it differs from the strict one."""
    def graded(lost: int, gained: int) -> list[bool]:
        return [i >= lost if i < START_RIGHT else i < START_RIGHT + gained for i in range(100)]

    strict = graded(lost, gained)
    lenient = graded(*answer) if answer is not None else strict
    return [{"uid": f"test:{i}", "gold": str(i), "correct": strict[i], "answer_correct": lenient[i],
             "extracted": str(i), "completion": "", "length": 10, "format_ok": True, "truncated": False}
            for i in range(100)]


def _run(tmp_path, settings: list[str]) -> SimpleNamespace:
    cfg = load_config(None, settings)
    run = SimpleNamespace(cfg=cfg, run_dir=tmp_path, step=0, start_records=None, regression=RegressionWatch(),
                          best=CheckpointScore(5, 0.75))
    evals.evaluate(run, [], records=_records(0, 0))  # step 0: 73 of 100 right
    return run


def _stops(tmp_path, evals_after: list, settings: list[str] = QWEN_SCHEDULE) -> list:
    """Each eval's (lost, gained) or (strict, answer) pair of them, at steps 5, 10, ... -> what
    evals.regression returned at each (the stop's line, or None)."""
    run = _run(tmp_path, settings)
    said = []
    for index, counts in enumerate(evals_after):
        run.step = 5 * (index + 1)
        strict, answer = counts if isinstance(counts[0], tuple) else (counts, None)
        metrics, _ = evals.evaluate(run, [], records=_records(*strict, answer))
        said.append(evals.regression(run, metrics))
    return said


@pytest.mark.parametrize("evals_after", [
    pytest.param([(3, 3)] * 30, id="flat: 3 lost and 3 gained at every eval"),
    pytest.param([(4, 0), (4, 0)], id="the same 4 items lost twice in a row: p = 1/16 each time"),
    pytest.param([(8, 0)] * 30, id="8 lost, none gained at 30 evals: p = 3.9e-3"),
    pytest.param([(12, 0), (12, 0), (12, 0)], id="12 lost: p = 2^-12 = 2.4e-4, above the bound"),
    pytest.param([(20, 5)] * 3, id="20 lost, 5 gained: p = P(X >= 20), X ~ Bin(25, 1/2) = 68406 / 2^25 = 2.0e-3"),
    pytest.param([(0, 15)] * 3, id="improving"),
])
def test_it_must_not_stop(tmp_path, evals_after):
    assert _stops(tmp_path, evals_after) == [None] * len(evals_after)


@pytest.mark.parametrize("evals_after, at", [
    pytest.param([(13, 0)], 0, id="13 lost, none gained: p = 2^-13 = 1.2e-4, at the first eval"),
    pytest.param([(2, 3), (1, 0), (30, 4)], 2, id="after a flat start: p = P(X >= 30 | 34) = 52956 / 2^34 = 3.1e-6"),
    pytest.param([((0, 0), (13, 0))], 0, id="the answer accuracy alone"),
])
def test_it_stops_at_the_first_eval_past_the_bound(tmp_path, evals_after, at):
    said = _stops(tmp_path, evals_after)
    assert [line is not None for line in said] == [i == at for i in range(len(evals_after))]


def test_the_line_states_the_test_it_ran(tmp_path):
    """At 13 lost and 1 gained: p = P(X >= 13), X ~ Bin(14, 1/2) = (1 + 14) / 2^14 = 9.2e-4, above 1.67e-4; at 15
    lost and 1 gained: (1 + 16) / 2^16 = 2.6e-4, above; at 16 lost and 0 gained: 2^-16 = 1.5e-5, below."""
    said = _stops(tmp_path, [(13, 1), (15, 1), ((16, 0), (3, 0))])
    assert said[:2] == [None, None]
    assert said[2] == (
        "step 15: the model is worse than at step 0 on the same 100 eval items, by the exact one-sided sign test "
        "on the items graded differently: strict accuracy 16 lost, 0 gained (-0.160), p = 1.5e-05 <= 1.7e-04, the "
        "bound that holds a run's chance of a false alarm to 0.01 over its 30 evals x 2 accuracies "
        "(eval.regression_alpha)")


def test_the_alpha_moves_when_it_stops(tmp_path):
    """10 lost, none gained: p = 2^-10 = 9.8e-4; above 0.01 / 60 = 1.7e-4, below 0.1 / 60 = 1.7e-3; and below
    0.01 / 6 = 1.7e-3 when the run makes 3 evals instead of 30 (eval.every_steps=50)."""
    assert _stops(tmp_path / "a", [(10, 0)]) == [None]
    assert _stops(tmp_path / "b", [(10, 0)], [*QWEN_SCHEDULE, "eval.regression_alpha=0.1"]) != [None]
    assert _stops(tmp_path / "c", [(10, 0)], [*QWEN_SCHEDULE, "eval.every_steps=50"]) != [None]


def test_said_once_per_run_and_as_a_warning_when_the_run_goes_on(tmp_path, caplog):
    """With the setting off the line is a warning naming the best checkpoint, said once; evals.regression
    returns nothing (the run goes on)."""
    settings = [*QWEN_SCHEDULE, "eval.stop_on_regression=false"]
    assert _stops(tmp_path, [(20, 0), (20, 0), (25, 0)], settings) == [None] * 3
    assert caplog.text.count("is worse than at step 0") == 1
    assert "the best checkpoint is checkpoint_5 (eval accuracy 0.750 at step 5); going on " \
        "(eval.stop_on_regression=false)" in caplog.text


def test_each_eval_records_what_the_test_read(tmp_path):
    """metrics.jsonl holds the counts, the p-values and the bound of every periodic eval after step 0, so a
    resumed run and `compare` read them: 13 lost, 2 gained (p = P(X >= 13), X ~ Bin(15, 1/2) = (1 + 15 + 105) /
    2^15); the answer accuracy 1 lost (p = 1/2)."""
    run = _run(tmp_path, QWEN_SCHEDULE)
    run.step = 5
    metrics, _ = evals.evaluate(run, [], records=_records(13, 2, (1, 0)))
    assert (metrics["eval/change_lost"], metrics["eval/change_gained"]) == (13, 2)
    assert metrics["eval/change_p"] == pytest.approx(121 / 2**15)
    assert (metrics["eval/answer_change_lost"], metrics["eval/answer_change_gained"]) == (1, 0)
    assert metrics["eval/answer_change_p"] == 0.5
    assert metrics["eval/regression_bound"] == pytest.approx(0.01 / 60)


def _row(step: int, lost: int, bound: float | None = 0.01 / 60) -> dict:
    row = {"step": step, "accuracy": 0.5, "eval/change": -lost / 100, "eval/change_low": -0.2,
           "eval/change_high": -0.01}  # the interval: all an old row holds
    if bound is not None:
        row.update({"eval/change_lost": lost, "eval/change_gained": 0, "eval/change_p": 2.0**-lost,
                    "eval/change_items": 100, "eval/regression_bound": bound})
    return row


def test_a_resumed_watch_knows_whether_the_run_said_it():
    """From metrics.jsonl: rows before the counts (an older run's, the interval only) load and are no test; a
    row past its bound means the run already said so, and it does not say it again."""
    rule = Rule(alpha=0.01, evals=30)
    old = RegressionWatch.from_rows([{"step": 0, "accuracy": 0.5}, {"step": 5, "loss": 0.1}, _row(10, 40, None)])
    assert not old.said and old.record(20, _row(20, 14), rule) is not None
    assert not RegressionWatch.from_rows([_row(10, 12)]).said  # 2^-12 above the bound
    said = RegressionWatch.from_rows([_row(10, 12), _row(20, 13)])
    assert said.said and said.record(30, _row(30, 14), rule) is None
    assert eval_test(10, _row(10, 40, None)) is None


def test_the_rule_from_the_config():
    """m periodic evals after step 0: train.max_steps / eval.every_steps rounded up (the last step has one)."""
    assert Rule.of(load_config(None, QWEN_SCHEDULE)) == Rule(0.01, 30)
    assert Rule.of(load_config(None, ["eval.every_steps=10", "train.max_steps=11"])).evals == 2  # steps 10 and 11
    assert Rule(0.01, 30).bound == pytest.approx(0.01 / 60)
    assert (Rule(0.01, 30).fewest_lost(), Rule(0.01, 4).fewest_lost(), Rule(0.01, 1).fewest_lost()) == (13, 10, 8)


@pytest.mark.parametrize("settings, note", [
    (["eval.every_steps=0"], "makes no periodic eval after step 0"),
    (["eval.num_items=12"], "at least 13 eval items lost and none gained, and eval.num_items=12"),
    (["eval.num_items=13"], None),
    (["eval.num_items=0"], None),  # the whole split: its size is the data's
    (["eval.every_steps=10", "train.max_steps=10"], None),  # one eval can stop a run now
    (["eval.stop_on_regression=false", "eval.every_steps=0"], None),  # off: nothing to say
])
def test_when_stop_on_regression_cannot_act(settings, note):
    said = stop_note(load_config(None, [*QWEN_SCHEDULE, *settings]))
    assert said is None if note is None else note in said


def test_the_qwen_configs_stop_can_act():
    for name in ("qwen1.5b", "qwen1.5b-vllm", "qwen1.5b-lora", "qwen1.5b-paper"):
        cfg = load_config(f"configs/{name}.yaml", [])
        assert cfg.eval.stop_on_regression and stop_note(cfg) is None


def test_a_resumed_run_reads_its_step_0_records_and_its_evals_so_far(tmp_path):
    """evals.resume_start: eval_items/step_0.jsonl (every later eval's change is paired on it) and the evals in
    metrics.jsonl up to the checkpoint; a run folder without step-0 records has no start to pair with."""
    from dapo_train.run.eval_items import PERIODIC, write_items

    start = [{"uid": "test:0", "gold": "1", "correct": True, "answer_correct": True}]
    write_items(tmp_path, PERIODIC, 0, start)
    rows = [{"step": 0, "accuracy": 1.0}, _row(10, 14)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = SimpleNamespace(run_dir=tmp_path)
    evals.resume_start(run)
    assert run.start_records == start and run.regression.said
    (tmp_path / "eval_items" / "step_0.jsonl").unlink()
    evals.resume_start(run)
    assert run.start_records is None
