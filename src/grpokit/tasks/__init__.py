"""Tasks: where prompts come from (task.py: `Example`, train streams), the built-in ones by name
(registry.py: TASKS, `make_task`), a dataset file (dataset.py), a row's images (images.py)."""

from grpokit.tasks.registry import TASKS, check_task_name, make_task, tool_names
from grpokit.tasks.task import DataError, Example, stream_from

__all__ = ["TASKS", "DataError", "Example", "check_task_name", "make_task", "stream_from", "tool_names"]
