"""Reward functions with TRL's calling convention, and `RewardSet`, which calls them and sums them
with weights (reward_set.py); the built-ins are the other modules of this folder, each imported
when a run names it (BUILTIN_REWARDS)."""

from grpokit.rewards.reward_set import (BUILTIN_REWARDS, RESERVED, REWARD_FUNCTIONS, RewardError, RewardLog, RewardSet,
                                        completion_text, get_reward_function, merge_metrics, trainer_state)

__all__ = ["BUILTIN_REWARDS", "RESERVED", "REWARD_FUNCTIONS", "RewardError", "RewardLog", "RewardSet", "completion_text",
           "get_reward_function", "merge_metrics", "trainer_state"]
