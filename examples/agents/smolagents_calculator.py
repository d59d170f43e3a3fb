"""The calculator task played by smolagents agents (a ToolCallingAgent, and a CodeAgent that writes
Python calling the tool) on smolagents' OpenAIModel pointed at the rollout's endpoint: smolagents
runs the agent's loop, grpokit trains the model behind it.

    pip install 'grpokit[agents]' smolagents
    grpokit train --config examples/agents/calculator.yaml reward.functions=[] \
        rollout.agent=examples/agents/smolagents_calculator.py:agent

`agent` is a ToolCallingAgent, `code_agent` a CodeAgent. Both are plain `def`s, since smolagents'
`run()` blocks: grpokit runs each rollout's agent in a worker thread, so the rollouts stay
concurrent. The agent's reward is its own: 1 when its final answer is the task's answer (smolagents
gives the answer through its `final_answer` tool, not as a reply's text, so the task's reward
function would see no answer: `reward.functions=[]`).

Two things to do differently from smolagents' own examples:
- hand the model the rollout's own URL (`api_base=str(client.base_url)`), never one URL shared by
  all rollouts;
- `tool_choice="auto"`: a ToolCallingAgent asks for `tool_choice="required"` by default, which
  the endpoint refuses (forcing a call changes the distribution sampled from, and the training
  passes would not apply the constraint; docs/agents.md's field table). Its `stop` sequences
  ("Observation:", "Calling tools:", the CodeAgent's "</code>") are honoured.
"""

from smolagents import CodeAgent, LogLevel, OpenAIModel, ToolCallingAgent, tool

from grpokit.tasks.calculator import calculator as evaluate


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, with numbers, + - * / and parentheses, e.g. "12 * 34".
    """
    return evaluate(expression)


def smol_model(client, model: str) -> OpenAIModel:
    return OpenAIModel(model_id=model, api_base=str(client.base_url), api_key="grpokit",
                       client_kwargs={"max_retries": 0}, tool_choice="auto")


def answered(result, row) -> float:
    """1.0 when the agent's final answer is the row's answer, whatever its type (a number, text)."""
    try:
        return float(float(str(result).strip()) == float(row["answer"]))
    except ValueError:
        return 0.0


def question(row) -> str:
    """The task's question: the prompt's last message (smolagents writes its own system prompt and
    worked examples)."""
    return row["prompt"][-1]["content"]


def agent(client, model, row):
    """One rollout of a ToolCallingAgent, three steps at most; a run that ends without an answer
    (the steps spent, a reply that cannot be parsed) scores 0."""
    smol = ToolCallingAgent(tools=[calculator], model=smol_model(client, model), max_steps=3, verbosity_level=LogLevel.OFF)
    return answered(smol.run(question(row)), row)


def code_agent(client, model, row):
    """The same as a CodeAgent: the model writes Python that calls `calculator` and `final_answer`."""
    smol = CodeAgent(tools=[calculator], model=smol_model(client, model), max_steps=3, verbosity_level=LogLevel.OFF)
    return answered(smol.run(question(row)), row)
