"""Tasks: where prompts come from. A task has a train stream that is a pure function of (seed,
position), so a run resumes anywhere; a held-out split (`eval_examples`); and the reward functions
that score it when reward.functions does not name others.

Built-in tasks are in TASKS (data.task), `shapes` the picture task of vision-language models
(shapes.py); `environment` takes its prompts from the environment's
reset() (environment.py); `reasoning_gym:<name>` is one of reasoning-gym's datasets
(reasoning_gym.py); `textarena:<env id>` one of TextArena's single-player games, played by the
task's own agent (textarena.py); `verifiers:<module>:<load_environment>` a verifiers environment,
run by its own run_rollout (verifiers.py); a dataset file (data.path) becomes a task in dataset.py.
"""

from __future__ import annotations

from grpokit.runtime.errors import ConfigError
from grpokit.settings.schema import DataConfig, RolloutConfig


# data.task -> the module and class of a built-in task, imported when chosen.
TASKS = {"arithmetic": "grpokit.tasks.arithmetic:ArithmeticTask", "calculator": "grpokit.tasks.calculator:CalculatorTask",
         "environment": "grpokit.tasks.environment:EnvironmentTask", "shapes": "grpokit.tasks.shapes:ShapesTask"}


def check_task_name(name: str) -> str | None:
    """What is wrong with data.task=`name`, or None."""
    from grpokit.tasks import reasoning_gym, textarena, verifiers

    prefixes = (reasoning_gym.PREFIX, textarena.PREFIX, verifiers.PREFIX)
    if name in TASKS or any(name.startswith(p) and name != p for p in prefixes):
        return None
    return (f"data.task={name!r}: must be one of {', '.join(TASKS)}, {reasoning_gym.PREFIX}<dataset name> "
            f"(reasoning-gym), {textarena.PREFIX}<env id> (a TextArena game), or {verifiers.PREFIX}<module>:"
            "<load_environment> (a verifiers environment)")


def _task_class(name: str):
    import importlib

    if name not in TASKS:
        raise ValueError(check_task_name(name))
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def tool_names(rollout: RolloutConfig, data: DataConfig) -> list[str]:
    """The tools of a run: rollout.tools, or when null the task's own (a built-in task's; none for a
    dataset)."""
    if rollout.tools is not None:
        return list(rollout.tools)
    if data.path is not None or data.task not in TASKS:
        return []
    return list(getattr(_task_class(data.task), "tools", ()))


def make_task(data: DataConfig, seed: int, prompt_length, image_tokens=lambda example: 0):
    """The task for `data`: a dataset when data.path is set, else a built-in task.

    prompt_length(example) counts a prompt's tokens (for data.max_prompt_length), image_tokens(example)
    how many of them are its images'.
    """
    if data.path is not None:
        from grpokit.tasks.dataset import DatasetTask

        return DatasetTask(data, seed=seed, prompt_length=prompt_length, image_tokens=image_tokens)
    from grpokit.tasks import reasoning_gym, textarena, verifiers

    if data.task.startswith(verifiers.PREFIX):
        return verifiers.VerifiersTask(data.task, data.task_args, seed=seed, eval_size=data.eval_size)
    if data.task.startswith(reasoning_gym.PREFIX):
        return reasoning_gym.ReasoningGymTask(data.task.removeprefix(reasoning_gym.PREFIX), data.task_args, seed=seed,
                                              eval_size=data.eval_size)
    if data.task.startswith(textarena.PREFIX):
        return textarena.TextArenaTask(data.task.removeprefix(textarena.PREFIX), data.task_args, seed=seed,
                                       eval_size=data.eval_size)
    try:  # task_args: the shapes and arithmetic tasks' (the config refuses them for the others)
        return _task_class(data.task)(seed=seed, eval_size=data.eval_size, **data.task_args)
    except TypeError as e:
        raise ConfigError(f"data.task_args={data.task_args!r} for data.task={data.task}: {e}") from None


def environment_task(environment: str | None) -> str | None:
    """The data.task that rollout.environment=`environment` names, when it is a task of its own (a
    verifiers environment, `verifiers:<module>:<load_environment>`), else None."""
    from grpokit.tasks import verifiers

    return environment if (environment or "").startswith(verifiers.PREFIX) else None


def task_agent(name: str) -> str | None:
    """The agent (rollout.agent) that runs data.task=`name` when the run names none: a TextArena
    game's player, a verifiers environment's run_rollout; None for the tasks the trainer samples."""
    from grpokit.tasks import textarena, verifiers

    return next((task.AGENT for task in (textarena, verifiers) if name.startswith(task.PREFIX)), None)
