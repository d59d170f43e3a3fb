"""Reward functions, with TRL's calling convention: f(prompts=..., completions=..., **columns).

Each returns one float (or None: not applicable) per completion. Besides the dataset's columns,
functions receive `finish_reasons` ("stop" or "length" per completion); TRL-style functions that
take **kwargs simply ignore it. Registered by name so that
configs and tasks refer to them as strings.
"""

from __future__ import annotations

from collections.abc import Callable

from grpokit.rewards.exact_answer import exact_answer, final_number

REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "exact_answer": exact_answer,
    "final_number": final_number,
}


def get_reward_function(name: str) -> Callable[..., list[float | None]]:
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward function {name!r}; built-in ones: {', '.join(sorted(REWARD_FUNCTIONS))}"
        ) from None
