"""Answers from a few options (the picture task's): the reply must name the expected one and no other."""

from __future__ import annotations

import re

from grpokit.rewards.reward_set import completion_text


def named_answer(completions, answer, options, **columns) -> list[float]:
    """1.0 when the reply names the expected answer, as a whole word (case aside), and none of the
    row's other `options`, else 0.0: "Red.", "The shape is red" answer "red"; "red or blue" does not."""
    rewards = []
    for c, a, choices in zip(completions, answer, options):
        words = set(re.findall(r"[a-z0-9]+", completion_text(c).lower()))
        named = {str(o).lower() for o in choices} & words
        rewards.append(float(named == {str(a).lower()}))
    return rewards
