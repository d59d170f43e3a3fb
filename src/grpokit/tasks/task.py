"""What a task is made of: `Example`s (a prompt, the columns reward functions get, its images), a
train stream that is a pure function of (seed, position), so that a run resumes anywhere, and
`DataError`, a data problem named by file, row and problem.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from grpokit.runtime.errors import ConfigError

# What every reward function is passed besides a task's columns (TRL's names, and finish_reasons):
# no column may take one of these names.
RESERVED = ("prompts", "completions", "completion_ids", "finish_reasons", "trainer_state", "log_metric", "log_extra")


@dataclass(frozen=True)
class Example:
    prompt: list[dict[str, str]] | str  # chat messages (rendered with the chat template) or plain text
    columns: dict = field(default_factory=dict)  # passed to reward functions (e.g. answer=...)
    images: tuple = ()  # RGB PIL images, one per {"type": "image"} part of the prompt, in order (models/vision.py)
    where: str | None = field(default=None, compare=False)  # a dataset row's file and line, for messages about it


def stream_from(task, start: int = 0) -> Iterator[Example]:
    """task.train_example(start), task.train_example(start + 1), ...: the train stream of a task
    whose examples are a pure function of their index."""
    return map(task.train_example, itertools.count(start))


class DataError(ConfigError):
    """A problem with a dataset file, stated as file, row and problem."""
