"""The policy's optimizer: AdamW over the trainable weights, the learning-rate schedule, and the
optimizer-step counter that is the schedule's clock.

One optimizer step per mini-batch (passes.py); a step (one rollout batch, train.max_steps) makes
train.updates_per_step x dapo.num_iterations of them. The LR is a pure function of the optimizer
step, so resuming needs only the counter (saved in trainer_state.pt) and the AdamW state.

An optimizer step must not be where a run runs out of memory (update/out_of_memory.py): torch's AdamW makes its
state on its first step (8 bytes per trained weight, 12 GB for Qwen2.5-1.5B), and its foreach step changes the
weights and moments in place before it allocates a temporary the size of the moments, so an out-of-memory error
there would leave them half stepped. So the state is made before the first step (allocate_state: zeros, as torch
makes them), and on one CUDA card the step is torch's fused kernel, which allocates nothing: once the state exists
a step needs no memory that the backward before it did not hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dapo_train.config.schema import Config
from dapo_train.faults import OPTIMIZER_STEP, out_of_memory_at


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


def adamw(cfg: Config, parameters: list[torch.nn.Parameter], fused: bool = False) -> torch.optim.AdamW:
    """AdamW over `parameters` (every weight, or the LoRA adapters alone) with train.* settings. fused: torch's
    fused kernel (CUDA, one process: the module docstring), else its default (foreach)."""
    t = cfg.train
    return torch.optim.AdamW(parameters, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                             weight_decay=t.weight_decay, **({"fused": True} if fused else {}))


def allocate_state(optimizer: torch.optim.Optimizer) -> int:
    """Make AdamW's state for every parameter now, exactly as its first step would (zero moments, step 0): one
    step at learning rate 0 on zero gradients leaves every weight and moment as it was, then the step counts go
    back to 0. -> the bytes the state holds. Parameters that already have a state (a resume) keep it."""
    params = [p for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    if not params:
        return _state_bytes(optimizer)
    saved = [(group, group["lr"]) for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group, _ in saved:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in saved:
        group["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
        optimizer.state[p]["step"].zero_()
    return _state_bytes(optimizer)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


class OptimizerOutOfMemory(Exception):
    """torch.OutOfMemoryError in an optimizer step. intact: it came before the step changed a weight or AdamW's
    state (in clipping the gradients); else from inside the optimizer's own step, which may have changed some."""

    def __init__(self, intact: bool) -> None:
        super().__init__("out of memory in an optimizer step")
        self.intact = intact


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
        try:
            out_of_memory_at(OPTIMIZER_STEP, self.steps)  # a test's fault (faults.py); nothing otherwise
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm))
        except torch.OutOfMemoryError as exc:
            raise OptimizerOutOfMemory(intact=True) from exc
        scaler = getattr(self.optimizer, "scaler", None)
        if not math.isfinite(loss) or (scaler is None and not math.isfinite(grad_norm)):
            if scaler is not None:
                scaler.update()  # clip_grad_norm_ unscaled: end the scaler's iteration (an overflow lowers the scale)
            self.optimizer.zero_grad(set_to_none=True)
            return OptimizerStep(grad_norm, lr, applied=False)
        try:
            self.optimizer.step()
        except torch.OutOfMemoryError as exc:
            raise OptimizerOutOfMemory(intact=False) from exc
        skipped = scaler is not None and self.optimizer.step_was_skipped
        self.steps += not skipped
        self.optimizer.zero_grad(set_to_none=True)
        return OptimizerStep(grad_norm, lr, applied=not skipped, scaler_skipped=skipped)
