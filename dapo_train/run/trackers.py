"""The experiment trackers of logging.trackers (TensorBoard, W&B, MLflow, ...) through accelerate,
and the no-op tracker that stands in wherever nothing is tracked (other ranks, no trackers).

Besides each step's scalars, every logging.rollout_every steps the step's rollout records
(run/rollouts.py) go to the trackers that have a table: TensorBoard as a markdown table in its Text
tab, W&B and ClearML as tables. A configured tracker without one is named at start.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo_train.config.load import config_to_dict, flatten_config
from dapo_train.errors import UserError
from dapo_train.run.rollouts import TABLE_COLUMNS, table_rows

logger = logging.getLogger(__name__)


class NullTracker:
    """No tracker configured: the same calls, doing nothing (no `if tracker:` at call sites)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_rollouts(self, step: int, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class TrackerSpec:
    """How one accelerate tracker is checked and told the run's name.

    check: the accelerate.utils function that says whether its package imports (looked up when
    asked: importing accelerate costs `compare` and `plot` a second). run_kwargs(run_name): the init
    keyword arguments that name the run. rename(tracker object, run_name): for trackers whose init
    takes no run name, names it once started. table(accelerate's tracker, step, records): logs
    rollout records as a table; None: the tracker has none through accelerate."""

    package: str
    check: str
    run_kwargs: Callable[[str], dict] = lambda run_name: {}
    rename: Callable[[Any, str], None] | None = None
    table: Callable[[Any, int, list[dict]], None] | None = None

    def available(self) -> bool:
        import accelerate.utils

        return bool(getattr(accelerate.utils, self.check)())


def _set_name(run: Any, run_name: str) -> None:
    run.name = run_name


ROLLOUTS_TABLE = "rollouts"  # the table's name (TensorBoard's text tag)
MARKDOWN_TEXT = 400  # characters of a completion in TensorBoard's markdown table


def _cell(value: Any) -> str:
    """A value in one markdown table cell: no pipe or newline may break the row."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")


def markdown_table(records: list[dict], limit: int = MARKDOWN_TEXT) -> str:
    """The records as a markdown table of TABLE_COLUMNS, completions cut to `limit` characters."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in table_rows(records, limit)]
    return "\n".join(lines)


def _tensorboard_table(tracker: Any, step: int, records: list[dict]) -> None:
    tracker.log({ROLLOUTS_TABLE: markdown_table(records)}, step=step)  # a str value: SummaryWriter.add_text


def _table(tracker: Any, step: int, records: list[dict]) -> None:
    tracker.log_table(ROLLOUTS_TABLE, columns=list(TABLE_COLUMNS), data=table_rows(records), step=step)


# logging.trackers name (accelerate's LoggerType) -> its spec; schema.TRACKER_NAMES lists the same names.
TRACKERS: dict[str, TrackerSpec] = {
    "tensorboard": TrackerSpec("tensorboard", "is_tensorboard_available", table=_tensorboard_table),  # in the run
    "wandb": TrackerSpec("wandb", "is_wandb_available", lambda run_name: {"name": run_name}, table=_table),
    "mlflow": TrackerSpec("mlflow", "is_mlflow_available", lambda run_name: {"run_name": run_name}),
    "comet_ml": TrackerSpec(
        "comet_ml", "is_comet_ml_available", rename=lambda experiment, run_name: experiment.set_name(run_name)
    ),
    "aim": TrackerSpec("aim", "is_aim_available", rename=_set_name),
    "clearml": TrackerSpec("clearml", "is_clearml_available", lambda run_name: {"task_name": run_name},
                           table=_table),
    "trackio": TrackerSpec("trackio", "is_trackio_available", lambda run_name: {"name": run_name}),
}


def check_trackers(names: list[str]) -> None:
    """Every configured tracker's package imports; else one UserError now, before the run folder
    exists (accelerate itself would drop a missing tracker with a debug message)."""
    missing = [name for name in names if not TRACKERS[name].available()]
    if missing:
        packages = " ".join(TRACKERS[name].package for name in missing)
        raise UserError(
            f"logging.trackers names {', '.join(missing)}, but {packages} {'is' if len(missing) == 1 else 'are'} "
            f"not installed: pip install {packages}, or remove {'it' if len(missing) == 1 else 'them'} from "
            "logging.trackers"
        )


def tracker_hparams(cfg_dict: dict) -> dict:
    """The resolved config as flat hyperparameters (`dapo.eps_high`, `rewards.0.weight`); a value
    that is not a number, string or boolean (None, an empty list) becomes its JSON text, which every
    tracker stores."""
    return {
        key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value, ensure_ascii=False)
        for key, value in flatten_config(cfg_dict).items()
    }


class AccelerateTrackers:
    """logging.trackers through the run's Accelerator (built with log_with and project_dir = the run
    folder): started once with the resolved config as hyperparameters, project logging.project and
    run name run_name; each step's numeric scalars logged at its step. accelerate runs all of it on
    the main process only. A run resumed at step s tells TensorBoard to hide the events it logged
    after s (purge_step): those steps are logged again, and the earlier ones stay in its files."""

    def __init__(self, accelerator, cfg, resume_step: int | None = None) -> None:
        names = cfg.logging.trackers
        self.accelerator = accelerator
        init_kwargs = {name: TRACKERS[name].run_kwargs(cfg.run_name) for name in names}
        if resume_step is not None and "tensorboard" in init_kwargs:
            init_kwargs["tensorboard"]["purge_step"] = resume_step + 1
        accelerator.init_trackers(
            cfg.logging.project, config=tracker_hparams(config_to_dict(cfg)), init_kwargs=init_kwargs,
        )
        for name in names:
            if TRACKERS[name].rename is not None and accelerator.is_main_process:
                TRACKERS[name].rename(accelerator.get_tracker(name, unwrap=True), cfg.run_name)
        self.tables = [name for name in names if TRACKERS[name].table is not None]
        _say_what_tables_cannot_act(cfg, [name for name in names if name not in self.tables])

    def log(self, step: int, metrics: dict) -> None:
        numeric = {key: value for key, value in metrics.items() if isinstance(value, (int, float))}
        self.accelerator.log({key: value for key, value in numeric.items() if not isinstance(value, bool)}, step=step)

    def log_rollouts(self, step: int, records: list[dict]) -> None:
        """A step's rollout records as a table, in every tracker that has one (main process only)."""
        if not self.accelerator.is_main_process:
            return
        for name in self.tables:
            TRACKERS[name].table(self.accelerator.get_tracker(name), step, records)

    def close(self) -> None:
        """Finish every tracker (flush, close the run). Not accelerator.end_training(): that also
        destroys the process group, which a sweep's next run in this process still needs."""
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers.clear()


def _say_what_tables_cannot_act(cfg, without_table: list[str]) -> None:
    """At start: the configured trackers logging.rollout_every cannot reach, or that it cannot act at all."""
    if cfg.logging.rollout_every == 0:
        return
    if cfg.logging.rollout_groups == 0:
        logger.warning("logging.rollout_every cannot act: logging.rollout_groups=0 records no rollouts")
    elif without_table:
        logger.warning("logging.rollout_every: %s %s no table through accelerate; the rollout records stay in "
                       "rollouts/ (dapo-train show)", ", ".join(without_table),
                       "has" if len(without_table) == 1 else "have")


def start_trackers(accelerator, cfg, resume_step: int | None = None) -> AccelerateTrackers | NullTracker:
    return AccelerateTrackers(accelerator, cfg, resume_step) if cfg.logging.trackers else NullTracker()
