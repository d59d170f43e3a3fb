"""A run's state besides its weights and optimizer: the trainer's counters (`Progress`), restored
from a checkpoint with the weights, optimizer, RNGs and the steps generated ahead
(training/checkpointing.py)."""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.rewards.reward_set import trainer_state
from grpokit.runtime import distributed
from grpokit.settings.schema import Config


@dataclass
class Progress:
    """The trainer's counters, restored from a checkpoint with the weights, optimizer and RNGs."""

    step: int = 0  # steps completed
    num_tokens: int = 0  # prompt + completion tokens seen so far, all processes (TRL's `num_tokens`)
    skipped_steps: int = 0  # steps with a skipped (non-finite) update
    skipped_in_a_row: int = 0
    unscored_in_a_row: int = 0  # steps in which no reward function scored any completion
    examples_seen: int = 0  # prompts drawn from the data stream (its position)
    saved_step: int | None = None  # the newest checkpoint's step (not itself saved in one)

    def trainer_state(self, config: Config, task):
        """The `trainer_state` reward functions receive now (rewards.trainer_state)."""
        size = len(getattr(task, "train_examples", ()))
        return trainer_state(self.step, config.train.max_steps, config.updates_per_step, epoch=self.examples_seen / size if size else 0.0,
                             tokens=self.num_tokens, main=distributed.is_main())
