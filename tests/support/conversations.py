"""Conversations in tests: a tool call as the model writes it, a tool, an agent that calls it, and
an agent of two requests."""

from __future__ import annotations

import json


# An agent (rollouts/agents.py) of two requests, the second continuing the first: a reward with
# variance on a random model. Python source, for the agent files tests write.
FOLLOW_UP_AGENT = '''
async def follow_up(client, model, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Shorter?"}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    return -len(second.choices[0].message.content or "") / 10
'''


# A tool, and an agent that calls it as the model asks until the model answers (grpokit's own
# multi-turn loop, written against the openai client). Python source, for the files tests write
# (with `import json` before them).
ADD_TOOL = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''
WITH_TOOLS_AGENT = '''
async def with_tools(client, model, row):
    """grpokit's own multi-turn loop, written against the openai client."""
    from transformers.utils import get_json_schema

    messages = list(row["prompt"])
    for turn in range(5):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[get_json_schema(add)])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length" or turn == 4:
            return 0.0
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(add(**json.loads(call.function.arguments)))})
'''


def tool_call(name, **arguments) -> str:
    """A tool call as the model writes it (scripted_engine.SCRIPT replies)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
