"""verifiers environments (PRIME-RL's, the Environments Hub's; `pip install 'grpokit[verifiers]'`):
`data.task=verifiers:<module>:<load_environment>` (also spelled `rollout.environment=verifiers:...`),
with `load_environment`'s arguments in `data.task_args`, or a `verifiers.Environment` object given to
`grpokit.train(environment=...)`. Any of verifiers' environments runs unchanged (SingleTurnEnv,
MultiTurnEnv, ToolEnv, StatefulToolEnv): verifiers' own `run_rollout` drives it, its client being
the rollout's endpoint (rollouts/agents.py), so its dataset, system prompt, parser, tools, max_turns and
rubric are its own.

The prompts are the environment's dataset (`get_dataset()`): the train stream goes through it in a
new order each epoch, drawn from the run's seed and the epoch. The held-out prompts are its eval
dataset (`get_eval_dataset()`) when it has one, else the dataset's last data.eval_size rows, which
are then left out of training. The reward is the rubric's (its functions weighted as the rubric
weighs them); each function's value is logged as `agent/<name>`.
"""

from __future__ import annotations

from collections.abc import Iterator

from grpokit.runtime import user_code
from grpokit.runtime.errors import ConfigError
from grpokit.tasks.task import Example, stream_from

PREFIX = "verifiers:"
AGENT = "grpokit.tasks.verifiers:run"
# The environments of this process's tasks, by their data.task name: the agent finds its rows' here.
_ENVIRONMENTS: dict[str, object] = {}


def _library():
    try:
        import verifiers
    except ImportError:
        raise ConfigError("data.task=verifiers:... needs verifiers: pip install 'grpokit[verifiers]'") from None
    return verifiers


def load(name: str, arguments: dict):
    """The environment data.task=`name` names: an Environment object (grpokit.train's), or what
    `module:load_environment(**arguments)` returns."""
    vf = _library()
    spec = name.removeprefix(PREFIX)
    found = user_code.find(f"data.task={name}", spec, noun="object")
    environment = found
    if not isinstance(found, vf.Environment):
        if not callable(found):
            raise ConfigError(f"data.task={name}: {spec} is neither a verifiers Environment nor a function returning one")
        try:
            environment = found(**arguments)
        except TypeError as e:
            raise ConfigError(f"data.task={name} with data.task_args={arguments!r}: {e}") from None
    elif arguments:
        raise ConfigError(f"data.task={name} is an Environment object: data.task_args={arguments!r} has nothing to go to")
    if not isinstance(environment, vf.Environment):
        raise ConfigError(f"data.task={name}: {spec} returned {type(environment).__name__}, not a verifiers Environment")
    return environment


class VerifiersTask:
    reward_functions = ()  # the rubric's, through the task's agent (`agent` reward)

    def __init__(self, name: str, arguments: dict, seed: int = 0, eval_size: int = 100):
        self.name, self.seed = name, seed
        environment = _ENVIRONMENTS[name] = load(name, arguments)
        rows = list(environment.get_dataset())
        held_out = list(environment.get_eval_dataset()) if getattr(environment, "eval_dataset", None) is not None else []
        if not held_out and eval_size:
            rows, held_out = rows[:-eval_size], rows[-eval_size:]
        if not rows:
            raise ConfigError(f"data.task={name}: the environment's dataset has no rows to train on "
                              f"(data.eval_size={eval_size} took them for evaluation)")
        self.rows, self._orders = rows, {}
        self.eval_examples = [self._example(row) for row in held_out[:eval_size]]

    def _example(self, row: dict) -> Example:
        columns = {k: v for k, v in row.items() if k != "prompt"}
        return Example(list(row["prompt"]), {**columns, "verifiers_task": self.name})

    def train_example(self, index: int) -> Example:
        import torch

        epoch, position = divmod(index, len(self.rows))
        if epoch not in self._orders:  # one epoch at a time is all a stream needs
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator).tolist()}
        return self._example(self.rows[self._orders[epoch][position]])

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        return stream_from(self, start)


class Scored:
    """What `run` returns: the rubric's reward, and each of its functions' values (logged)."""

    def __init__(self, reward: float, parts: dict[str, float]):
        self.reward, self.parts = reward, parts


async def run(client, model, row) -> Scored:
    """One rollout of a verifiers environment: its own run_rollout, through `client`."""
    from verifiers.clients import OpenAIChatCompletionsClient

    environment = _ENVIRONMENTS[row["verifiers_task"]]
    rollout = {"prompt": row["prompt"], "example_id": row.get("example_id", 0)}
    for key in ("answer", "info", "task"):
        if row.get(key) is not None:
            rollout[key] = row[key]
    output = await environment.run_rollout(rollout, OpenAIChatCompletionsClient(client), model, sampling_args={})
    error = output.get("error")
    if error:
        what = f"{error.get('error')}: {error.get('message')}" if isinstance(error, dict) else error
        raise RuntimeError(f"the verifiers environment aborted the rollout ({what})")
    return Scored(float(output["reward"]), {k: float(v) for k, v in (output.get("metrics") or {}).items()})
