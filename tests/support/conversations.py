"""Conversations in tests: a tool call as the model writes it, and an agent of two requests."""

from __future__ import annotations

import json


# An agent (multiturn/agents.py) of two requests, the second continuing the first: a reward with
# variance on a random model. Python source, for the agent files tests write.
FOLLOW_UP_AGENT = '''
async def follow_up(client, model, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Shorter?"}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    return -len(second.choices[0].message.content or "") / 10
'''


def tool_call(name, **arguments) -> str:
    """A tool call as the model writes it (scripted_engine.SCRIPT replies)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
