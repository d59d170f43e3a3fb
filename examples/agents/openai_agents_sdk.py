"""The calculator task played by an OpenAI Agents SDK agent: the SDK runs the tool loop, grpokit
trains the model behind it.

    pip install 'grpokit[agents]' openai-agents
    grpokit train --config examples/agents/calculator.yaml

`agent` uses the SDK's default model, on OpenAI's Responses API; `agent_chat` the same agent on chat
completions; `agent_streamed` runs it streamed (`Runner.run_streamed`). Each trains the same way:
the endpoint answers all of them from the same generation (docs/agents.md).

That config is examples/calculator.yaml's task with this agent: `rollout.tools=[]` drops the task's
own tool (the agent has its own), and there is no rollout.max_turns (the SDK runs the loop). The
one thing to do differently from the SDK's own examples: hand the model the client grpokit gives
the rollout (`openai_client=client`), never a global client (`set_default_openai_client`), which
would send every rollout's requests to one rollout's URL.
"""

import json
import logging

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)

from grpokit.tasks.calculator import calculator as evaluate

set_tracing_disabled(True)  # the SDK would send each run's trace to OpenAI's servers
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)  # it logs each truncated reply (caught below) as an error


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, with numbers, + - * / and parentheses, e.g. "12 * 34".
    """
    return evaluate(expression)


def as_items(messages: list[dict]) -> list[dict]:
    """The task's prompt (worked examples in chat form, then the question) as Responses API input
    items, as the SDK keeps a conversation."""
    items = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": f"example_{i - 1}", "output": m["content"]})
        elif m.get("tool_calls"):
            for call in m["tool_calls"]:
                arguments = call["function"]["arguments"]
                items.append({"type": "function_call", "call_id": f"example_{i}", "name": call["function"]["name"],
                              "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def calculator_agent(model) -> Agent:
    return Agent(name="calculator", instructions="Use the calculator, then answer with its result alone.",
                 tools=[calculator], model=model)


async def agent(client, model, row):
    """One rollout on the Responses API. The agent's reward is 0: the task's reward function
    (exact_answer) scores the last reply."""
    try:
        await Runner.run(calculator_agent(OpenAIResponsesModel(model=model, openai_client=client)),
                         as_items(row["prompt"]), max_turns=3)
    except (MaxTurnsExceeded, ModelBehaviorError):  # still calling the tool at the third turn, or out of tokens
        pass  # (the SDK raises on an incomplete reply): the last reply is scored, as grpokit's own tool loop does
    return 0.0


async def agent_chat(client, model, row):
    """The same, on chat completions."""
    try:
        await Runner.run(calculator_agent(OpenAIChatCompletionsModel(model=model, openai_client=client)),
                         as_items(row["prompt"]), max_turns=3)
    except (MaxTurnsExceeded, ModelBehaviorError):
        pass
    return 0.0


async def agent_streamed(client, model, row):
    """The same on the Responses API, streamed."""
    result = Runner.run_streamed(calculator_agent(OpenAIResponsesModel(model=model, openai_client=client)),
                                 as_items(row["prompt"]), max_turns=3)
    try:
        async for _ in result.stream_events():
            pass
    except (MaxTurnsExceeded, ModelBehaviorError):
        pass
    return 0.0
