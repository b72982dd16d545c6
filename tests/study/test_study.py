"""Sweeps, comparisons and plots: the grid parser, skip/resume with a stand-in trainer, the table's
numbers on hand-written runs, the figure's lines, and one real sweep on the shipped tiny model."""

import json
import math
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config.keys import COSMETIC_KEYS, schema_keys
from dapo_train.config.load import load_config, save_config
from dapo_train.errors import DoesNotFit, TaskSolved, TrainingAborted, UserError
from dapo_train.run.signals import StopRequested
from dapo_train.study.compare import _run_outcomes, compare, compare_rows, format_compare
from dapo_train.study.plot import PANELS, make_figure, plot
from dapo_train.study.runs import SWEEP_FILE, group_points, load_runs
from dapo_train.study.sweep import plan_sweep, run_sweep, split_top_level
from dapo_train.train import loop

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny-cpu.yaml")


def dapo(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "dapo_train", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


# --------------------------------------------------------------------------------------------
# The grid.


@pytest.mark.parametrize(
    ("value", "parts"),
    [
        ("0.1,0.5", ["0.1", "0.5"]),
        ("0.1", ["0.1"]),
        ("[{name: a}, {name: b}]", ["[{name: a}, {name: b}]"]),  # one YAML list, not two values
        ("[{name: a}],[{name: a}, {name: b}]", ["[{name: a}]", "[{name: a}, {name: b}]"]),
        ("{a: 1, b: 2},{a: 3}", ["{a: 1, b: 2}", "{a: 3}"]),
        ("'x, y',z", ["'x, y'", "z"]),  # quoted: the comma is text
        ('"x\\", y",z', ['"x\\", y"', "z"]),  # an escaped quote does not close a double-quoted string
        ("'it''s, ok',b", ["'it''s, ok'", "b"]),  # '' is an escaped quote inside single quotes
        ("it's,b", ["it's", "b"]),  # an apostrophe inside a word opens no quote
        ("1, 2", ["1", "2"]),
    ],
)
def test_values_split_only_on_top_level_commas(value, parts):
    assert split_top_level(value) == parts


def test_the_grid_is_the_product_of_the_comma_lists(tmp_path):
    sweep = plan_sweep(
        CONFIG, ["dapo.eps_high=0.1,0.5", "rollout.group_size=4,6", "train.max_steps=2"], "1,2", str(tmp_path / "s")
    )
    assert sweep.varied_keys == ["dapo.eps_high", "rollout.group_size"]
    assert sweep.plain_overrides == ["train.max_steps=2"]
    assert len(sweep.points) == 8  # 2 x 2 values x 2 seeds
    first = sweep.points[0]
    assert first.name == "eps_high=0.1_group_size=4_seed1"
    assert first.overrides == {"dapo.eps_high": "0.1", "rollout.group_size": "4"}
    expected = load_config(CONFIG, [
        "dapo.eps_high=0.1", "rollout.group_size=4", "train.max_steps=2", "seed=1",
        f"output_dir={tmp_path / 's' / first.name}", f"run_name={first.name}",
    ])
    assert first.cfg == expected
    assert [(p.cfg.dapo.eps_high, p.cfg.rollout.group_size, p.seed) for p in sweep.points[-2:]] == [
        (0.5, 6, 1), (0.5, 6, 2)
    ]
    assert not (tmp_path / "s").exists()  # planning writes nothing


def test_without_seeds_each_point_runs_once_with_the_configs_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = plan_sweep(CONFIG, ["dapo.eps_high=0.1,0.5", "seed=7"])
    assert sweep.sweep_dir == Path("outputs/sweep_tiny-cpu_eps_high=0.1-0.5_seed=7")  # the grid and fixed overrides
    assert [p.name for p in sweep.points] == ["eps_high=0.1_seed7", "eps_high=0.5_seed7"]
    assert [p.cfg.seed for p in sweep.points] == [7, 7]


def test_a_sweep_of_seeds_alone_runs_the_config_once_per_seed(tmp_path, monkeypatch):
    """Issue 59 item 15: `sweep CONFIG --seeds 1,2,3` was refused with "give at least one KEY=V1,V2", without a
    word about --seeds; seeds are a sweep of their own (compare averages over them)."""
    monkeypatch.chdir(tmp_path)
    sweep = plan_sweep(CONFIG, ["train.max_steps=2"], "1,2,3")
    assert sweep.sweep_dir == Path("outputs/sweep_tiny-cpu_max_steps=2")
    assert sweep.varied_keys == [] and [p.name for p in sweep.points] == ["seed1", "seed2", "seed3"]
    assert [(p.cfg.seed, p.cfg.train.max_steps) for p in sweep.points] == [(1, 2), (2, 2), (3, 2)]
    assert plan_sweep(CONFIG, [], "4,5").sweep_dir == Path("outputs/sweep_tiny-cpu")
    with pytest.raises(UserError, match=r"nothing to sweep: give at least one KEY=V1,V2 .* or two or more seeds "
                                        r"\(--seeds 1,2,3\); --seeds 7 is one"):
        plan_sweep(CONFIG, [], "7")


@pytest.mark.parametrize(
    ("args", "seeds", "needle"),
    [
        (["train.max_steps=2"], None, "nothing to sweep"),
        (["dapo.eps_high=0.1,oops"], None, "dapo.eps_high"),  # the last point is bad: found before any run
        (["dapo.eps_hihg=0.1,0.5"], None, "did you mean 'dapo.eps_high'"),
        (["dapo.eps_high=0.1,0.5"], "1,two", "--seeds"),
        (["dapo.eps_high=0.1,0.5"], "1,1", "twice"),
        (["dapo.eps_high=0.1,0.5", "seed=3"], "1,2", "--seeds"),
        (["seed=1,2"], None, "--seeds"),
        (["dapo.eps_high=0.1,0.5", "output_dir=x"], None, "--dir"),
        (["dapo.eps_high=0.1,0.5", "dapo.eps_high=0.3"], None, "twice"),
        (["dapo.eps_high=0.1,0.1"], None, "twice"),
        (["rewards.1.args.cache_length=16,96"], None, "cache_length"),  # a reward check, not only the schema
    ],
)
def test_bad_sweeps_fail_while_planning(tmp_path, args, seeds, needle):
    with pytest.raises(UserError) as err:
        plan_sweep(CONFIG, args, seeds, str(tmp_path / "s"))
    assert needle in str(err.value)


def test_an_unknown_config_fails_while_planning(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        plan_sweep(str(tmp_path / "nope.yaml"), ["dapo.eps_high=0.1,0.5"])


def test_bad_input_is_one_line_and_exit_2_before_any_run(tmp_path):
    result = dapo("sweep", CONFIG, "dapo.eps_high=0.1,oops", "--dir", "D", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: config key 'dapo.eps_high': expected float, got 'oops' (str)"
    ]
    assert not (tmp_path / "D").exists()


# --------------------------------------------------------------------------------------------
# Skip, resume, restart: a stand-in trainer that only writes what the real one leaves behind.


class FakeTrain:
    """Records its calls; writes config.yaml, metrics.jsonl and checkpoint_<max_steps>/ like train.
    `interrupt`: a run name that receives Ctrl-C mid-run (saves checkpoint_1, not the final one);
    `abort`: a run name that raises TrainingAborted; `solve`: one that saves checkpoint_1 and raises TaskSolved;
    `no_fit`: one that saves checkpoint_1 and raises DoesNotFit (out of memory with nothing left to halve)."""

    def __init__(self, interrupt=None, abort=None, solve=None, no_fit=None):
        self.calls = []
        self.interrupt, self.abort, self.solve, self.no_fit = interrupt, abort, solve, no_fit

    def __call__(self, cfg, *, resume=None, overwrite=False, stop=None):
        run_dir = Path(cfg.output_dir)
        self.calls.append((run_dir.name, resume, overwrite))
        if run_dir.name == self.abort:
            raise TrainingAborted("2 non-finite steps in a row")
        if overwrite and run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.5}) + "\n")
        if run_dir.name == self.solve:
            (run_dir / "checkpoint_1").mkdir()
            raise TaskSolved("step 1: the model answers every prompt correctly")
        if run_dir.name == self.no_fit:
            (run_dir / "checkpoint_1").mkdir(exist_ok=True)
            raise DoesNotFit("step 2's update: one completion alone (900 positions) does not fit the card")
        if run_dir.name == self.interrupt:
            self.interrupt = None
            stop.request(signal.SIGINT)
            (run_dir / "checkpoint_1").mkdir()
        else:
            (run_dir / f"checkpoint_{cfg.train.max_steps}").mkdir(exist_ok=True)
        return run_dir


GRID = ["dapo.eps_high=0.1,0.5", "train.max_steps=2"]
NAMES = ["eps_high=0.1_seed1", "eps_high=0.1_seed2", "eps_high=0.5_seed1", "eps_high=0.5_seed2"]


def _sweep(tmp_path, monkeypatch, fake, args=GRID):
    monkeypatch.setattr(loop, "train", fake)  # the function run_sweep calls
    return run_sweep(plan_sweep(CONFIG, args, "1,2", str(tmp_path / "s")), StopRequested())


def _statuses(sweep_dir):
    return [p["status"] for p in json.loads((sweep_dir / SWEEP_FILE).read_text())["points"]]


def test_a_finished_sweep_run_again_trains_nothing(tmp_path, monkeypatch, capsys):
    first = FakeTrain()
    assert _sweep(tmp_path, monkeypatch, first) == 0
    assert first.calls == [(name, None, True) for name in NAMES]  # fresh runs
    out = capsys.readouterr().out
    assert f"[2/4] eps_high=0.1 seed=2 -> {tmp_path / 's' / NAMES[1]}" in out
    assert out.strip().splitlines()[-1].endswith(f"dapo-train compare {tmp_path / 's'}")
    record = json.loads((tmp_path / "s" / SWEEP_FILE).read_text())
    assert record["config"] == CONFIG and record["varied_keys"] == ["dapo.eps_high"]
    assert record["overrides"] == ["train.max_steps=2"]
    assert record["points"][3] == {
        "name": NAMES[3], "overrides": {"dapo.eps_high": "0.5"}, "seed": 2,
        "run_dir": str(tmp_path / "s" / NAMES[3]), "status": "done",
    }
    before = (tmp_path / "s" / SWEEP_FILE).stat().st_mtime_ns

    again = FakeTrain()
    assert _sweep(tmp_path, monkeypatch, again) == 0
    assert again.calls == []
    assert capsys.readouterr().out.count("done, skipped") == 4
    assert (tmp_path / "s" / SWEEP_FILE).stat().st_mtime_ns == before


def test_ctrl_c_stops_the_sweep_and_the_rerun_resumes_that_point(tmp_path, monkeypatch):
    first = FakeTrain(interrupt=NAMES[1])
    assert _sweep(tmp_path, monkeypatch, first) == 128 + signal.SIGINT
    assert [name for name, _, _ in first.calls] == NAMES[:2]  # the next point never started
    assert _statuses(tmp_path / "s") == ["done", "interrupted", "pending", "pending"]

    again = FakeTrain()
    assert _sweep(tmp_path, monkeypatch, again) == 0
    assert again.calls == [(NAMES[1], True, False), (NAMES[2], None, True), (NAMES[3], None, True)]
    assert _statuses(tmp_path / "s") == ["done"] * 4


def test_done_needs_the_final_checkpoint_and_a_run_without_checkpoints_starts_over(tmp_path, monkeypatch):
    assert _sweep(tmp_path, monkeypatch, FakeTrain()) == 0
    shutil.rmtree(tmp_path / "s" / NAMES[0] / "checkpoint_2")  # "done" but its final checkpoint is gone
    (tmp_path / "s" / NAMES[0] / "checkpoint_1").mkdir()
    shutil.rmtree(tmp_path / "s" / NAMES[2] / "checkpoint_2")  # crashed before its first save
    again = FakeTrain()
    assert _sweep(tmp_path, monkeypatch, again) == 0
    assert again.calls == [(NAMES[0], True, False), (NAMES[2], None, True)]


def test_an_aborted_point_fails_alone(tmp_path, monkeypatch):
    fake = FakeTrain(abort=NAMES[0])
    assert _sweep(tmp_path, monkeypatch, fake) == 3  # TrainingAborted's exit code, once the other points ran
    assert [name for name, _, _ in fake.calls] == NAMES  # the other points still ran
    assert _statuses(tmp_path / "s") == ["failed", "done", "done", "done"]
    points = json.loads((tmp_path / "s" / SWEEP_FILE).read_text())["points"]
    assert points[0]["reason"] == "2 non-finite steps in a row" and "reason" not in points[1]


def test_a_point_that_does_not_fit_the_card_fails_alone_and_the_rerun_goes_past_it(tmp_path, monkeypatch, capsys):
    """Issue 59 item 3: a point that ran out of memory with nothing left to halve (exit 7 of its run) stopped the
    whole sweep, and running it again stopped at the same point. It fails alone, as a diverging point does."""
    fake = FakeTrain(no_fit=NAMES[1])
    assert _sweep(tmp_path, monkeypatch, fake) == 3  # a point failed, once the others ran
    assert [name for name, _, _ in fake.calls] == NAMES
    assert _statuses(tmp_path / "s") == ["done", "failed", "done", "done"]
    reason = json.loads((tmp_path / "s" / SWEEP_FILE).read_text())["points"][1]["reason"]
    assert reason.startswith("step 2's update: one completion alone")
    err = capsys.readouterr().err
    assert "[2/4] eps_high=0.1 seed=2: out of memory: step 2's update" in err and "Traceback" not in err
    again = FakeTrain(no_fit=NAMES[1])
    assert _sweep(tmp_path, monkeypatch, again) == 3
    assert again.calls == [(NAMES[1], True, False)]  # tried again from its checkpoint; the done points skipped
    assert _statuses(tmp_path / "s") == ["done", "failed", "done", "done"]


def test_a_solved_point_is_a_result_kept_and_not_trained_again(tmp_path, monkeypatch):
    """A point whose run stopped solved (exit code 4, before train.max_steps) is no failure: the sweep
    exits 0, marks it solved with its reason, and a second run of the command skips it."""
    assert _sweep(tmp_path, monkeypatch, FakeTrain(solve=NAMES[1])) == 0
    assert _statuses(tmp_path / "s") == ["done", "solved", "done", "done"]
    assert json.loads((tmp_path / "s" / SWEEP_FILE).read_text())["points"][1]["reason"].startswith("step 1: the model")
    again = FakeTrain()
    assert _sweep(tmp_path, monkeypatch, again) == 0 and again.calls == []


def test_a_run_folder_of_other_settings_is_refused(tmp_path, monkeypatch):
    assert _sweep(tmp_path, monkeypatch, FakeTrain()) == 0
    fake = FakeTrain()
    with pytest.raises(UserError, match="other settings \\(train.learning_rate\\)"):
        _sweep(tmp_path, monkeypatch, fake, [*GRID, "train.learning_rate=0.5"])
    assert fake.calls == []


def test_another_programs_sweep_json_is_refused_as_not_ours(tmp_path, monkeypatch):
    """Issue 49, point 4: another tool's sweep.json was called damaged, and the user told to delete it.
    It is not dapo-train's: the sweep goes elsewhere and the file stays; only a record the folder's
    marker says the sweep wrote is damaged."""
    folder = tmp_path / "s"
    folder.mkdir()
    theirs = '{"study": "optuna", "trials": [{"name": "a", "status": "done"}]}\n'
    (folder / SWEEP_FILE).write_text(theirs)
    with pytest.raises(UserError) as error:
        plan_sweep(CONFIG, GRID, "1,2", str(folder))
    message = str(error.value)
    assert "sweep.json is not one a sweep wrote" in message and "--dir" in message, message
    assert "damaged" not in message and "delete" not in message
    assert (folder / SWEEP_FILE).read_text() == theirs
    (folder / SWEEP_FILE).unlink()  # the user moves it away
    assert _sweep(tmp_path, monkeypatch, FakeTrain()) == 0  # now a sweep of dapo-train's, with its marker
    (folder / SWEEP_FILE).write_text('{"points": [')
    with pytest.raises(UserError, match="sweep.json is damaged"):
        plan_sweep(CONFIG, GRID, "1,2", str(folder))


# --------------------------------------------------------------------------------------------
# compare and plot on hand-written runs.


def make_run(run_dir, overrides, rows):
    run_dir.mkdir(parents=True)
    save_config(load_config(None, [*overrides, f"output_dir={run_dir}"]), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def train_row(step, entropy, high, low, length, seconds, **extra):
    row = {"step": step, "reward_mean": 0.1 * step, "entropy": entropy, "clip_frac_high": high,
           "completion_length_mean": length, "groups_kept": 4, "seconds_step": seconds, **extra}
    if low is not None:
        row["clip_frac_low"] = low
    return row


@pytest.fixture
def runs(tmp_path):
    """Point A (eps_high=0.1) with seeds 1 and 2, each ending with an eval of the whole split, point B
    (eps_high=0.5) with one seed from an older trainer that logged neither clip_frac_low nor
    seconds_eval nor a final eval."""
    root = tmp_path / "runs"
    make_run(root / "a1", ["dapo.eps_high=0.1", "seed=1"], [
        {"step": 0, "accuracy": 0.1, "seconds_eval": 1.0},
        train_row(1, 0.9, 0.1, 0.00, 30, 2.0),
        train_row(2, 0.7, 0.3, 0.02, 34, 2.0, accuracy=0.2, seconds_eval=1.0, final_accuracy=0.25,
                  seconds_final_eval=2.0),
    ])
    make_run(root / "a2", ["dapo.eps_high=0.1", "seed=2"], [
        {"step": 0, "accuracy": 0.1, "seconds_eval": 1.0},
        train_row(1, 0.8, 0.4, 0.03, 40, 3.0, accuracy=0.5, seconds_eval=1.0),
        train_row(2, 0.6, 0.4, 0.01, 44, 3.0, accuracy=0.4, seconds_eval=1.0, final_accuracy=0.35,
                  seconds_final_eval=2.0),
    ])
    make_run(root / "b1", ["dapo.eps_high=0.5", "seed=1"], [
        {"step": 0, "accuracy": 0.6},  # training made it worse: its best is still 0.3
        train_row(1, 1.0, 0.05, None, 20, 4.0, accuracy=0.3),
    ])
    return root


def test_compare_aggregates_seeds_by_hand(runs):
    varied, rows = compare_rows(load_runs([str(runs)]))  # a folder of runs expands to them
    # seed, output_dir and run_name differ between every run but are not settings of a point.
    assert varied == ["dapo.eps_high"]
    a, b = rows
    assert a["point"] == {"dapo.eps_high": 0.1} and a["seeds"] == [1, 2]  # the value as the config holds it
    # final accuracy (the whole split at the end): 0.25 and 0.35 -> mean 0.3, sample std sqrt(2 * 0.05^2)
    assert a["final_accuracy"]["mean"] == pytest.approx(0.3)
    assert a["final_accuracy"]["std"] == pytest.approx(math.sqrt(0.005))
    # last periodic eval: a1 ends at 0.2, a2 at 0.4 -> mean 0.3, sample std sqrt(2 * 0.1^2 / 1) = 0.1414
    assert a["last_accuracy"]["mean"] == pytest.approx(0.3)
    assert a["last_accuracy"]["std"] == pytest.approx(math.sqrt(0.02))
    # best after step 0: a1 0.2, a2 0.5 (its step-1 eval, not its last) -> 0.35 +- 0.3 / sqrt(2)
    assert a["best_accuracy"]["mean"] == pytest.approx(0.35)
    assert a["best_accuracy"]["std"] == pytest.approx(0.3 / math.sqrt(2))
    # per-run means first: clip high a1 (0.1 + 0.3) / 2 = 0.2, a2 0.4 -> 0.3; clip low 0.01, 0.02 -> 0.015
    assert a["clip_frac_high"]["mean"] == pytest.approx(0.3)
    assert a["clip_frac_low"]["mean"] == pytest.approx(0.015)
    # entropy first 0.9 / 0.8 -> 0.85, last 0.7 / 0.6 -> 0.65; length 32 / 42 -> 37
    assert a["entropy_first"]["mean"] == pytest.approx(0.85)
    assert a["entropy_last"]["mean"] == pytest.approx(0.65)
    assert a["completion_length"]["mean"] == pytest.approx(37)
    # wall time: a1 2 + 2 s training + 1 + 1 s eval + 2 s final eval = 8, a2 3 + 3 + 1 + 1 + 1 + 2 = 11 -> 9.5
    assert a["wall_seconds"]["mean"] == pytest.approx(9.5)
    assert a["steps"] == {"mean": 2, "std": 0, "n": 2}
    assert b["point"] == {"dapo.eps_high": 0.5} and b["seeds"] == [1]
    assert b["last_accuracy"] == {"mean": 0.3, "std": None, "n": 1}
    assert b["final_accuracy"] is None  # no eval of the whole split: shown as "-"
    assert b["best_accuracy"]["mean"] == 0.3  # not step 0's 0.6: that is the model before training
    assert b["clip_frac_low"] is None  # never logged: shown as "-"
    assert b["wall_seconds"]["mean"] == pytest.approx(4.0)  # no seconds_eval counts as 0

    table = format_compare(varied, rows).splitlines()
    assert table[0].split()[:3] == ["dapo.eps_high", "seeds", "final"]
    assert "0.300 ± 0.071  0.300 ± 0.141  0.350 ± 0.212" in table[2]  # final, last, best
    assert table[3].split()[:6] == ["0.5", "1", "-", "0.300", "0.300", "0.0500"]
    assert table[3].split()[6] == "-"
    assert "final acc: the whole eval split" in table[4]  # the table says which accuracy is which


def test_compare_shows_the_answer_accuracy_beside_the_strict_one(tmp_path):
    """Runs that logged both accuracies: the last and final answer accuracy of the last eval rows (not an earlier
    row's), averaged over seeds; the table shows them and says which is which. Without them (the runs above, from
    before) the columns are left out."""
    root = tmp_path / "runs"
    for seed, (last, final) in enumerate([(0.5, 0.45), (0.7, 0.55)], start=1):
        make_run(root / f"a{seed}", ["dapo.eps_high=0.1", f"seed={seed}"], [
            {"step": 0, "accuracy": 0.1, "eval/answer_accuracy": 0.4},
            train_row(1, 0.9, 0.1, 0.0, 30, 2.0, accuracy=0.2, **{"eval/answer_accuracy": 0.9}),
            train_row(2, 0.7, 0.3, 0.0, 34, 2.0, accuracy=0.3, final_accuracy=0.25,
                      **{"eval/answer_accuracy": last, "final/answer_accuracy": final}),
        ])
    varied, rows = compare_rows(load_runs([str(root)]))
    assert rows[0]["last_answer_accuracy"]["mean"] == pytest.approx(0.6)  # (0.5 + 0.7) / 2
    assert rows[0]["final_answer_accuracy"]["mean"] == pytest.approx(0.5)  # (0.45 + 0.55) / 2
    table = format_compare(varied, rows).splitlines()
    assert re.split(r"\s{2,}", table[0])[:6] == ["run", "seeds", "final acc", "final answer", "last acc", "last answer"]
    assert re.split(r"\s{2,}", table[2])[2:6] == ["0.250", "0.500 ± 0.071", "0.300", "0.600 ± 0.141"]
    assert any(line.startswith("acc is strict (the answer block, as the reward grades)") for line in table)


def test_compare_shows_each_runs_change_from_its_start_and_how_it_ended(tmp_path):
    """Issue 59 item 16: compare showed neither a run's change from its own step 0 nor whether it finished,
    regressed or aborted. The change is the final eval's where the run made one (final/change), else its last
    periodic eval's (eval/change), with its interval; a point of several seeds shows their mean ± sample std;
    the status is run_status.json's."""
    from dapo_train.run.logs import write_status

    def change(prefix, value, low, high):
        return {f"{prefix}change": value, f"{prefix}change_low": low, f"{prefix}change_high": high}

    root = tmp_path / "runs"
    make_run(root / "a1", ["dapo.eps_high=0.1", "seed=1"], [
        {"step": 0, "accuracy": 0.1},
        train_row(1, 0.9, 0.1, 0.0, 30, 2.0, accuracy=0.2, **change("eval/", 0.1, 0.02, 0.18)),
        train_row(2, 0.7, 0.3, 0.0, 34, 2.0, accuracy=0.3, final_accuracy=0.3, **change("eval/", 0.2, 0.1, 0.3),
                  **change("final/", 0.05, -0.01, 0.11)),
    ])
    make_run(root / "a2", ["dapo.eps_high=0.1", "seed=2"], [
        {"step": 0, "accuracy": 0.1},
        train_row(1, 0.9, 0.1, 0.0, 30, 2.0, accuracy=0.2, **change("eval/", 0.03, -0.02, 0.08)),
    ])
    make_run(root / "b1", ["dapo.eps_high=0.5", "seed=1"], [
        {"step": 0, "accuracy": 0.6},
        train_row(1, 1.0, 0.05, 0.0, 20, 4.0, accuracy=0.3, **change("eval/", -0.3, -0.4, -0.2)),
    ])
    make_run(root / "c1", ["dapo.eps_high=0.9", "seed=1"], [{"step": 0, "accuracy": 0.6}])  # no change logged yet
    for name, status, step in (("a1", "finished", 2), ("a2", "finished", 1), ("b1", "regressed", 1)):
        write_status(root / name, status, step)
    varied, rows = compare_rows(load_runs([str(root)]))
    a, b, c = rows
    assert a["status"] == ["finished", "finished"] and b["status"] == ["regressed"] and c["status"] == [None]
    assert a["change_from_start"] == [  # a1: the final eval's, not its last periodic eval's 0.2
        {"eval": "final", "change": 0.05, "low": -0.01, "high": 0.11},
        {"eval": "step 1", "change": 0.03, "low": -0.02, "high": 0.08},
    ]
    assert b["change_from_start"] == [{"eval": "step 1", "change": -0.3, "low": -0.4, "high": -0.2}]
    assert c["change_from_start"] == [None]
    table = format_compare(varied, rows).splitlines()
    assert re.split(r"\s{2,}", table[0])[:4] == ["dapo.eps_high", "seeds", "status", "Δ from start"]
    # a: (0.05 + 0.03) / 2 = 0.04, sample std sqrt(2 * 0.01^2) = 0.014
    assert re.split(r"\s{2,}", table[2].strip())[:4] == ["0.1", "2", "2 finished", "+0.040 ± 0.014"]
    assert re.split(r"\s{2,}", table[3].strip())[:4] == ["0.5", "1", "regressed", "-0.300 [-0.400, -0.200]"]
    assert re.split(r"\s{2,}", table[4].strip())[:4] == ["0.9", "1", "-", "-"]
    assert any(line.startswith("Δ from start: each run's last eval") for line in table)


def _sampled(pass1, maj, passk, changes=None):
    """A row's sampled eval (eval.samples=8): its keys, with changes (pass@1, maj@k, pass@k) after step 0."""
    row = {"eval/sampled/samples": 8, "eval/sampled/pass_at_1": pass1, "eval/sampled/maj_at_k": maj,
           "eval/sampled/pass_at_k": passk, "seconds_eval_sampled": 4.0}
    for name, change in zip(("pass_at_1", "maj_at_k", "pass_at_k"), changes or ()):
        row[f"eval/sampled/{name}_change"] = change
    return row


def test_compare_and_plot_show_the_sampled_eval(tmp_path, runs):
    """Two seeds with a sampled eval: the last one's pass@1, maj@K and pass@K and their changes from step 0 as
    means over the seeds, its seconds in the wall time; the figure draws pass@1 dashed beside the greedy accuracy
    and maj@K, pass@K in a panel of their own. Runs without it (the fixture's) show no sampled column."""
    root = tmp_path / "sampled"
    for seed, (pass1, change) in enumerate([(0.6, 0.02), (0.7, 0.04)], start=1):
        make_run(root / f"a{seed}", ["dapo.eps_high=0.1", f"seed={seed}"], [
            {"step": 0, "accuracy": 0.5, "seconds_eval": 1.0, **_sampled(0.55, 0.6, 0.8)},
            train_row(1, 0.9, 0.1, 0.0, 30, 2.0, accuracy=0.5, **_sampled(pass1, 0.65, 0.8, (change, 0.05, 0.0))),
        ])
    varied, rows = compare_rows(load_runs([str(root)]))
    row = rows[0]
    assert row["sampled_pass_at_1"]["mean"] == pytest.approx(0.65)  # (0.6 + 0.7) / 2, the last eval's
    assert row["sampled_pass_at_1_change"]["mean"] == pytest.approx(0.03)  # (0.02 + 0.04) / 2
    assert (row["sampled_maj_at_k"]["mean"], row["sampled_pass_at_k_change"]["mean"]) == (pytest.approx(0.65), 0.0)
    assert row["wall_seconds"]["mean"] == pytest.approx(11.0)  # 2 s training + 1 s greedy eval + 2 x 4 s sampled
    table = format_compare(varied, rows).splitlines()
    headers, cells = re.split(r"\s{2,}", table[0]), re.split(r"\s{2,}", table[2])
    at = headers.index("sampled pass@1")
    assert headers[at : at + 6] == ["sampled pass@1", "Δ pass@1", "maj@K", "Δ maj@K", "pass@K", "Δ pass@K"]
    assert cells[at : at + 6] == ["0.650 ± 0.071", "0.030 ± 0.014", "0.650", "0.050", "0.800", "0.000"]
    assert any(line.startswith("sampled pass@1, maj@K, pass@K: the last periodic eval's K samples") for line in table)
    assert "sampled pass@1" not in format_compare(*compare_rows(load_runs([str(runs)])))

    pytest.importorskip("matplotlib")
    fig = make_figure(*group_points(load_runs([str(root)])))
    accuracy, sampled = fig.axes[0], fig.axes[len(PANELS) - 1]
    assert [line.get_linestyle() for line in accuracy.lines] == ["-", "--"]
    assert list(accuracy.lines[1].get_ydata()) == pytest.approx([0.55, 0.65])  # pass@1 over the seeds
    assert sampled.get_title() == "sampled eval (solid maj@K, dashed pass@K)"
    assert [list(line.get_ydata()) for line in sampled.lines] == [pytest.approx([0.6, 0.65]), [0.8, 0.8]]


def test_compare_json_and_run_paths(runs):
    by_folder = json.loads(compare([str(runs)], as_json=True))
    by_runs = json.loads(compare([str(runs / "b1"), str(runs / "a1"), str(runs / "a2"), str(runs)], as_json=True))
    assert [row["point"] for row in by_runs] == [{"dapo.eps_high": 0.5}, {"dapo.eps_high": 0.1}]
    assert sorted(by_runs, key=lambda row: row["point"]["dapo.eps_high"]) == by_folder  # each run counted once


def test_compare_expands_a_sweep(tmp_path, monkeypatch):
    assert _sweep(tmp_path, monkeypatch, FakeTrain()) == 0
    (tmp_path / "s" / NAMES[3] / "metrics.jsonl").unlink()  # a run that has not logged yet is left out
    varied, rows = compare_rows(load_runs([str(tmp_path / "s")]))
    assert varied == ["dapo.eps_high"]
    assert [(row["point"]["dapo.eps_high"], row["seeds"]) for row in rows] == [(0.1, [1, 2]), (0.5, [1])]


def test_compare_of_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in ("empty", "missing"):
        result = dapo("compare", target, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and target in lines[0], result.stderr


def test_the_figure_draws_the_mean_of_the_seeds_and_a_band(runs):
    pytest.importorskip("matplotlib")
    fig = make_figure(*group_points(load_runs([str(runs)])))
    accuracy, reward, entropy, clip, length, groups = fig.axes[:6]
    a_line, b_line = accuracy.lines
    # steps 0, 1, 2: both seeds at 0 (0.1), only a2 evaluated at step 1 (0.5), both at 2 ((0.2 + 0.4) / 2)
    assert list(a_line.get_xdata()) == [0, 1, 2]
    assert list(a_line.get_ydata()) == pytest.approx([0.1, 0.5, 0.3])
    assert list(b_line.get_ydata()) == pytest.approx([0.6, 0.3])
    assert len(accuracy.collections) == 1  # a band for A (two seeds), none for B
    assert len(clip.lines) == 3  # A high and low, B high only (it never logged clip_frac_low)
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "eps_high=0.1 (2 seeds)", "eps_high=0.5"
    ]
    assert "min-max" in fig.texts[0].get_text()  # the figure says what the band is
    kl = fig.axes[6]
    assert kl.get_title().startswith("rollout KL") and [t.get_text() for t in kl.texts] == ["not logged by these runs"]


def test_the_rollout_panels_say_exact_by_construction_instead_of_plotting_rounding(tmp_path):
    """A point whose rollout is the training forward (rollout_exact 1 on every row, the CPU float32 demo)
    logs a numeric gap of float rounding (1e-13): its panels say so instead of drawing it; a point of a
    bf16 copy is drawn; the truncation's KL is drawn for both (0 without truncation)."""
    pytest.importorskip("matplotlib")
    gap = {"rollout_kl": 1e-13, "rollout_logprob_diff_mean": 3e-7, "rollout_logprob_diff_max": 2e-6,
           "rollout_is_weight_mean": 1.0, "rollout_is_clipped_frac": 0.0, "rollout_kl_truncation": 0.0}
    root = tmp_path / "runs"
    make_run(root / "fp32", ["rollout.dtype=float32"], [
        train_row(step, 0.5, 0.1, 0.0, 30, 1.0, rollout_exact=1, **gap) for step in (1, 2)])
    kl, diff, weight = make_figure(*group_points(load_runs([str(root)]))).axes[6:9]
    assert [line.get_linestyle() for line in kl.lines] == ["--"]  # the truncation's line only
    assert not diff.lines and not weight.lines
    assert [t.get_text() for t in diff.texts] == ["exact by construction: the rollout is the training forward"]
    make_run(root / "bf16", ["rollout.dtype=bfloat16"], [
        train_row(step, 0.5, 0.1, 0.0, 30, 1.0, rollout_exact=0, **{**gap, "rollout_kl": 3e-7}) for step in (1, 2)])
    kl, diff, _ = make_figure(*group_points(load_runs([str(root)]))).axes[6:9]
    assert len(diff.lines) == 2 and "for 1 of 2 points (not drawn)" in diff.texts[0].get_text()  # bf16's mean, max
    assert len(kl.lines) == 3  # bf16's numeric line, and both points' truncation lines


def test_plot_writes_a_png(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = plot([str(runs)], str(tmp_path / "figs" / "p.png"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UserError, match="unknown image type"):
        plot([str(runs)], str(tmp_path / "p.nope"))


def test_plot_never_replaces_a_file(runs, tmp_path):
    """Issue 59, item 15: `plot -o mine.pdf` replaced the user's file without a word. A file already there is refused
    in one line naming it, and keeps its bytes."""
    pytest.importorskip("matplotlib")
    mine = tmp_path / "mine.pdf"
    mine.write_bytes(b"%PDF-1.4 the user's paper\n")
    with pytest.raises(UserError) as caught:
        plot([str(runs)], str(mine))
    message = str(caught.value)
    assert "\n" not in message and f"-o {mine}" in message and "exists" in message, message
    assert mine.read_bytes() == b"%PDF-1.4 the user's paper\n"


def test_plot_without_matplotlib_names_the_install_command(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UserError, match=r"pip install 'dapo-train\[plot\]'"):
        plot([str(runs)], str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------------------------
# One real sweep on the shipped tiny model.


def test_a_real_sweep_trains_each_point_once(tmp_path):
    args = [
        "sweep", CONFIG, "dapo.eps_high=0.1,0.5", "train.max_steps=1", "train.prompts_per_step=2",
        "rollout.group_size=4", "train.micro_batch_size=8", "eval.every_steps=1", "eval.num_items=8",
        "eval.final_full=false", "logging.progress_bar=false", "--dir", "D",
    ]
    first = dapo(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    sweep_dir = tmp_path / "D"
    assert _statuses(sweep_dir) == ["done", "done"]
    runs = [sweep_dir / "eps_high=0.1_seed0", sweep_dir / "eps_high=0.5_seed0"]
    for run in runs:
        assert (run / "checkpoint_1" / "model.safetensors").is_file()
        assert [row["step"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1]
    files = sorted(p for p in sweep_dir.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}

    again = dapo(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("done, skipped") == 2
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sweep_dir.rglob("*") if p.is_file()} == before

    table = dapo("compare", "D", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert len(lines) == 7 and [line.split()[0] for line in lines[2:4]] == ["0.1", "0.5"]  # + the three notes
    assert "last answer" in lines[0] and lines[6].startswith("acc is strict")  # real runs log both accuracies
    # Each run recorded how it ended, and its change from step 0 (its eval at step 1) with an interval:
    assert re.split(r"\s{2,}", lines[0])[1:4] == ["seeds", "status", "Δ from start"]
    assert all(re.fullmatch(r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]", re.split(r"\s{2,}", line)[3])
               and re.split(r"\s{2,}", line)[2] == "finished" for line in lines[2:4]), lines


def test_cosmetic_keys_are_no_setting_but_eps_high_is(tmp_path):
    """Issue 38: a pair that differs only in how it shows or logs (the progress bar, trackers, checkpoint
    cadence) is one point, not two settings; a pair that differs in dapo.eps_high is two."""
    rows = [{"step": 0, "accuracy": 0.1}, train_row(1, 0.9, 0.1, 0.0, 30, 2.0, accuracy=0.2)]
    make_run(tmp_path / "bar", ["logging.progress_bar=true", "checkpoint.every_steps=5"], rows)
    make_run(tmp_path / "quiet", ["logging.progress_bar=false", "logging.trackers=[tensorboard]"], rows)
    make_run(tmp_path / "wide", ["dapo.eps_high=0.5", "logging.progress_bar=false"], rows)
    varied, points = group_points(load_runs([str(tmp_path / "bar"), str(tmp_path / "quiet")]))
    assert varied == [] and len(points) == 1 and len(points[0].runs) == 2
    varied, points = group_points(load_runs([str(tmp_path / "bar"), str(tmp_path / "wide")]))
    assert varied == ["dapo.eps_high"] and [p.settings for p in points] == [{"dapo.eps_high": "0.28"},
                                                                            {"dapo.eps_high": "0.5"}]
    assert set(COSMETIC_KEYS) <= {info.key for info in schema_keys()}  # each names a real key
    studies = (Path(__file__).resolve().parents[2] / "docs" / "studies.md").read_text(encoding="utf-8")
    assert [key for key in COSMETIC_KEYS if f"`{key}`" not in studies] == []  # the docs list them all


def test_compare_and_plot_show_generation_cost_side_by_side(tmp_path):
    """Generated tokens per trained token and generation seconds per trained group are ratios of the
    run's sums: off generates 300 + 100 tokens for 100 + 100 trained (2.00), in 8 + 4 s for 4 + 4 groups
    (1.50); screening 150 + 150 for 100 + 150 (1.20), in 5 + 5 s for 4 + 6 groups (1.00)."""
    root = tmp_path / "runs"
    make_run(root / "off", ["dapo.screen_size=0"], [
        train_row(1, 0.5, 0.1, 0.0, 30, 9.0, generated_tokens=300, trained_tokens=100, seconds_generate=8.0,
                  generated_per_trained_token=3.0, seconds_generate_per_group=2.0),
        train_row(2, 0.5, 0.1, 0.0, 30, 5.0, generated_tokens=100, trained_tokens=100, seconds_generate=4.0,
                  generated_per_trained_token=1.0, seconds_generate_per_group=1.0)])
    make_run(root / "screen", ["dapo.screen_size=2"], [
        train_row(1, 0.5, 0.1, 0.0, 30, 6.0, generated_tokens=150, trained_tokens=100, seconds_generate=5.0,
                  generated_per_trained_token=1.5, seconds_generate_per_group=1.25),
        train_row(2, 0.5, 0.1, 0.0, 30, 6.0, generated_tokens=150, trained_tokens=150, seconds_generate=5.0,
                  groups_kept=6, generated_per_trained_token=1.0, seconds_generate_per_group=5 / 6)])
    varied, rows = compare_rows(load_runs([str(root)]))
    assert varied == ["dapo.screen_size"]
    off, screen = rows
    assert off["generated_per_trained_token"]["mean"] == pytest.approx(2.0)
    assert off["seconds_generate_per_group"]["mean"] == pytest.approx(1.5)
    assert screen["generated_per_trained_token"]["mean"] == pytest.approx(1.2)
    assert screen["seconds_generate_per_group"]["mean"] == pytest.approx(1.0)
    table = format_compare(varied, rows).splitlines()
    assert "gen tok/trained" in table[0] and "gen s/group" in table[0]
    assert table[2].split()[-4:-2] == ["2.00", "1.50"] and table[3].split()[-4:-2] == ["1.20", "1.00"]
    pytest.importorskip("matplotlib")
    by_title = {ax.get_title(): ax for ax in make_figure(*group_points(load_runs([str(root)]))).axes}
    per_token = by_title["generated tokens per trained token"]
    assert [list(line.get_ydata()) for line in per_token.lines] == [[3.0, 1.0], [1.5, 1.0]]
    per_group = by_title["generation seconds per trained group"]
    assert [value for line in per_group.lines for value in line.get_ydata()] == pytest.approx([2.0, 1.0, 1.25, 5 / 6])


def _tool_runs(root, calls, errors, use, seeds=(1,)):
    """Runs with rollout.tools=[calculator] (per step: 10 completions, `calls`, `errors`, `use` lists) and
    rollout.tools=[] (no calls), one per seed; step 2's calls differ by seed (+ seed) so pairs vary."""
    for seed in seeds:
        make_run(root / f"calc{seed}", ["rollout.tools=[calculator]", f"seed={seed}"], [
            train_row(step, 0.5, 0.1, 0.0, 30, 2.0, completions=10, tool_calls=c + (seed if step == 2 else 0),
                      tool_errors=e, tool_use_ratio=u) for step, c, e, u in zip((1, 2), calls, errors, use)])
        make_run(root / f"none{seed}", ["rollout.tools=[]", f"seed={seed}"], [
            train_row(step, 0.5, 0.1, 0.0, 30, 2.0, completions=10, tool_calls=0, tool_errors=0, tool_use_ratio=0.0)
            for step in (1, 2)])
    return root


def test_compare_shows_tool_use_where_a_point_called_a_tool(tmp_path):
    """Calls per completion and the error share are ratios of the steps' sums: 15 + (5 + 1) calls over 10 + 10
    completions = 1.05, 3 + 0 errors over 21 calls = 0.143; tool use first / last are steps 1 and 2's shares.
    The point without tools has 0 calls and no error share ("-"); a table of points that never called a tool
    has no tool columns at all."""
    root = _tool_runs(tmp_path / "runs", calls=(15, 5), errors=(3, 0), use=(0.8, 0.4))
    varied, rows = compare_rows(load_runs([str(root)]))
    # a list flattens by index: the calculator point is rollout.tools.0=calculator, the other rollout.tools=[]
    calc, none = sorted(rows, key=lambda row: row["point"]["rollout.tools.0"] != "calculator")
    assert none["point"]["rollout.tools"] == []
    assert calc["tool_calls_per_completion"]["mean"] == pytest.approx(21 / 20)
    assert calc["tool_error_rate"]["mean"] == pytest.approx(3 / 21)
    assert (calc["tool_use_first"]["mean"], calc["tool_use_last"]["mean"]) == (0.8, 0.4)
    assert none["tool_calls_per_completion"]["mean"] == 0 and none["tool_error_rate"] is None
    table = format_compare(varied, rows)
    assert "calls/completion" in table and "tool use last" in table and "tool use first / last" in table
    assert "1.05" in table and "0.143" in table
    quiet = compare_rows(load_runs([str(root / "none1")]))
    assert "calls/completion" not in format_compare(*quiet) and "tool use" not in format_compare(*quiet)


def test_tool_use_is_paired_seed_by_seed_only_where_a_point_called_a_tool(tmp_path):
    """Seeds 1 and 2 call 15 + 5 + seed times over 20 completions: 21 / 20 and 22 / 20 against 0, so the
    paired differences are 1.05 and 1.10 (mean 1.075); two points without calls pair no tool outcome."""
    root = _tool_runs(tmp_path / "runs", calls=(15, 5), errors=(3, 0), use=(0.8, 0.4), seeds=(1, 2))
    _, points = group_points(load_runs([str(root)]))
    calc, none = sorted(points, key=lambda point: point.values["rollout.tools.0"] != "calculator")
    outcomes = _run_outcomes(none, calc)
    assert outcomes["tool_calls_per_completion"]["mean"] == pytest.approx(1.075)
    assert outcomes["tool_calls_per_completion"]["n"] == 2
    assert outcomes["tool_error_rate"] is None  # the baseline made no call: no share to pair with
    assert outcomes["entropy_last"]["mean"] == 0
    assert _run_outcomes(none, none)["tool_calls_per_completion"] is None
