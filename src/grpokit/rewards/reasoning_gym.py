"""The `reasoning_gym` reward: reasoning-gym's own `score_answer` for each completion's answer."""

from __future__ import annotations

import functools

from grpokit.rewards import completion_text


@functools.cache
def _scorer(dataset: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(dataset)


def reasoning_gym(completions, entry, **kwargs) -> list[float]:
    """score_answer(answer, entry) of the entry's own dataset (its metadata names it), in [0, 1].
    The answer is what the completion's last <answer>...</answer> holds, as reasoning-gym's
    extract_answer takes it; a completion without the tags has none (score_answer(None) is 0).
    Scoring a bare completion instead taught the bundled model to restate the sum untagged, which
    some datasets give a little partial credit."""
    from reasoning_gym.utils import extract_answer

    return [float(_scorer(e["metadata"]["source_dataset"])(extract_answer(completion_text(c)), e))
            for c, e in zip(completions, entry)]
