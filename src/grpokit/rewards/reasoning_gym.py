"""The `reasoning_gym` reward: reasoning-gym's own `score_answer` for each completion's answer."""

from __future__ import annotations

import functools
import json

from grpokit.rewards.reward_set import completion_text


@functools.cache
def _scorer(dataset: str, arguments: str):
    """score_answer of reasoning-gym's dataset `dataset` made with the generator arguments (JSON)
    its entries were made with: some datasets' score_answer reads them (a precision, a range)."""
    from grpokit.tasks.reasoning_gym import create

    return create(dataset, seed=0, size=1, arguments=json.loads(arguments)).score_answer


def reasoning_gym(completions, entry, task_args=None, **kwargs) -> list[float]:
    """score_answer(answer, entry) of the entry's own dataset (its metadata names it) with the
    task's generator arguments, in [0, 1]. The answer is what the completion's last
    <answer>...</answer> holds, as reasoning-gym's extract_answer takes it; a completion without
    the tags has none (score_answer(None) is 0). Scoring a bare completion instead taught the
    bundled model to restate the sum untagged, which some datasets give a little partial credit."""
    from reasoning_gym.utils import extract_answer

    arguments = task_args or [{}] * len(entry)
    return [float(_scorer(e["metadata"]["source_dataset"], json.dumps(a or {}, sort_keys=True))(
        extract_answer(completion_text(c)), e)) for c, e, a in zip(completions, entry, arguments)]
