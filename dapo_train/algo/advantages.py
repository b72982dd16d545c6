"""Rewards to advantages, as pure functions: the soft overlong punishment (Eq. 13), group-relative
advantages (Eq. 9) and the informative-group test of dynamic sampling (Eq. 11).

Shapes: B groups (prompts), G completions per group. A group with equal rewards gets advantage
exactly 0 (Eq. 9 would give 0/eps ~ rounding noise).
"""


from collections.abc import Callable, Sequence

import torch

Tensor = torch.Tensor
Number = int | float


# ---------------------------------------------------------------- rewards and groups (Eq. 9, 11, 13)


def overlong_penalty(lengths: int | Tensor, max_length: int, cache_length: int) -> float | Tensor:
    """Soft overlong punishment, Eq. 13: a length-aware reward added to the rule reward.

    0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the buffer, falling
    linearly to -1 at |y| = L_max; -1 beyond L_max. The three pieces meet, so this is the linear
    ramp clamped to [-1, 0].

    lengths: an int, or an integer tensor of any shape (e.g. (N,)). Returns a float, or a float32
    tensor of the same shape. Raises ValueError unless 0 < cache_length <= max_length.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong_penalty: need 0 < cache_length <= max_length, got {cache_length} and {max_length}")
    threshold = max_length - cache_length
    if isinstance(lengths, Tensor):
        ramp = (threshold - lengths.to(torch.float32)) / cache_length
        return ramp.clamp(min=-1.0, max=0.0)
    return min(0.0, max(-1.0, (threshold - lengths) / cache_length))


def _population_std(rewards: Tensor) -> Tensor:
    return rewards.std(dim=-1, correction=0, keepdim=True)


def _sample_std(rewards: Tensor) -> Tensor:
    # Bessel-corrected; a group of one has no spread (torch would give NaN), so call it 0.
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards[..., :1])
    return rewards.std(dim=-1, correction=1, keepdim=True)


# Name -> denominator of Eq. 9 given (..., G) rewards and eps. Names match config dapo.advantage_std.
ADVANTAGE_STDS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "population": lambda rewards, eps: _population_std(rewards) + eps,
    "sample": lambda rewards, eps: _sample_std(rewards) + eps,
    "none": lambda rewards, eps: torch.ones_like(rewards[..., :1]),
}


def group_advantages(rewards: Tensor, eps: float = 1e-6, std: str = "population") -> Tensor:
    """Group-relative advantage, Eq. 9: A_i = (R_i - mean(R)) / (std(R) + eps) within each group.

    rewards: (B, G) or (G,), any numeric dtype. Returns a floating tensor of the same shape (float32
    for integer or bool input). One scalar per completion; the trainer broadcasts it over tokens.
    std: "population" (divide by G), "sample" (Bessel, G - 1) or "none" (mean-centred only, no
    division). A group whose rewards are all equal gets exactly 0, never NaN.
    """
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"group_advantages: unknown std {std!r}; allowed: {', '.join(ADVANTAGE_STDS)}")
    if rewards.dim() not in (1, 2):
        raise ValueError(f"group_advantages: rewards must be (B, G) or (G,), got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # (..., G)
    advantages = centred / ADVANTAGE_STDS[std](rewards, eps)  # (..., G)
    flat = torch.logical_not(informative_groups(rewards.reshape(-1, rewards.shape[-1])))  # (B,)
    return torch.where(flat.reshape(*rewards.shape[:-1], 1), torch.zeros_like(advantages), advantages)


def informative_groups(values: Tensor | Sequence[Sequence[Number]]) -> Tensor:
    """Dynamic-sampling filter, Eq. 11, for a batch of groups.

    values: (B, G) correctness bits (bool) or rewards (float), tensor or nested list. Returns (B,)
    bool: True where the group's values are not all equal, i.e. 0 < #correct < G for bits. Such a
    group has a non-zero advantage somewhere; the others give no gradient and are dropped.
    """
    values = torch.as_tensor(values)
    if values.dim() != 2:
        raise ValueError(f"informative_groups: values must be (B, G), got shape {tuple(values.shape)}")
    return (values != values[:, :1]).any(dim=-1)


def is_informative_group(values: Tensor | Sequence[Number]) -> bool:
    """Dynamic-sampling filter, Eq. 11, for one group: True iff its (G,) values are not all equal.

    values: (G,) bools or floats, tensor or list. For correctness bits this is 0 < #correct < G.
    An empty group is not informative. For (B, G) use informative_groups.
    """
    values = torch.as_tensor(values)
    if values.dim() != 1:
        raise ValueError(f"is_informative_group: values must be (G,), got shape {tuple(values.shape)}; "
                         "use informative_groups for (B, G)")
    return bool(informative_groups(values[None]).item()) if values.numel() else False
