"""The calculator task played by a DSPy ReAct agent on `dspy.LM` pointed at the rollout's endpoint:
DSPy runs the agent's loop (its own text format: thought, tool name, tool arguments), grpokit trains
the model behind it.

    pip install 'grpokit[agents]' dspy
    grpokit train --config examples/agents/calculator.yaml reward.functions=[] \
        rollout.agent=examples/agents/dspy_react.py:agent

**DSPy's cache is off** (`cache=False`). By default DSPy answers a request it has seen before from
its cache on disk, whose key leaves out the base URL: a second run would get the first run's answers
without asking the endpoint, and a rollout that asks nothing fails ("made no request to its
endpoint"), so nothing would train. The agent is a plain `def` (DSPy's call blocks): grpokit runs it
in a worker thread. Its reward is its own: 1 when DSPy's `answer` is the task's answer
(`reward.functions=[]`: the reply's text is DSPy's format, not an answer the task's function reads).
"""

import logging

import dspy

from grpokit.tasks.calculator import calculator as evaluate

logging.getLogger("dspy").setLevel(logging.ERROR)  # it warns of each reply cut at the run's token budget


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, with numbers, + - * / and parentheses, e.g. "12 * 34"."""
    return evaluate(expression)


def agent(client, model, row):
    """One rollout, three tool calls at most; an answer DSPy cannot parse scores 0."""
    lm = dspy.LM(f"openai/{model}", api_base=str(client.base_url), api_key="grpokit", cache=False, num_retries=0)
    react = dspy.ReAct("question -> answer: float", tools=[calculator], max_iters=3)
    try:
        with dspy.context(lm=lm):
            answer = react(question=row["prompt"][-1]["content"]).answer
    except (ValueError, dspy.utils.exceptions.AdapterParseError):
        return 0.0
    return float(answer == float(row["answer"]))
