"""Length rewards: the TL;DR example's (TRL's documented GRPO example: prefer replies of a target
length), and DAPO's soft overlong punishment."""

from __future__ import annotations

from grpokit.rewards.reward_set import completion_text


def length(completions, target: int = 20, **columns) -> list[float]:
    """-|target - number of characters of the reply|.

    Always <= 0, and 0 only for a reply of exactly `target` characters: a learning curve of this
    reward rises towards 0 from below, it does not live in [0, 1].
    """
    return [-float(abs(target - len(completion_text(c)))) for c in completions]


def overlong(completion_ids, max_length: int, cache: int, **columns) -> list[float]:
    """DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment), L = number of tokens:

        0                                 if L <= max_length - cache
        (max_length - cache - L) / cache  if max_length - cache < L <= max_length
        -1                                if L > max_length

    L = len(completion_ids): every token after the prompt (in a multi-turn rollout, tool results
    too). With max_length = rollout.max_completion_length (DAPO's setting) a completion cut off at
    the limit gets -1, the end of the ramp.
    """
    for name, value in (("max_length", max_length), ("cache", cache)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"overlong: {name}={value!r} must be an integer >= 1")
    if cache > max_length:
        raise ValueError(f"overlong: cache={cache} must be <= max_length={max_length} (the ramp starts at "
                         "max_length - cache tokens)")
    if completion_ids is None:
        raise ValueError("overlong: needs completion_ids, the completions' token ids")
    start = max_length - cache
    return [0.0 if len(ids) <= start else (start - len(ids)) / cache if len(ids) <= max_length else -1.0
            for ids in completion_ids]
