"""data.task=environment: the environment brings the prompts, as TRL's `environment_factory` does
without a `train_dataset`.

Every example is the same placeholder, one empty user message (TRL's); each rollout's
environment instance returns its task from `reset()`, and that text becomes the prompt (it is
appended to the placeholder's message). So the rollouts of one group may start from different
tasks when reset() draws one at random (TRL's note: the group baseline is then noisier; a reset()
that derives its state from a shared key keeps a group on one task). There is no held-out split:
evaluation needs a dataset (data.path with the environment).

It is what a run with rollout.environment and neither data.path nor data.task gets (Config.settle).
"""

from __future__ import annotations

from collections.abc import Iterator

from grpokit.tasks.task import Example

# TRL's placeholder prompt: reset()'s text is appended to this message.
PLACEHOLDER = ({"role": "user", "content": ""},)


class EnvironmentTask:
    name = "environment"
    reward_functions = ()  # the environment's get_reward(), and reward.functions
    prompts_from_reset = True  # the trainer checks at start-up that reset() returns a prompt
    eval_examples: list[Example] = []
    notes = ("data.task=environment: the prompts come from the environment's reset(); there are no held-out "
             "prompts to evaluate (give a dataset, data.path, for that)",)

    def __init__(self, seed: int = 0, eval_size: int = 0):
        self.seed = seed

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        while True:
            yield Example(prompt=[dict(m) for m in PLACEHOLDER])
