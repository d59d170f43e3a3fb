"""The calculator task played by a LangGraph ReAct agent (LangChain's `create_agent`, the graph that
replaced `langgraph.prebuilt.create_react_agent` in LangGraph 1.0, on langchain-openai's
ChatOpenAI pointed at the rollout's endpoint): LangGraph runs the tool loop, grpokit trains the
model behind it.

    pip install 'grpokit[agents]' langchain langgraph langchain-openai
    grpokit train --config examples/agents/calculator.yaml rollout.agent=examples/agents/langgraph_react.py:agent

`agent` invokes the graph; `agent_streamed` streams it (`astream`, ChatOpenAI with streaming=True).
Both train the same way: the endpoint answers both from the same generation (docs/agents.md).

ChatOpenAI is pointed at the rollout's own URL (`client.base_url`, given to the agent), never at a
URL shared by all rollouts.
"""

import asyncio
import json

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

from grpokit.tasks.calculator import calculator as evaluate


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, with numbers, + - * / and parentheses, e.g. "12 * 34".
    """
    return evaluate(expression)


def as_messages(messages: list[dict]) -> list:
    """The task's prompt (worked examples in chat form, then the question) as LangChain messages."""
    out, call_id = [], None
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            out.append(ToolMessage(m["content"], tool_call_id=call_id))
        elif m.get("tool_calls"):
            call_id = f"example_{i}"
            calls = [{"name": c["function"]["name"], "id": call_id, "type": "tool_call",
                      "args": c["function"]["arguments"] if isinstance(c["function"]["arguments"], dict)
                      else json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]
            out.append(AIMessage(m["content"] or "", tool_calls=calls))
        else:
            out.append({"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}[m["role"]](m["content"]))
    return out


def react_agent(client, model, streaming: bool = False):
    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key="grpokit", max_retries=0, streaming=streaming)
    return create_agent(llm, [calculator])


async def built(client, model, streaming: bool = False):
    """react_agent, made in a worker thread: ChatOpenAI makes two HTTP clients, each loading the
    machine's CA certificates (tens of ms), and every rollout's agent makes its own; on the event
    loop all the rollouts share, that held the others up for seconds at a step's start."""
    return await asyncio.to_thread(react_agent, client, model, streaming)


# A model still calling the tool after three turns ends the graph: its last reply is scored, as
# grpokit's own tool loop does (each turn is a model node and a tool node).
LIMIT = {"recursion_limit": 6}


async def agent(client, model, row):
    """One rollout. The agent's reward is 0: the task's reward function (exact_answer) scores the
    last reply."""
    try:
        await (await built(client, model)).ainvoke({"messages": as_messages(row["prompt"])}, LIMIT)
    except GraphRecursionError:
        pass
    return 0.0


async def agent_streamed(client, model, row):
    """The same, streamed token by token (stream_mode="messages")."""
    try:
        async for _ in (await built(client, model, streaming=True)).astream(
                {"messages": as_messages(row["prompt"])}, LIMIT, stream_mode="messages"):
            pass
    except GraphRecursionError:
        pass
    return 0.0
