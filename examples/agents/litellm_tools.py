"""The calculator task played by a tool loop written on LiteLLM (`litellm.acompletion`, the client
many frameworks call underneath), pointed at the rollout's endpoint: the model is "openai/<name>"
and `api_base` the rollout's URL.

    pip install 'grpokit[agents]' litellm
    grpokit train --config examples/agents/calculator.yaml \
        rollout.agent=examples/agents/litellm_tools.py:agent

`agent` asks for whole replies, `agent_streamed` streams them (`stream=True`, the chunks put back
together by `litellm.stream_chunk_builder`); both train the same way. The agent's reward is 0: the
task's reward function (exact_answer) scores the last reply, as grpokit's own tool loop does.
"""

import json

import litellm

from grpokit.tasks.calculator import calculator

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "The expression, with numbers, + - * / and parentheses, e.g. \"12 * 34\"."}},
        "required": ["expression"]}}}]


def as_openai(messages: list[dict]) -> list[dict]:
    """The task's prompt with its worked examples' calls in the OpenAI form (ids, JSON arguments)."""
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = [{"id": f"example_{i}", "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": f"example_{i - 1}", "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


async def _loop(client, model, row, stream: bool) -> float:
    messages = as_openai(row["prompt"])
    for _ in range(3):  # three replies at most: a model still calling the tool then is scored as it is
        kwargs = dict(model=f"openai/{model}", api_base=str(client.base_url), api_key="grpokit", messages=messages,
                      tools=TOOLS, num_retries=0)
        if stream:
            chunks = [chunk async for chunk in await litellm.acompletion(**kwargs, stream=True)]
            reply = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        else:
            reply = (await litellm.acompletion(**kwargs)).choices[0].message
        calls = reply.tool_calls or []
        messages.append({"role": "assistant", "content": reply.content or "", **({"tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]} if calls else {})})
        if not calls:
            break
        for c in calls:
            try:
                result = calculator(**json.loads(c.function.arguments))
            except Exception as e:  # the model's call was malformed: it sees the error, as with grpokit's tools
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return 0.0


async def agent(client, model, row):
    return await _loop(client, model, row, stream=False)


async def agent_streamed(client, model, row):
    return await _loop(client, model, row, stream=True)
