"""A run's state besides its weights and optimizer: the trainer's counters (`Progress`), restored
from a checkpoint with the weights, optimizer, RNGs and the steps generated ahead; and what a
failure saves (`FailureSave`): the state from before the failing step, unless that step had
already begun to change the weights."""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.config.schema import Config
from grpokit.rewards.reward_set import trainer_state
from grpokit.runtime import distributed


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
        return trainer_state(config, self.step, epoch=self.examples_seen / size if size else 0.0,
                             tokens=self.num_tokens, main=distributed.is_main())


class FailureSave:
    """What a failure saves: while a step runs, the state from before it (captured as it starts),
    as long as no optimizer update of the step has begun (counted by a hook on the optimizer);
    between steps, the state as it is."""

    def __init__(self, optimizer):
        self.updates_begun = 0
        self.hook = optimizer.register_step_pre_hook(self._count)
        self.before = None  # (state before the running step, updates begun before it)

    def _count(self, *_) -> None:
        self.updates_begun += 1

    def step_begins(self, captured) -> None:
        self.before = captured, self.updates_begun

    def step_ends(self) -> None:
        self.before = None

    def state(self, capture):
        """The state to save (capture() between steps), or None: the failing step changed the weights."""
        if self.before is None:
            return capture()
        captured, begun = self.before
        return captured if begun == self.updates_begun else None

    def close(self) -> None:
        self.hook.remove()
