"""The algorithm's maths (DAPO, arXiv 2503.14476), pure: tensors and numbers in, tensors out. No model,
tokenizer, config object or I/O, so every equation is testable on a CPU with hand-made tensors; the
folder imports torch and the registry decorator only.

advantages.py  rewards -> advantages (Eq. 9), informative groups (Eq. 11), overlong punishment (Eq. 13)
objectives.py  the policy objectives by name (clip = Eq. 10, gspo, cispo) and `policy_loss`
reductions.py  per-token losses -> one loss (Eq. 12 and its variants), with their normalisers
correction.py  behaviour policy vs training forward: the measured gap and its IS corrections

Plugin authors import from here: `from dapo_train.algo import register_policy_loss, policy_loss`.
"""

from dapo_train.algo.advantages import group_advantages, informative_groups, is_informative_group, overlong_penalty
from dapo_train.algo.correction import (
    ROLLOUT_CORRECTIONS,
    RolloutCorrection,
    register_rollout_correction,
    rollout_mismatch,
)
from dapo_train.algo.objectives import POLICY_LOSSES, LossSettings, policy_loss, register_policy_loss
from dapo_train.algo.reductions import LOSS_REDUCTIONS, loss_normalizer, register_loss_reduction

__all__ = [
    "LOSS_REDUCTIONS", "POLICY_LOSSES", "ROLLOUT_CORRECTIONS", "LossSettings", "RolloutCorrection", "group_advantages",
    "informative_groups", "is_informative_group", "loss_normalizer", "overlong_penalty", "policy_loss",
    "register_loss_reduction", "register_policy_loss", "register_rollout_correction", "rollout_mismatch",
]
