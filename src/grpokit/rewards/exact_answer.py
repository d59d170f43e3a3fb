"""Exact integer answers: the reply must be the number and nothing else."""

from __future__ import annotations

import re

from grpokit.rewards.reward_set import completion_text

_NUMBER = re.compile(r"-?\d+")
_LEADING = re.compile(r"\s*(-?\d+)")


def parse_integer_reply(text: str) -> int | None:
    """The integer a reply consists of, or None. Surrounding spaces and one final period are allowed."""
    text = text.strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return int(text) if _NUMBER.fullmatch(text) else None


def exact_answer(completions, answer, finish_reasons=None, **columns) -> list[float]:
    """1.0 when the reply is exactly the expected integer and it ended (EOS), else 0.0.

    "7 + 5 = 12" earns 0: the prompt asks for just the number, and a verifiable reward checks the
    instruction as well as the arithmetic. So does "12\n\n" cut off at the length limit: that
    reply had not ended, and would have gone on.
    """
    finish_reasons = finish_reasons or ["stop"] * len(completions)
    return [
        float(reason == "stop" and parse_integer_reply(completion_text(c)) == int(a))
        for c, a, reason in zip(completions, answer, finish_reasons)
    ]


def leading_number(completions, answer, **columns) -> list[float]:
    """1.0 when the reply starts with the expected integer, whatever follows, else 0.0.

    Partial credit that points at the asked-for format: "12" cut off as "12\n\nThe sum" earns it,
    and only stopping is left to learn. (Crediting the right number anywhere, "Answer: 12." or
    "7 + 5 = 12", led runs to a verbose format that never turned bare: exact accuracy stayed 0.)
    """
    rewards = []
    for c, a in zip(completions, answer):
        match = _LEADING.match(completion_text(c))
        rewards.append(float(match is not None and int(match.group(1)) == int(a)))
    return rewards
