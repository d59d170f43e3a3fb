"""Built-in tasks: a seeded train stream, a disjoint held-out split, and the rewards that score them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    prompt: list[dict[str, str]]  # chat messages, rendered with the model's chat template
    columns: dict = field(default_factory=dict)  # passed to reward functions (e.g. answer=...)


def make_task(name: str, seed: int, eval_size: int):
    if name == "arithmetic":
        from grpokit.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=seed, eval_size=eval_size)
    raise ValueError(f"data.task={name!r} is not a built-in task; built-in tasks: arithmetic")
