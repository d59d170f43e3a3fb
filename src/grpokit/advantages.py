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
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)
    # A float mean of identical values can differ from them in the last bit; such a group carries
    # no signal, and its advantages are exactly 0 (the trainer relies on it to skip them).
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return centered.masked_fill(constant, 0.0).reshape(-1)  # (N,)
