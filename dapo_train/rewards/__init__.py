"""Rewards: a completion and its gold answer in, a float out, chosen by name from one registry.

scoring.py    the registry (`register`), a config's rewards bound to their args, scoring completions
rules.py      the built-in rule rewards (accuracy, format, overlong = Eq. 13); they import no model code
model.py      the reward model (`reward_model`): a sequence classifier's score, its weights loaded once per run
catalogue.py  the registered rewards as a user reads them (`dapo-train config --keys rewards`)

Plugin authors import from here: `from dapo_train.rewards import register, extract_answer, is_correct`.
"""

from dapo_train.rewards import model, rules  # noqa: F401  (fill REWARDS with the built-in rewards)
from dapo_train.rewards.scoring import (
    FILLED_ARGS,
    REWARDS,
    BoundReward,
    RewardError,
    RewardSet,
    Scores,
    build_rewards,
    register,
    rewards_from_config,
    score,
)
from dapo_train.task.answers import extract_answer, is_correct

__all__ = [
    "FILLED_ARGS", "REWARDS", "BoundReward", "RewardError", "RewardSet", "Scores", "build_rewards", "extract_answer",
    "is_correct", "register", "rewards_from_config", "score",
]
