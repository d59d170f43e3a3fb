"""The learning-rate schedule: a linear warm-up, then constant, linear or cosine decay to 0.

As a multiplier of train.learning_rate for optimizer update u (counted from 0), W warm-up updates
and U updates in all:

    u < W      (u + 1) / W
    constant   1
    linear     (U - u) / (U - W)                          1 at the first update after the warm-up, 1/(U-W) at the last
    cosine     (1 + cos(pi (u - W) / (U - W))) / 2          half a cosine between the same end points

(transformers' get_linear_schedule_with_warmup and get_cosine_schedule_with_warmup after the
warm-up; their warm-up starts at 0, grpokit's at 1/W, so that no update is wasted.)
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(kind: str, update: int, warmup: int, total: int) -> float:
    """The multiplier of the peak learning rate for optimizer update `update` (0-based) of `total`."""
    if update < warmup:
        return (update + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = (update - warmup) / (total - warmup)  # 0 at the first update after the warm-up, < 1 at the last
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return (1.0 + math.cos(math.pi * progress)) / 2
    raise ValueError(f"lr_scheduler must be one of {SCHEDULES}, got {kind!r}")
