"""Group-relative advantages: an estimator registered by name (`algorithm.advantage_estimator`),
and how several reward functions are combined (`algorithm.reward_aggregation`).

    grpo  A_i = (r_i - mean_group(r)) / (std + eps)           (Shao et al. 2024, eq. 3)
    rloo  A_i = r_i - mean_{j != i in the group}(r_j)          (Ahmadian et al. 2024; = G/(G-1) (r_i - mean))

The G completions of one prompt are contiguous in the reward vector: rewards[i*G:(i+1)*G] is the
group of prompt i. Everything here is a pure tensor function.
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / (std + eps).

    `scale="group"`: std is the unbiased std of the completion's own group (the GRPO paper);
    `scale="batch"`: std is the unbiased std of the whole batch (more robust when a group is
    nearly constant; Dr. GRPO / TRL's `scale_rewards="batch"`); `scale="none"`: no division.
    The mean is always the group mean, so the advantages of every group sum to zero and a group of
    identical rewards gets advantage exactly 0.

    A NaN reward means "no reward function applied" (every function returned None): that completion
    takes no part in its group's statistics and gets advantage 0, and so does every member of a
    group with fewer than two scored completions (nothing to compare with).

    rewards: (N,) with N = num_prompts * group_size. Returns (N,) in the dtype of `rewards`.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (one completion has no group), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must have shape (num_prompts * group_size,), got {tuple(rewards.shape)} "
            f"with group_size={group_size}"
        )
    grouped = rewards.view(-1, group_size)  # (P, G)
    scored = ~torch.isnan(grouped)  # (P, G)
    count = scored.sum(dim=1, keepdim=True)  # (P, 1)
    values = torch.where(scored, grouped, torch.zeros_like(grouped))  # (P, G)
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)  # (P, 1)
    centered = torch.where(scored, values - mean, torch.zeros_like(values))  # (P, G)
    if scale == "group":
        std = (centered.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (P, 1)
        centered = centered / (std + eps)
    elif scale == "batch":
        valid = rewards[~torch.isnan(rewards)]
        centered = centered / ((valid.std() if valid.numel() > 1 else 0.0) + eps)
    # A float mean of identical values can differ from them in the last bit; such a group carries
    # no signal, and its advantages are exactly 0 (the trainer relies on it to skip them).
    first = values.gather(1, scored.long().argmax(dim=1, keepdim=True))  # (P, 1) a scored value
    constant = ((values == first) | ~scored).all(dim=1, keepdim=True) | (count < 2)  # (P, 1)
    return centered.masked_fill(constant, 0.0).reshape(-1)  # (N,)


def rloo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none", eps: float = 1e-4) -> torch.Tensor:
    """A_i = r_i - mean of the other scored members of its group, then scaled as group_advantages
    does. Over the scored members it is count/(count - 1) times grpo's unscaled advantage, so it
    keeps grpo's properties: a group sums to zero, and an equal-reward group, an unscored completion
    and a group with fewer than two scored members get exactly 0.

    rewards: (N,) with N = num_prompts * group_size. Returns (N,)."""
    centered = group_advantages(rewards, group_size, scale, eps)  # (N,) r - mean, scaled
    count = (~torch.isnan(rewards.view(-1, group_size))).sum(dim=1, keepdim=True).to(rewards.dtype)  # (P, 1)
    factor = count / (count - 1).clamp(min=1)  # (P, 1)
    return (centered.view(-1, group_size) * factor).reshape(-1)  # (N,)


ESTIMATORS = {"grpo": group_advantages, "rloo": rloo_advantages}
# The advantage scaling an estimator has when algorithm.scale_rewards is null.
DEFAULT_SCALE = {"grpo": "group", "rloo": "none"}


def normalized_sum(per_function: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """normalize_then_sum (TRL's multi_objective_aggregation, GDPO): each function's rewards
    normalized within their group, (r_k - mean_group) / (std_group + eps), the weighted sum of those
    divided by its batch std. A function's None (NaN) adds nothing to its completion's sum; a
    completion no function scored gets 0, and a group whose sums are all equal gets exactly 0.

    TRL also subtracts the batch mean of the sums; it is zero (every group's sums add up to zero)
    but for rounding, which would give the equal-sum groups a tiny advantage.

    per_function: (N, K) each function's rewards, NaN where it returned None; weights: (K,). Returns (N,)."""
    N, K = per_function.shape
    normalized = torch.stack([group_advantages(per_function[:, k], group_size, "group", eps) for k in range(K)], 1)  # (N, K)
    scored = ~torch.isnan(per_function)  # (N, K)
    total = (normalized * weights * scored).sum(1)  # (N,)
    anything = scored.any(1)  # (N,)
    valid = total[anything]
    total = total / ((valid.std() if valid.numel() > 1 else 0.0) + eps)
    values, members = torch.where(anything, total, 0.0).view(-1, group_size), anything.view(-1, group_size)  # (P, G)
    first = values.gather(1, members.long().argmax(dim=1, keepdim=True))  # (P, 1) a scored member's
    constant = ((values == first) | ~members).all(dim=1, keepdim=True) | (members.sum(1, keepdim=True) < 2)  # (P, 1)
    return values.masked_fill(constant, 0.0).reshape(-1)


def advantages(rewards: torch.Tensor, per_function: torch.Tensor, weights: torch.Tensor, group_size: int,
               estimator: str = "grpo", scale: str | None = None, aggregation: str = "sum_then_normalize") -> torch.Tensor:
    """The step's advantages (N,): `rewards` (N,) (the weighted sum, NaN where no function applied)
    through the `estimator`, or with normalize_then_sum the per-function rewards (N, K) combined by
    `normalized_sum`. `scale` None: the estimator's own (DEFAULT_SCALE)."""
    if aggregation == "normalize_then_sum":
        return normalized_sum(per_function, weights, group_size)
    return ESTIMATORS[estimator](rewards, group_size, DEFAULT_SCALE[estimator] if scale is None else scale)
