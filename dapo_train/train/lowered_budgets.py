"""The memory budgets an out-of-memory error lowered: what a checkpoint records and a resume applies, and only those.

Three budgets bound a run's memory: train.micro_batch_tokens (the update's micro-batch tokens; auto is resolved
on the card, update/card.py), train.micro_batch_size (without a token budget, its completions) and
rollout.generation_batch_size (an hf engine's rows per generate call). An out-of-memory error lowers the one in
force for the rest of the session (update/out_of_memory.py, rollout/fitting.py): below what the session set up
with (`SessionBudgets`), which is how it is told from a budget set small. A checkpoint records each lowered one
with the value it replaced and the setting that value came from (`LoweredBudget`). A resume applies it when the
key is set as it was then and this session's budget is no larger than the one that ran out: a value set for the
resume (KEY=VALUE, an edited config) stands, and so does auto's choice on a card with more free memory than the
one that ran out. Each is said in one line.

config.yaml holds the settings as given (a sweep, compare and a resume's report of changes read settings, not
state); where an out-of-memory error lowered a budget, a comment at the top of the run folder's config.yaml names
the budget the run trains at, from the session's start or its first checkpoint after the error.

A checkpoint from before this record ("budgets": every budget in force, lowered or set alike) cannot tell them
apart: a resume from it keeps any smaller one unless the key is set otherwise than then (never raising a budget
from such a checkpoint is the safe reading), and says it cannot tell.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dapo_train.config.load import dump_config
from dapo_train.config.schema import Config
from dapo_train.run.checkpoint import SAVED_CONFIG_KEY

logger = logging.getLogger(__name__)

TOKENS, COUNT, ROWS = "train.micro_batch_tokens", "train.micro_batch_size", "rollout.generation_batch_size"
LOWERED_KEY = "lowered_budgets"  # trainer_state.pt's record: [LoweredBudget as a dict, ...]
OLD_KEY = "budgets"  # before it: {"micro_batch_tokens", "micro_batch_size", "generation_batch_size"} in force


@dataclass(frozen=True)
class LoweredBudget:
    """A budget an out-of-memory error lowered: `key` at `value`, in place of `replaced` (the session's own, auto
    resolved), which came from the config's `setting` (a number, or "auto"). None: not known (an older
    checkpoint's)."""

    key: str
    value: int
    replaced: int | None = None
    setting: int | str | None = None


def in_force(batching, engine) -> dict[str, int]:
    """The budgets a session trains at now: the update's (tokens, or without a token budget the count) and an hf
    engine's rows per generate call."""
    found = {TOKENS: batching.max_tokens} if batching.max_tokens > 0 else {COUNT: batching.max_count}
    rows = getattr(engine, "generation_rows", None)
    return found if rows is None else {**found, ROWS: rows.limit}


def setting(values: Config | dict, key: str):
    """The config's value of a budget's dotted key (a Config, or a saved config as nested dicts)."""
    section, name = key.split(".")
    if isinstance(values, dict):
        return (values.get(section) or {}).get(name)
    return getattr(getattr(values, section), name)


@dataclass
class SessionBudgets:
    """The budgets this session set up with (auto resolved), before any out-of-memory error; and the comment
    last written at the top of the run folder's config.yaml."""

    set_up: dict[str, int] = field(default_factory=dict)
    noted: str | None = None

    def lowered(self, cfg: Config, batching, engine) -> list[LoweredBudget]:
        """The budgets in force below what the session set up with: lowered out of memory (a resume's carried
        ones included: they are below it too)."""
        return [LoweredBudget(key, value, self.set_up[key], setting(cfg, key))
                for key, value in in_force(batching, engine).items() if value < self.set_up.get(key, value)]

    def state(self, cfg: Config, batching, engine) -> list[dict]:
        """trainer_state.pt's LOWERED_KEY."""
        return [asdict(budget) for budget in self.lowered(cfg, batching, engine)]

    def comment(self, cfg: Config, batching, engine) -> str:
        """config.yaml's comment: one line for each budget lowered out of memory ('' for none)."""
        return "".join(f"# {b.key}: this run uses {b.value}, not the {b.replaced} "
                       f"{'auto chose' if b.setting == 'auto' else 'set here'}: an out-of-memory error lowered it "
                       f"({LOWERED_KEY} in the checkpoints' trainer_state.pt; a resume keeps it unless this key is set "
                       "otherwise)\n" for b in self.lowered(cfg, batching, engine))

    def save_config(self, cfg: Config, batching, engine, path: Path) -> None:
        """The run folder's config.yaml: the settings, below the comment naming each budget lowered out of memory."""
        comment = self.comment(cfg, batching, engine)
        path.write_text(comment + dump_config(cfg), encoding="utf-8")
        self.noted = comment

    def note(self, cfg: Config, batching, engine, path: Path) -> None:
        """After a checkpoint: config.yaml rewritten when a budget was lowered out of memory since it was written.
        A write the disk refuses costs the comment only (the checkpoint records the budget): one line says so."""
        if self.comment(cfg, batching, engine) == (self.noted or ""):
            return
        try:
            self.save_config(cfg, batching, engine, path)
        except OSError as exc:
            logger.warning("%s: not rewritten to name a budget lowered out of memory (%s); the checkpoint records it",
                           path, exc.strerror or exc)


def saved_lowered(state: dict) -> tuple[list[LoweredBudget], bool]:
    """The lowered budgets a checkpoint's trainer state records, and whether it is an older checkpoint's record
    of every budget in force (module docstring), read as lowered ones of unknown origin."""
    if LOWERED_KEY in state:
        return [LoweredBudget(**entry) for entry in state[LOWERED_KEY]], False
    old = state.get(OLD_KEY)
    if not old:
        return [], False
    saved = state.get(SAVED_CONFIG_KEY)
    values = {TOKENS: old["micro_batch_tokens"]} if old["micro_batch_tokens"] > 0 else \
        {COUNT: old["micro_batch_size"]}
    if old.get("generation_batch_size") is not None:
        values[ROWS] = old["generation_batch_size"]
    return [LoweredBudget(key, value, None, setting(saved, key) if isinstance(saved, dict) else None)
            for key, value in values.items()], True


def keep_lowered(state: dict, cfg: Config, learner, engine, checkpoint: str) -> None:
    """A resume from `state` (trainer_state.pt of `checkpoint`, its folder's name) at each budget its run lowered
    out of memory, where the module docstring's rule keeps it; one line for each kept or not kept."""
    budgets, older = saved_lowered(state)
    for budget in budgets:
        now = in_force(learner.batching, engine)
        if budget.key not in now or budget.value >= now[budget.key]:
            continue  # a budget of the other kind in force (a token budget set or turned off), or one no larger
        current, own = now[budget.key], setting(cfg, budget.key)
        if budget.setting is not None and own != budget.setting:
            logger.info("%s=%s, as set for this session: the %d %s ran at is not kept", budget.key, own,
                        budget.value, checkpoint)
        elif budget.replaced is not None and current > budget.replaced:
            logger.info("%s=%s: %d on this card, more than the %d that ran out of memory before %s (a card with more "
                        "free memory): the %d it was lowered to is not kept", budget.key, own, current,
                        budget.replaced, checkpoint, budget.value)
        else:
            _apply(budget, learner, engine)
            logger.info("%s=%d, %s (this session's is %d%s)", budget.key, budget.value, _why(budget, older, checkpoint),
                        current, "" if budget.setting is None else f"; set {budget.key} for the resume to replace it")


def _why(budget: LoweredBudget, older: bool, checkpoint: str) -> str:
    if older:
        return (f"as {checkpoint} ran at it: a checkpoint from before budgets lowered out of memory were told from "
                "those set, so a smaller budget from it is kept, never raised")
    return f"as the checkpoint's run lowered it out of memory from {budget.replaced}"


def _apply(budget: LoweredBudget, learner, engine) -> None:
    if budget.key == TOKENS:
        learner.batching = replace(learner.batching, max_tokens=budget.value)
    elif budget.key == COUNT:
        learner.batching = replace(learner.batching, max_count=budget.value)
    else:
        engine.generation_rows.limit = budget.value
