"""The policy's optimizer: AdamW over the trainable weights, the learning-rate schedule, and the
optimizer-step counter that is the schedule's clock.

One optimizer step per mini-batch (passes.py); a step (one rollout batch, train.max_steps) makes
train.updates_per_step x dapo.num_iterations of them. The LR is a pure function of the optimizer
step, so resuming needs only the counter (saved in trainer_state.pt) and the AdamW state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dapo_train.config.schema import Config


def _constant(progress: float) -> float:
    return 1.0


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# Name -> LR factor of the post-warmup progress in [0, 1]; config train.lr_scheduler's choices.
LR_SCHEDULES = {"constant": _constant, "cosine": _cosine}


def total_optimizer_steps(cfg: Config) -> int:
    """The LR schedule's horizon: optimizer steps of a run whose every rollout batch is full."""
    return cfg.train.max_steps * cfg.train.updates_per_step * cfg.dapo.num_iterations


def learning_rate(cfg: Config, step: int) -> float:
    """LR for OPTIMIZER step `step` (0-based, counting every update of every rollout batch): linear
    warmup over train.warmup_steps, then constant or cosine to 0 at total_optimizer_steps."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.learning_rate * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, total_optimizer_steps(cfg) - t.warmup_steps)
    return t.learning_rate * LR_SCHEDULES[t.lr_scheduler](progress)


def warmup_note(cfg: Config) -> str | None:
    """What to say at start when the warmup outlasts the run: its LR never reaches train.learning_rate (1000
    warmup steps over 8 optimizer steps train at 8e-7 of 1e-4); None when it does."""
    t, total = cfg.train, total_optimizer_steps(cfg)
    if t.warmup_steps <= total:
        return None
    return (f"train.warmup_steps={t.warmup_steps} is longer than the run's {total} optimizer steps (train.max_steps="
            f"{t.max_steps} x train.updates_per_step={t.updates_per_step} x dapo.num_iterations="
            f"{cfg.dapo.num_iterations}): the learning rate rises from {learning_rate(cfg, 0):.3g} to "
            f"{learning_rate(cfg, total - 1):.3g} and never reaches train.learning_rate={t.learning_rate:g}; set "
            f"train.warmup_steps to at most {total}")


def adamw(cfg: Config, parameters: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """AdamW over `parameters` (every weight, or the LoRA adapters alone) with train.* settings."""
    t = cfg.train
    return torch.optim.AdamW(parameters, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                             weight_decay=t.weight_decay)


@dataclass(frozen=True)
class OptimizerStep:
    """What one optimizer step did: the gradient norm before clipping, the LR, whether it was applied,
    and whether fp16's loss scaler skipped it (its scaled gradients overflowed; it lowered its scale)."""

    grad_norm: float
    lr: float
    applied: bool
    scaler_skipped: bool = False


class PolicyOptimizer:
    """The optimizer (as accelerate prepared it), the schedule, and `steps`, the optimizer steps taken
    in the run so far."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config, steps: int = 0) -> None:
        self.optimizer, self.cfg, self.steps = optimizer, cfg, steps
        self.max_grad_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf

    def state_dict(self) -> dict:
        """The AdamW state (the counter is saved beside it, in trainer_state.pt)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def lr(self) -> float:
        """The LR of the next optimizer step."""
        return learning_rate(self.cfg, self.steps)

    def step(self, model: torch.nn.Module, accelerator, loss: float) -> OptimizerStep:
        """Apply the gradients accumulated in .grad: clip their norm (train.max_grad_norm), then one
        AdamW step at this step's LR. The gradients are cleared either way.

        Under fp16 (accelerate's GradScaler) an overflowing gradient is the scaler's to handle, as in HF
        Trainer: the step goes through the wrapped optimizer, whose scaler skips it and lowers its scale
        (its update(), which also allows the next unscale); normal in the first steps. A non-finite loss,
        or a non-finite gradient norm without a scaler, is not applied (the caller ends the step)."""
        lr = self.lr
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm))
        scaler = getattr(self.optimizer, "scaler", None)
        if not math.isfinite(loss) or (scaler is None and not math.isfinite(grad_norm)):
            if scaler is not None:
                scaler.update()  # clip_grad_norm_ unscaled: end the scaler's iteration (an overflow lowers the scale)
            self.optimizer.zero_grad(set_to_none=True)
            return OptimizerStep(grad_norm, lr, applied=False)
        self.optimizer.step()
        skipped = scaler is not None and self.optimizer.step_was_skipped
        self.steps += not skipped
        self.optimizer.zero_grad(set_to_none=True)
        return OptimizerStep(grad_norm, lr, applied=not skipped, scaler_skipped=skipped)
