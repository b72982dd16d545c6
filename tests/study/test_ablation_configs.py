"""configs/ablation/ laid over each task's config (scripts/studies/ablation.py): each row differs from the one
before it in its named technique only, the last row is the task's own DAPO plus overlong filtering
(the paper's rows are cumulative), with the ablation's eval schedule; and the script's numbers,
paired differences included, on hand-made and on real short runs."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from small_task import write_small_task

from dapo_train.config.load import config_to_dict, flatten_config, load_config, save_config
from dapo_train.run.eval_items import FINAL, PERIODIC, write_items
from dapo_train.study.runs import load_run

ROOT = Path(__file__).resolve().parents[2]
ABLATION = ROOT / "configs" / "ablation"
# Row -> the dotted keys its technique changes, relative to the previous row.
STEPS = {
    "1-grpo": None,
    "2-overlong-filtering": {"dapo.overlong_filtering"},
    "3-clip-higher": {"dapo.eps_high"},
    "4-soft-overlong": {"rewards.1.name", "rewards.1.weight", "rewards.1.args.cache_length"},
    "5-token-level-loss": {"dapo.loss_reduction"},
    "6-dapo": {"dapo.dynamic_sampling"},
}


def _script():
    spec = importlib.util.spec_from_file_location("ablation", ROOT / "scripts" / "studies" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ablation = _script()


def _task(name):
    path = ablation.TASKS[name]
    if not path.is_file():
        pytest.skip(f"{path.name} is not in this checkout (the long task's config comes with its own branch)")
    return path


def _settings(task: Path, row: Path) -> dict:
    flat = flatten_config(config_to_dict(ablation.row_config(task, row, ["output_dir=x", "run_name=x"])))
    return {key: value for key, value in flat.items() if value not in (None, {})}


@pytest.mark.parametrize("task", list(ablation.TASKS))
def test_each_row_adds_exactly_its_technique(task):
    path = _task(task)
    files = sorted(ABLATION.glob("*.yaml"))
    assert [f.stem for f in files] == list(STEPS)
    first = _settings(path, files[0])
    assert (first["dapo.eps_low"], first["dapo.eps_high"], first["dapo.loss_reduction"]) == (0.2, 0.2, "sample")
    assert (first["dapo.dynamic_sampling"], first["dapo.overlong_filtering"], first["dapo.beta"]) == (False, False, 0.0)
    assert [key for key in first if key.startswith("rewards.")] == ["rewards.0.name", "rewards.0.weight"]
    for before, after in zip(files, files[1:]):
        old, new = _settings(path, before), _settings(path, after)
        changed = {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
        assert changed == STEPS[after.stem], after.stem


@pytest.mark.parametrize("task", list(ablation.TASKS))
def test_the_last_row_is_the_tasks_dapo_with_overlong_filtering(task):
    path = _task(task)
    dapo = ablation.row_config(path, ABLATION / "6-dapo.yaml", [])
    own = load_config(str(path), ["dapo.overlong_filtering=true"])
    assert dataclasses.replace(dapo, eval=own.eval, run_name=own.run_name, output_dir=own.output_dir) == own
    assert (dapo.eval.every_steps, dapo.eval.num_items) == (20, 0)  # the ablation's schedule: the whole split


def _hand_made_run(run, final=None):
    run.mkdir(parents=True)
    save_config(ablation.row_config(ablation.TASKS["tiny"], ABLATION / "6-dapo.yaml", [f"output_dir={run}"]),
                run / "config.yaml")
    rows = [
        {"step": 0, "accuracy": 0.2, "seconds_eval": 1.0},
        {"step": 1, "gen_rounds": 1, "seconds_step": 2.0, "completion_length_max": 50, "truncated_ratio": 0.0,
         "rewards/overlong/mean": 0.0},
        {"step": 2, "gen_rounds": 3, "seconds_step": 3.0, "completion_length_max": 70, "truncated_ratio": 0.5,
         "rewards/overlong/mean": -0.1, "accuracy": 0.3, "seconds_eval": 1.0},
    ]
    if final is not None:
        rows[-1].update({FINAL.accuracy: sum(final) / len(final), FINAL.seconds: 2.0})
        records = [{"uid": f"test:{i}", "gold": "1", "extracted": "1", "correct": bool(ok), "format_ok": True,
                    "length": 5, "truncated": False, "completion": ""} for i, ok in enumerate(final)]
        write_items(run, FINAL, 2, records)
        write_items(run, PERIODIC, 2, records)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_ablation_script_counts_completions_and_reads_accuracy(tmp_path):
    """summarize on a hand-made run: 8 prompts x G=8 per round, 2 steps of 1 and 3 rounds -> 256
    completions; best leaves out step 0; the overlong penalty fired on one of two steps; the final
    accuracy is the end-of-run eval (0.25), not the last periodic one (0.3), and its seconds count."""
    summary = ablation.summarize(load_run(_hand_made_run(tmp_path / "run", final=[1, 0, 0, 0])))
    assert (summary["final"], summary["best"], summary["completions"], summary["wall"]) == (0.25, 0.3, 256, 9.0)
    assert (summary["overlong_steps"], summary["length_max"], summary["truncated"]) == (0.5, 70, 0.25)
    assert summary["curve"] == [(0, 0, 0.2), (16, 256, 0.3)]  # 8 optimizer steps per step
    paired = ablation.paired_to({"a": [load_run(_hand_made_run(tmp_path / "a", [1, 0, 0, 0]))],
                                 "b": [load_run(_hand_made_run(tmp_path / "b", [1, 1, 1, 0]))]})
    assert paired["b"]["vs_previous"]["difference"] == pytest.approx(0.5)  # 0.75 - 0.25 on the same 4 items
    table = ablation.table({"a": [summary, summary], "b": [summary]}, paired, 4)
    assert "| a | 2 | 0.250 ± 0.000 | - | - |" in table
    assert f"| b | 1 | 0.250 | +0.500 [{paired['b']['vs_first']['low']:+.3f}," in table


def test_the_script_refuses_an_unknown_task_or_row(capsys):
    for argv, needle in ((["--tasks", "huge"], "unknown task 'huge'"), (["--rows", "7-more"], "no row 7-more")):
        with pytest.raises(SystemExit):
            ablation.main(argv)
        assert needle in capsys.readouterr().err


def test_two_rows_run_for_real_on_a_small_eval_split(tmp_path):
    """The command end to end with tiny settings: two rows, one seed, one step, on the shipped model
    with a 5-question local eval split (the whole split is evaluated at steps 0 and 1)."""
    task = write_small_task(tmp_path / "task")
    out = tmp_path / "out"
    code = ablation.main([
        "--tasks", "tiny", "--seeds", "1", "--rows", "1-grpo,3-clip-higher", "--out", str(out),
        "--png-dir", str(tmp_path / "png"), "--set", "train.max_steps=1", "--set", f"data.path={task}",
        "--set", "train.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "train.micro_batch_size=8",
    ])
    assert code == 0
    assert sorted(p.name for p in (out / "tiny").iterdir() if p.is_dir()) == ["1-grpo_seed1", "3-clip-higher_seed1"]
    result = json.loads((out / "tiny" / "ablation.json").read_text())
    paired = result["paired"]["3-clip-higher"]["vs_first"]
    assert (paired["eval"], paired["items"]) == ("final", 5)
    assert paired == result["paired"]["3-clip-higher"]["vs_previous"]  # with two rows, row 1 is the previous
    assert "| 3-clip-higher | 1 |" in (out / "tiny" / "ablation.md").read_text()
    assert (tmp_path / "png" / "ablation_tiny.png").is_file()
