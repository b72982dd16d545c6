"""The trainer's per-item eval records (eval_items/) and the end-of-run eval on the whole split
(eval.final_full): item counts, the files' layout, the reuse of a whole-split periodic eval, and the
files a fresh or resumed run drops."""

import contextlib
import io
import logging
import re

import pytest
from small_task import write_small_task

from dapo_train.config.load import load_config
from dapo_train.model.loading import load_tokenizer
from dapo_train.run.eval_items import FINAL, PERIODIC, RECORD_KEYS, drop_items, items_path, read_items, saved_evals
from dapo_train.run.layout import RUN_MARKER
from dapo_train.run.logs import read_metrics
from dapo_train.task.prompts import load_prompts
from dapo_train.train import evals, loop

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "eval.print_samples=0", "logging.progress_bar=false",
]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """(run folder, log text, stdout) of 1 step on the shipped task: the periodic eval on 10 items at
    steps 0 and 1, and (eval.final_full by default) the whole 500-item test split at the end."""
    out = tmp_path_factory.mktemp("final") / "run"
    cfg = load_config(None, [*SMALL, "train.max_steps=1", "eval.every_steps=1", "eval.num_items=10",
                             f"output_dir={out}"])
    stream, stdout = io.StringIO(), io.StringIO()
    handler, root = logging.StreamHandler(stream), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(stdout):
            loop.train(cfg)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return out, stream.getvalue(), stdout.getvalue()


def test_a_run_ends_with_an_eval_of_the_whole_split(full_run):
    run, log, stdout = full_run
    cfg = load_config(None, [])
    split = [p.uid for p in load_prompts(cfg.data, load_tokenizer(cfg.model), cfg.data.eval_split)[0]]
    assert len(split) == 500  # the shipped test split
    rows = read_metrics(run)
    last = rows[-1]
    assert last["step"] == 1 and last["final/num_items"] == len(split)
    records = read_items(items_path(run, FINAL, 1))
    assert [r["uid"] for r in records] == split  # every item, in split order
    assert last[FINAL.accuracy] == pytest.approx(sum(r["correct"] for r in records) / len(split))
    assert all(FINAL.accuracy not in row for row in rows[:-1])  # once, in the last step's row
    said = f"final eval step 1: accuracy {last[FINAL.accuracy]:.3f} "
    assert said in log and "on all 500 items of the eval split" in log  # when it happens
    assert said in stdout  # and in the end-of-run summary
    # Its cost is said at start: 500 items against the periodic eval's 10.
    assert "the run ends with a greedy eval on all 500 items of 'test', 50.0x a periodic eval of 10 items" in log
    # accuracy_losses.txt keeps its meaning: the periodic subset only.
    assert (run / "accuracy_losses.txt").read_text().splitlines() == [
        f"{row['step']},{row['accuracy']}" for row in rows if "accuracy" in row
    ]


def test_every_periodic_eval_keeps_its_items(full_run):
    run, _, _ = full_run
    assert set(saved_evals(run)) == {("step", 0), ("step", 1), ("final", 1)}
    rows = {row["step"]: row for row in read_metrics(run)}
    final_uids = {r["uid"] for r in read_items(items_path(run, FINAL, 1))}
    for step in (0, 1):
        records = read_items(items_path(run, PERIODIC, step))
        assert len(records) == 10 and set(records[0]) == set(RECORD_KEYS)
        assert {r["uid"] for r in records} <= final_uids  # the fixed subset of the same split
        assert rows[step]["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 10)


def test_a_periodic_eval_of_the_whole_split_is_not_generated_twice(tmp_path, monkeypatch):
    """eval.num_items=0 on a 5-question split: the last periodic eval already is the whole split, so
    the final eval takes its records (2 generations: steps 0 and 1, not 3). A stale file of an earlier
    attempt in the folder (a run that never saved a checkpoint starts again) is dropped."""
    calls = []
    real = evals.eval_records
    monkeypatch.setattr(evals, "eval_records", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    out = tmp_path / "run"
    (out / "eval_items").mkdir(parents=True)
    (out / "eval_items" / "step_7.jsonl").write_text("{}\n")
    (out / RUN_MARKER).write_text("")  # what the earlier attempt wrote first: the folder is a run's
    cfg = load_config(None, [*SMALL, f"data.path={write_small_task(tmp_path / 'task')}", "train.max_steps=1",
                             "eval.every_steps=1", "eval.num_items=0", f"output_dir={out}"])
    loop.train(cfg)
    assert calls == [5, 5]
    assert set(saved_evals(out)) == {("step", 0), ("step", 1), ("final", 1)}
    assert read_items(items_path(out, FINAL, 1)) == read_items(items_path(out, PERIODIC, 1))
    last = read_metrics(out)[-1]
    assert last[FINAL.accuracy] == last["accuracy"] and last["final/num_items"] == 5


def test_the_final_eval_shows_its_progress_and_the_periodic_ones_stay_quiet(tmp_path, capsys):
    """A bar over the whole split's items at the end (minutes at Qwen scale), under the training bar; none
    for the periodic evals of the subset (one generate call each at the default eval.batch_size)."""
    cfg = load_config(None, [*SMALL, f"data.path={write_small_task(tmp_path / 'task')}", "train.max_steps=1",
                             "eval.every_steps=1", "eval.num_items=2", "eval.batch_size=2",
                             "logging.progress_bar=true", f"output_dir={tmp_path / 'run'}"])
    loop.train(cfg)
    bars = re.findall(r"([\w ]+): +0%\|[^|]*\| 0/(\d+) \[00:00<\?, \?(\w+)/s\]", capsys.readouterr().err)
    assert ("dapo", "1", "it") in bars  # the training bar
    assert [(label, total) for label, total, unit in bars if unit == "item"] == [("final eval", "5")], bars
    # logging.progress_bar=false: neither bar, the final eval's included
    loop.train(load_config(None, [*SMALL, f"data.path={tmp_path / 'task'}", "train.max_steps=1",
                                  "eval.every_steps=1", "eval.num_items=2", "eval.batch_size=2",
                                  "logging.progress_bar=false", f"output_dir={tmp_path / 'quiet'}"]))
    quiet = capsys.readouterr().err  # (transformers' own weight-loading bar aside: the CLI turns it off)
    assert "final eval:" not in quiet and "dapo:" not in quiet, quiet


def test_final_full_off_adds_no_eval(tmp_path, monkeypatch):
    calls = []
    real = evals.eval_records
    monkeypatch.setattr(evals, "eval_records", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    out = tmp_path / "run"
    cfg = load_config(None, [*SMALL, f"data.path={write_small_task(tmp_path / 'task')}", "train.max_steps=1",
                             "eval.every_steps=0", "eval.final_full=false", f"output_dir={out}"])
    loop.train(cfg)
    assert calls == [] and saved_evals(out) == {}
    assert all(FINAL.accuracy not in row for row in read_metrics(out))


def test_a_resume_moves_the_records_of_later_steps_aside_and_drop_items_clears_them(tmp_path):
    from dapo_train.run.folder import set_aside_abandoned

    for kind, step in (("step", 0), ("step", 2), ("final", 4), ("step", 5)):
        path = tmp_path / "eval_items" / f"{kind}_{step}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f'{{"step": {step}}}\n')
    folder = set_aside_abandoned(tmp_path, 2)  # resumed from checkpoint_2
    assert set(saved_evals(tmp_path)) == {("step", 0), ("step", 2)}
    assert set(saved_evals(folder)) == {("final", 4), ("step", 5)}  # moved, not lost
    assert read_items(folder / "eval_items" / "step_5.jsonl") == [{"step": 5}]
    drop_items(tmp_path)  # a fresh run in a folder without checkpoints starts anew
    assert saved_evals(tmp_path) == {}
