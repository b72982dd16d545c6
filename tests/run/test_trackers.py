"""Experiment trackers through accelerate: TensorBoard holds exactly the scalars metrics.jsonl holds,
the resolved config as hyperparameters, the project and run names as configured, the rollout records
as a table every logging.rollout_every steps, and nothing is started or written on a rank other than
the main one."""

from types import SimpleNamespace

import pytest
import yaml
from accelerate import Accelerator
from accelerate.state import PartialState

from dapo_train.config.load import load_config
from dapo_train.run.logs import read_metrics
from dapo_train.run.rollouts import TABLE_COLUMNS, read_rollouts, rollouts_path
from dapo_train.run.trackers import TRACKERS, AccelerateTrackers, markdown_table
from dapo_train.train.loop import train

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "logging.progress_bar=false", "eval.print_samples=0",
    "eval.final_full=false",  # the end-of-run eval on all 500 items is tested in tests/run/test_eval_items.py
]


def _scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard reads back from an event folder: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_tensorboard_reads_back_the_scalars_and_the_config(tmp_path):
    run_dir = train(load_config(None, [
        *SMALL, "train.max_steps=2", "eval.every_steps=2", "eval.num_items=8", "logging.trackers=[tensorboard]",
        "run_name=tb-run", f"output_dir={tmp_path / 'run'}", "logging.rollout_every=2",
    ]))
    scalars = _scalars(run_dir / "dapo-train")
    rows = read_metrics(run_dir)
    logged = {(key, row["step"]): value for row in rows for key, value in row.items()
              if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert ("loss", 2) in logged and ("accuracy", 0) in logged and ("eval/format_rate", 2) in logged
    read_back = {(tag, step): value for tag, by_step in scalars.items() for step, value in by_step.items()}
    assert read_back.keys() == logged.keys()  # every numeric metric of every step, and nothing else
    for key, value in logged.items():
        assert read_back[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key  # stored as float32
    [hparams_file] = (run_dir / "dapo-train").glob("*/hparams.yml")
    hparams = yaml.safe_load(hparams_file.read_text())
    assert (hparams["run_name"], hparams["dapo.eps_high"], hparams["rewards.1.args.cache_length"]) == (
        "tb-run", 0.28, 32,
    )
    assert hparams["logging.trackers.0"] == "tensorboard" and hparams["dapo.clip_ratio_c"] == "null"
    # The rollout records of step 2 (logging.rollout_every=2: not step 1) as a markdown table in the Text tab.
    (table,) = _texts(run_dir / "dapo-train")["rollouts/text_summary"].items()
    records = read_rollouts(rollouts_path(run_dir, 2))
    assert table == (2, markdown_table(records))
    assert table[1].count("\n") == len(records) + 1 and records[0]["uid"] in table[1]


def _texts(folder) -> dict[str, dict[int, str]]:
    """Every text TensorBoard reads back from an event folder: tag -> {step: text}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return {tag: {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}
            for tag in events.Tags()["tensors"]}


def test_a_markdown_table_keeps_one_row_per_record():
    record = {"step": 3, "group": 1, "sample": 0, "fate": "trained", "uid": "train:5", "gold": "7", "extracted": "7",
              "correct": True, "reward": 1.0, "rewards": {"accuracy": 1.0}, "advantage": 0.5, "length": 9,
              "truncated": False, "completion": "a|b\nc"}
    header, rule, row = markdown_table([record]).split("\n")
    assert header == "| " + " | ".join(TABLE_COLUMNS) + " |" and rule == "|" + "---|" * len(TABLE_COLUMNS)
    assert row.endswith("| a\\|b\\nc |") and row.count(" | ") == len(TABLE_COLUMNS) - 1  # no pipe or newline breaks it


class FakeAccelerator:
    """Records what the trainer asks of accelerate's trackers."""

    is_main_process = True

    def __init__(self):
        self.calls, self.trackers = [], []

    def init_trackers(self, project_name, config=None, init_kwargs=None):
        self.calls.append(("init", project_name, config, init_kwargs))

    def log(self, values, step=None):
        self.calls.append(("log", values, step))

    def get_tracker(self, name, unwrap=False):
        return SimpleNamespace(log_table=lambda *args, **kwargs: self.calls.append((name, args, kwargs)))


def test_project_run_name_and_numeric_scalars_reach_every_tracker(caplog):
    """logging.project is the project every tracker files the run under; run_name names the run
    in each tracker's own keyword; a step logs its numbers only (no flags as 0/1, no strings); the
    rollout records go to the trackers with a table, and the others are named at start."""
    cfg = load_config(None, ["logging.trackers=[wandb, mlflow, clearml, trackio]", "logging.project=studies",
                             "run_name=eps-0.4"])
    fake = FakeAccelerator()
    trackers = AccelerateTrackers(fake, cfg)
    assert "logging.rollout_every: mlflow, trackio have no table through accelerate" in caplog.text
    (_, project, config, init_kwargs), = fake.calls
    assert project == "studies"
    assert init_kwargs == {"wandb": {"name": "eps-0.4"}, "mlflow": {"run_name": "eps-0.4"},
                           "clearml": {"task_name": "eps-0.4"}, "trackio": {"name": "eps-0.4"}}
    assert config["dapo.eps_high"] == 0.28 and config["logging.project"] == "studies"
    trackers.log(3, {"loss": 0.5, "groups_kept": 2, "flag": True, "note": "text"})
    assert fake.calls[-1] == ("log", {"loss": 0.5, "groups_kept": 2}, 3)
    record = dict.fromkeys(TABLE_COLUMNS, 1) | {"rewards": {"digit": 0.5}, "completion": "x"}
    trackers.log_rollouts(4, [record])
    row = [{"rewards": "digit 0.500", "completion": "x"}.get(column, 1) for column in TABLE_COLUMNS]
    assert fake.calls[-2:] == [(name, ("rollouts",), {"columns": list(TABLE_COLUMNS), "data": [row], "step": 4})
                               for name in ("wandb", "clearml")]


def test_a_rollout_table_that_cannot_act_is_named_at_start(caplog):
    for overrides in (["logging.rollout_every=0"], ["logging.rollout_groups=0"]):
        AccelerateTrackers(FakeAccelerator(), load_config(None, ["logging.trackers=[mlflow]", *overrides]))
    assert caplog.messages == ["logging.rollout_every cannot act: logging.rollout_groups=0 records no rollouts"]


def test_logging_project_names_the_tensorboard_folder(tmp_path):
    accelerator = Accelerator(cpu=True, log_with=["tensorboard"], project_dir=str(tmp_path))
    trackers = AccelerateTrackers(accelerator, load_config(None, ["logging.trackers=[tensorboard]",
                                                                  "logging.project=studies"]))
    trackers.log(1, {"loss": 0.25})
    trackers.close()
    assert [p.name for p in tmp_path.iterdir()] == ["studies"]
    assert _scalars(tmp_path / "studies") == {"loss": {1: 0.25}}


def test_only_the_main_process_starts_and_writes_trackers(tmp_path, monkeypatch):
    """Under several ranks, accelerate runs init_trackers and log on the main process only; the
    trainer's tracker calls go through them, so another rank writes nothing."""
    monkeypatch.setattr(PartialState, "is_main_process", property(lambda self: False))
    monkeypatch.setattr(PartialState, "use_distributed", property(lambda self: True))
    accelerator = Accelerator(cpu=True, log_with=["tensorboard"], project_dir=str(tmp_path))
    trackers = AccelerateTrackers(accelerator, load_config(None, ["logging.trackers=[tensorboard]"]))
    trackers.log(1, {"loss": 0.25})
    trackers.close()
    assert list(tmp_path.iterdir()) == [] and accelerator.trackers == []


def test_every_tracker_name_is_one_accelerate_knows():
    from accelerate.utils import LoggerType

    from dapo_train.config.schema import TRACKER_NAMES

    assert set(TRACKERS) == set(TRACKER_NAMES) <= {t.value for t in LoggerType}


def test_a_resume_before_the_end_hides_the_abandoned_steps_from_tensorboard(tmp_path):
    """Steps 1-2, then a resume from checkpoint_1: step 2 is logged again, and TensorBoard (purge_step)
    shows it once, with the new value; the first value stays in the older event file, hidden."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [*SMALL, "train.max_steps=2", "checkpoint.every_steps=1", "eval.every_steps=0",
            "logging.trackers=[tensorboard]", f"output_dir={tmp_path / 'run'}"]
    run_dir = train(load_config(None, args))
    train(load_config(None, [*args, "dapo.eps_high=0.5"]), resume=run_dir / "checkpoint_1")
    events = EventAccumulator(str(run_dir / "dapo-train"), size_guidance={"scalars": 0})
    events.Reload()
    assert [event.step for event in events.Scalars("loss")] == [1, 2]
    assert events.Scalars("loss")[1].value == pytest.approx(read_metrics(run_dir)[-1]["loss"], abs=1e-6)
    assert len(list((run_dir / "dapo-train").glob("events.out.tfevents.*"))) == 2
