"""The built-in task: integer arithmetic, answered with just the number.

Problems are drawn from a fixed mix of kinds (see KINDS); example i of the train stream is a pure
function of (seed, i), so a run can resume at any position. The held-out split is drawn first,
from its own seed, and the train stream skips every held-out problem.

With `thinking` (data.task_args: {thinking: true}) each question comes after two worked
exchanges that reason inside <think> tags before the bare number (WORKED): the bundled 135M model
never closes a think block on its own, and closes one in most samples after two examples.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from grpokit.tasks.task import Example, stream_from

INSTRUCTION = "Answer with just the number."
# (question, reply) shown before each question with `thinking`: the format to learn.
WORKED = (("3 + 4", "<think>\n3 + 4 = 7\n</think>\n\n7"), ("6 * 5", "<think>\n6 * 5 = 30\n</think>\n\n30"))


def _add1(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a} + {b}", a + b


def _sub1(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    a, b = max(a, b), min(a, b)
    return f"{a} - {b}", a - b


def _mul1(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{a} * {b}", a * b


def _add2(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"{a} + {b}", a + b


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add1": _add1,
    "sub1": _sub1,
    "mul1": _mul1,
    "add2": _add2,
}


class ArithmeticTask:
    name = "arithmetic"
    # (name, weight): full marks for the bare right number, partial credit for leading with it.
    reward_functions = (("exact_answer", 1.0), ("leading_number", 0.5))

    def __init__(self, seed: int = 0, eval_size: int = 100, kinds: tuple[str, ...] = tuple(KINDS),
                 thinking: bool = False):
        self.seed = seed
        self.kinds = kinds
        self.shown = [m for q, reply in (WORKED if thinking else ()) for m in (
            {"role": "user", "content": f"What is {q}? {INSTRUCTION}"}, {"role": "assistant", "content": reply})]
        rng = random.Random(f"arithmetic-eval-{seed}")
        held_out: dict[str, Example] = {}
        for _ in range(100 * eval_size):
            if len(held_out) == eval_size:
                break
            question, answer = self._draw(rng)
            held_out.setdefault(question, self._example(question, answer, rng))
        self._held_out = held_out
        self.eval_examples: list[Example] = list(held_out.values())

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        return KINDS[rng.choice(self.kinds)](rng)

    def _example(self, question: str, answer: int, rng: random.Random) -> Example:
        content = f"What is {question}? {INSTRUCTION}"
        return Example(prompt=[*self.shown, {"role": "user", "content": content}], columns={"answer": answer})

    def train_example(self, index: int) -> Example:
        """Example `index` of the train stream (a pure function of seed and index)."""
        rng = random.Random(f"arithmetic-train-{self.seed}-{index}")
        while True:
            question, answer = self._draw(rng)
            if question not in self._held_out:
                return self._example(question, answer, rng)

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        return stream_from(self, start)
