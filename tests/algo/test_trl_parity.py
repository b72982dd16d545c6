"""Parity with TRL 1.16's own loss code on random tensors: GRPOTrainer._compute_loss, run on a trainer
object that has its config's settings but no model (the per-token log-probs it would compute are
handed to it), against dapo_train's policy_loss for the same objective and reduction.

    TRL loss_type (+ importance_sampling_level)  dapo_train objective + reduction
    dapo                                         clip + token
    grpo                                         clip + sample
    dr_grpo                                      clip + constant (max_tokens = max_completion_length)
    cispo (epsilon_high = the weight's cap)      cispo + token (eps_high = cap - 1, eps_low = 1: no floor)
    grpo, sequence (the GSPO paper's setup)      gspo + sample
    dapo, sequence                               gspo + token

The loss and its gradient on every log-prob must agree, and so must the clip fractions where both
count the same thing (TRL counts GSPO's per sequence and CISPO's for A > 0 only; dapo_train counts
tokens, and CISPO's whatever the sign: equal-length rows and positive advantages make them one).
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from dapo_train.algo import loss_normalizer, policy_loss

# TRL's arguments -> dapo_train's (objective, reduction, eps_low, eps_high).
CASES = {
    "dapo": ({"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}, ("clip", "token", 0.2, 0.28)),
    "grpo": ({"loss_type": "grpo", "epsilon": 0.2}, ("clip", "sample", 0.2, 0.2)),
    "dr_grpo": ({"loss_type": "dr_grpo", "epsilon": 0.2}, ("clip", "constant", 0.2, 0.2)),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, ("cispo", "token", 1.0, 0.3)),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05, "epsilon_high": 0.08},
             ("gspo", "sample", 0.05, 0.08)),
    "gspo, token sum": ({"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon": 0.05,
                         "epsilon_high": 0.08}, ("gspo", "token", 0.05, 0.08)),
}


def trl_trainer(tmp_path, max_completion_length: int, **arguments) -> GRPOTrainer:
    """A GRPOTrainer holding what _compute_loss reads, set from a real GRPOConfig as its __init__ sets
    it, with one process, no accumulation, no vLLM, no entropy bonus and no model."""
    args = GRPOConfig(output_dir=str(tmp_path), max_completion_length=max_completion_length, report_to=[],
                      use_cpu=True, bf16=False, **arguments)
    trainer = object.__new__(GRPOTrainer)
    trainer.args = args
    trainer.loss_type, trainer.beta = args.loss_type, args.beta
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.max_completion_length = args.max_completion_length
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
    trainer.aux_loss_enabled = trainer._entropy_bonus_enabled = False
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x)
    return trainer


def trl_loss(trainer: GRPOTrainer, logprobs, old_logprobs, advantages, mask):
    """TRL's loss, its gradient on the log-probs, and its logged metrics."""
    logprobs = logprobs.detach().clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None)
    n, t = logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": advantages, "old_per_token_logps": old_logprobs, "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), logprobs.grad, {key: values[-1] for key, values in trainer._metrics["train"].items()}


def ours(logprobs, old_logprobs, advantages, mask, objective, reduction, eps_low, eps_high):
    logprobs = logprobs.detach().clone().requires_grad_(True)
    normalizer = loss_normalizer([mask], reduction, max_tokens=mask.shape[1])
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, objective=objective,
                                reduction=reduction, normalizer=normalizer)
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def random_batch(seed: int, n: int = 12, t: int = 10, equal_lengths: bool = False, positive: bool = False):
    """Ratios spread around 1 (many clipped at these bounds), ragged masks with at least one valid
    token per row (TRL's dr_grpo counts every row; dapo_train counts rows in the loss)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    new = old + 0.3 * torch.randn(n, t, generator=g)
    lengths = torch.full((n,), t) if equal_lengths else torch.randint(1, t + 1, (n,), generator=g)
    advantages = torch.randn(n, generator=g)
    return new, old, advantages.abs() if positive else advantages, torch.arange(t)[None, :] < lengths[:, None]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_equal_trls(case, seed, tmp_path):
    arguments, (objective, reduction, eps_low, eps_high) = CASES[case]
    new, old, advantages, mask = random_batch(seed)
    trainer = trl_trainer(tmp_path, mask.shape[1], **arguments)
    trl_value, trl_grad, _ = trl_loss(trainer, new, old, advantages, mask)
    value, grad, metrics = ours(new, old, advantages, mask, objective, reduction, eps_low, eps_high)
    assert 0.0 < metrics["clip_frac"] < 1.0  # the bounds act on this batch
    assert value.item() == pytest.approx(trl_value.item(), rel=1e-6, abs=1e-8)
    torch.testing.assert_close(grad, trl_grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", ["dapo", "gspo"])
def test_clip_fractions_equal_trls(case, tmp_path):
    """Equal lengths: a sequence's share of tokens is its share of sequences, so GSPO's token count
    equals TRL's per-sequence count."""
    arguments, (objective, reduction, eps_low, eps_high) = CASES[case]
    new, old, advantages, mask = random_batch(seed=2, n=32, equal_lengths=True)
    _, _, trl_metrics = trl_loss(trl_trainer(tmp_path, mask.shape[1], **arguments), new, old, advantages, mask)
    _, _, metrics = ours(new, old, advantages, mask, objective, reduction, eps_low, eps_high)
    assert metrics["clip_frac_high"] > 0 and metrics["clip_frac_low"] > 0
    assert metrics["clip_frac_high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"], abs=1e-7)
    assert metrics["clip_frac_low"] == pytest.approx(trl_metrics["clip_ratio/low_mean"], abs=1e-7)


def test_cispo_clip_fraction_equals_trls_for_positive_advantages(tmp_path):
    arguments, (objective, reduction, eps_low, eps_high) = CASES["cispo"]
    new, old, advantages, mask = random_batch(seed=4, positive=True)
    _, _, trl_metrics = trl_loss(trl_trainer(tmp_path, mask.shape[1], **arguments), new, old, advantages, mask)
    _, _, metrics = ours(new, old, advantages, mask, objective, reduction, eps_low, eps_high)
    assert metrics["clip_frac_high"] > 0
    assert metrics["clip_frac_high"] == pytest.approx(trl_metrics["cispo_clip_ratio"], abs=1e-7)
