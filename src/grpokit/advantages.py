"""Group-relative advantages (GRPO, Shao et al. 2024, eq. 3).

The G completions of one prompt are contiguous in the reward vector: rewards[i*G:(i+1)*G] is the
group of prompt i. Everything here is a pure tensor function.
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")


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
