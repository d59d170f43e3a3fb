"""The default run's arithmetic task as a verifiers environment: a SingleTurnEnv whose dataset is
grpokit's arithmetic prompts and whose rubric scores as the default run's rewards do (the bare
right number that ended: 1.0; a reply that starts with it: 0.5). Trained through grpokit's
endpoint, as any verifiers environment (docs/agents.md):

    grpokit train rollout.environment=verifiers:examples/verifiers_arithmetic.py:load_environment
"""

import re

import verifiers as vf
from datasets import Dataset

from grpokit.tasks.arithmetic import ArithmeticTask

_LEADING = re.compile(r"\s*(-?\d+)")


def _reply(completion) -> str:
    return (completion[-1].get("content") or "") if completion else ""


def exact(completion, answer, state, **kwargs) -> float:
    """The reply is the number and nothing else, and it ended."""
    text = _reply(completion).strip().removesuffix(".").rstrip()
    return float(not state.get("is_truncated") and re.fullmatch(r"-?\d+", text) is not None and int(text) == int(answer))


def leading(completion, answer, **kwargs) -> float:
    """The reply starts with the number."""
    match = _LEADING.match(_reply(completion))
    return float(match is not None and int(match.group(1)) == int(answer))


def load_environment(train_size: int = 20000, eval_size: int = 100, seed: int = 0) -> vf.Environment:
    task = ArithmeticTask(seed=seed, eval_size=eval_size)

    def rows(examples):
        return Dataset.from_list([{"prompt": e.prompt, "answer": str(e.columns["answer"])} for e in examples])

    train = rows(task.train_example(i) for i in range(train_size))
    return vf.SingleTurnEnv(dataset=train, eval_dataset=rows(task.eval_examples),
                            rubric=vf.Rubric(funcs=[exact, leading], weights=[1.0, 0.5]))
