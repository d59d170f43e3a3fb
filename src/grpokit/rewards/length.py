"""The TL;DR example's reward (TRL's documented GRPO example): prefer replies of a target length."""

from __future__ import annotations

from grpokit.rewards import completion_text


def length(completions, target: int = 20, **columns) -> list[float]:
    """-|target - number of characters of the reply|.

    Always <= 0, and 0 only for a reply of exactly `target` characters: a learning curve of this
    reward rises towards 0 from below, it does not live in [0, 1].
    """
    return [-float(abs(target - len(completion_text(c)))) for c in completions]
