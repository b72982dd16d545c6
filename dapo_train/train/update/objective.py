"""The config's policy objective: dapo.policy_loss resolved to a registered objective (a plugin named
by import path is registered on first use), the dapo.* keys each built-in objective reads, and the
LossSettings value the loss takes. Read by `run` and `config` before anything loads, so a bad name is
one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dapo_train.algo.objectives import POLICY_LOSSES, LossSettings, register_policy_loss
from dapo_train.config.schema import Config, DapoConfig
from dapo_train.errors import ConfigError
from dapo_train.plugins import import_plugin

if TYPE_CHECKING:
    pass



# The dapo.* keys each built-in objective reads, its clip bounds (LossSettings.eps_low, eps_high)
# first. Any other objective (a plugin) gets dapo.eps_low / dapo.eps_high and may read every field.
OBJECTIVE_KEYS = {
    "clip": ("eps_low", "eps_high", "clip_ratio_c"),
    "gspo": ("gspo_eps_low", "gspo_eps_high"),
    "cispo": ("cispo_eps_low", "cispo_eps_high"),
}


def clip_bound_keys(objective: str) -> tuple[str, str]:
    """The dapo.* keys holding `objective`'s clip bounds (low, high)."""
    low, high, *_ = OBJECTIVE_KEYS.get(objective, OBJECTIVE_KEYS["clip"])
    return low, high


def inert_objective_keys(cfg: Config) -> list[str]:
    """The keys of other built-in objectives that the config moves from their defaults: with a built-in
    dapo.policy_loss they cannot act (a plugin may read any of them, so none is inert under one)."""
    d, defaults = cfg.dapo, DapoConfig()
    if d.policy_loss not in OBJECTIVE_KEYS:
        return []
    used = OBJECTIVE_KEYS[d.policy_loss]
    others = dict.fromkeys(key for keys in OBJECTIVE_KEYS.values() for key in keys if key not in used)
    return [f"dapo.{key}" for key in others if getattr(d, key) != getattr(defaults, key)]


def loss_settings(cfg: Config) -> LossSettings:
    """The config's dapo.* loss options as the one value the loss takes, with the chosen objective's own
    clip bounds (OBJECTIVE_KEYS). dapo.policy_loss is a registered objective or 'pkg.module:function'
    (imported and registered under that name); anything else is a ConfigError."""
    d = cfg.dapo
    if ":" in d.policy_loss and d.policy_loss not in POLICY_LOSSES:
        register_policy_loss(d.policy_loss)(import_plugin(d.policy_loss, "dapo.policy_loss"))
    if d.policy_loss not in POLICY_LOSSES:
        raise ConfigError("dapo.policy_loss", f"unknown objective {d.policy_loss!r}; registered: "
                          f"{', '.join(POLICY_LOSSES)}, or 'pkg.module:function'")
    low, high = clip_bound_keys(d.policy_loss)
    return LossSettings(
        objective=d.policy_loss, eps_low=getattr(d, low), eps_high=getattr(d, high), reduction=d.loss_reduction,
        clip_ratio_c=d.clip_ratio_c, beta=d.beta,
    )
