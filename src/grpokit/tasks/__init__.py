"""Built-in tasks: a seeded train stream, a disjoint held-out split, and the rewards that score them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    prompt: list[dict[str, str]] | str  # chat messages (rendered with the chat template) or plain text
    columns: dict = field(default_factory=dict)  # passed to reward functions (e.g. answer=...)


def make_task(data, seed: int, prompt_length):
    """The task for `data` (a DataConfig): a dataset when data.path is set, else a built-in task.

    prompt_length(example) counts a prompt's tokens (for data.max_prompt_length).
    """
    if data.path is not None:
        from grpokit.data import DatasetTask

        return DatasetTask(data, seed=seed, prompt_length=prompt_length)
    if data.task == "arithmetic":
        from grpokit.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=seed, eval_size=data.eval_size)
    raise ValueError(f"data.task={data.task!r} is not a built-in task; built-in tasks: arithmetic")
