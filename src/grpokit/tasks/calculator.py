"""A tool-use task: multiplications too hard for a small model's head (three digits times two),
with a calculator tool. The model learns to call the tool and to answer with what it returned.

A prompt is worked conversations (question, calculator call, result, answer), then the question.
Training prompts carry two (TRAIN_SHOTS), held-out prompts one (EVAL_SHOTS): with one, the bundled
135M model never calls the tool (it writes a made-up tool reply instead), with two it calls it in
some of its samples, which is what reinforcement learning needs to start from. The held-out score
therefore measures whether the model learned to use the tool, beyond copying two examples.

Example i of the train stream is a pure function of (seed, i); the held-out split is drawn first,
from its own seed, and the train stream skips every held-out problem.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Iterator

from grpokit.tasks.task import Example, stream_from

# (a, b) of the worked examples training prompts and held-out prompts start with.
TRAIN_SHOTS: tuple[tuple[int, int], ...] = ((7, 8), (6, 9))
EVAL_SHOTS: tuple[tuple[int, int], ...] = ((7, 8),)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, with numbers, + - * / and parentheses, e.g. "12 * 34".
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def worked(a: int, b: int) -> list[dict]:
    """One worked example: the question, the calculator call, its result, the answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
    return [{"role": "user", "content": question(a, b)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


class CalculatorTask:
    name = "calculator"
    reward_functions = (("exact_answer", 1.0),)
    tools = ("grpokit.tasks.calculator:calculator",)

    def __init__(self, seed: int = 0, eval_size: int = 100):
        self.seed = seed
        rng = random.Random(f"calculator-eval-{seed}")
        held_out: dict[tuple[int, int], Example] = {}
        while len(held_out) < eval_size:
            a, b = self._draw(rng)
            held_out.setdefault((a, b), self._example(a, b, EVAL_SHOTS))
        self._held_out = held_out
        self.eval_examples: list[Example] = list(held_out.values())

    @staticmethod
    def _draw(rng: random.Random) -> tuple[int, int]:
        return rng.randint(100, 999), rng.randint(10, 99)

    @staticmethod
    def _example(a: int, b: int, shots: tuple[tuple[int, int], ...]) -> Example:
        shots = [m for x, y in shots for m in worked(x, y)]
        return Example(prompt=[*shots, {"role": "user", "content": question(a, b)}], columns={"answer": a * b})

    def train_example(self, index: int) -> Example:
        """Example `index` of the train stream (a pure function of seed and index)."""
        rng = random.Random(f"calculator-train-{self.seed}-{index}")
        while True:
            a, b = self._draw(rng)
            if (a, b) not in self._held_out:
                return self._example(a, b, TRAIN_SHOTS)

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        return stream_from(self, start)
