"""Math rewards, EasyR1 / R1 style: `math_accuracy` (is the final answer right?) and `format`
(is the reply shaped as asked?).

Answers are compared with the `math-verify` package, which knows that \\frac{1}{2} == 0.5,
1,000 == 1000, x = 2 answers 2, and compares intervals and sets as such.
"""

from __future__ import annotations

import re

from grpokit.rewards.reward_set import completion_text, written_text

_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
DEFAULT_FORMAT = r"<think>.*?</think>\s*.*\\boxed\{.*\}.*"


def _math_verify():
    try:
        import math_verify
    except ImportError:  # a dependency of grpokit; absent only in a broken install
        raise ImportError("the math_accuracy reward needs `pip install math-verify`") from None
    return math_verify


def final_answer(text: str) -> str | None:
    """The reply's answer as LaTeX: the last \\boxed{...} if there is one, else the last number."""
    if "\\boxed" in text:
        return text  # math-verify finds the last boxed expression itself
    numbers = _LAST_NUMBER.findall(text)
    return f"${numbers[-1]}$" if numbers else None


def math_accuracy(completions, answer, **columns) -> list[float | None]:
    """1.0 when the reply's final answer (last \\boxed{}, else last number) equals `answer`
    mathematically, else 0.0; None when there is no `answer` to compare to (missing or unparseable)."""
    mv = _math_verify()
    rewards = []
    for completion, gold in zip(completions, answer):
        gold_text = "" if gold is None else str(gold).strip()
        if not gold_text:
            rewards.append(None)
            continue
        if "$" not in gold_text and "\\boxed" not in gold_text:
            gold_text = f"${gold_text}$"
        target = mv.parse(gold_text)
        if not target:
            rewards.append(None)
            continue
        predicted = final_answer(completion_text(completion))
        rewards.append(float(predicted is not None and mv.verify(target, mv.parse(predicted))))
    return rewards


def think_format(completions, **columns) -> list[float]:
    """1.0 when the reply reasoned, ended its reasoning and then answered: its message has reasoning
    that is not empty (model.reasoning_parser told it apart: reasoning_content), not cut inside
    it, and an answer after it; else 0.0. (TRL's think_format_reward checks the tags in the text; here the parser has
    taken the reasoning out of the content.)"""
    rewards = []
    for c in completions:
        reply = [m for m in c if m.get("role", "assistant") == "assistant"][-1:] if isinstance(c, list) else []
        rewards.append(float(bool(reply) and bool((reply[0].get("reasoning_content") or "").strip())
                             and not reply[0].get("reasoning_cut") and bool((reply[0].get("content") or "").strip())))
    return rewards


def format_reward(completions, pattern: str = DEFAULT_FORMAT, **columns) -> list[float]:
    """1.0 when the whole reply matches `pattern` (a regex; dot matches newlines), else 0.0.

    The default asks for R1's shape: reasoning in <think>...</think>, then an answer in \\boxed{}.
    Registered as `format`; set another pattern with {name: format, pattern: '...'}. The reply is
    read as written (reward_set.written_text: a reasoning parser's split undone).
    """
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.fullmatch(written_text(c).strip()) is not None) for c in completions]
