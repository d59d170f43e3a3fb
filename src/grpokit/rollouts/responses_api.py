"""OpenAI's Responses API (`/v1/responses`) on the chat path of the endpoint (endpoint.py).

A request's `instructions` and `input` (text, or message, function_call and function_call_output
items) become the chat messages a chat-completions agent doing the same turns would send, and its
function tools the chat form of them. So the request is rendered by the same chat template and
continues a conversation token in, token out as a chat request does: an Agents SDK agent on its
default model and the same agent on chat completions train alike. The reply goes back as output
items: a message with the text (if any), then one function_call per tool call.

Streamed (`stream: true`), the reply is generated whole first (endpoint.py's streaming), then sent
as the Responses API's events: created, in progress, each item added, its text or arguments,
done, and completed with the whole response.
"""

from __future__ import annotations

import json
import time

from grpokit.rollouts.request_fields import RequestError

_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_form(body: dict) -> tuple[list[dict], list[dict] | None]:
    """The chat messages and tools of a Responses request `body`."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for item in given:
            _add(messages, item)
    else:
        raise RequestError("input must be a string or a non-empty list of items")
    return messages, _chat_tools(body.get("tools"))


def _add(messages: list[dict], item) -> None:
    """Input `item` appended to `messages` as chat messages: a function call joins the assistant
    turn before it (its text, or the calls it already has)."""
    if not isinstance(item, dict):
        raise RequestError(f"every input item must be an object, got {str(item)[:80]}")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in ("system", "user", "assistant"):
            raise RequestError(f"a message item's role must be system, developer, user or assistant, got {role!r}")
        messages.append({"role": role, "content": _text(item.get("content"), "a message item's content")})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})  # as chat replies have it
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text(item.get("output"), "a function_call_output's output")})
    else:
        raise RequestError(f"input items of type {kind!r} are not supported: only message, function_call and "
                           "function_call_output (the model being trained writes no reasoning items)")


def _text(content, what: str) -> str:
    """Content given as a string, or as text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content):
        return "".join(p.get("text", "") for p in content)
    raise RequestError(f"{what}: only text is supported (a string or input_text / output_text parts)")


def _chat_tools(tools) -> list[dict] | None:
    """Function tools (checked by request_fields) in the chat form the template renders: every
    field but the type, name, description and parameters first, as chat requests order them (a
    template writes the tool as JSON, in its keys' order)."""
    first = ("name", "description", "parameters")
    out = [{"type": "function", "function": {**{k: t[k] for k in first if k in t},
                                             **{k: v for k, v in t.items() if k not in (*first, "type")}}}
           for t in tools or ()]
    return out or None


def response(response_id: str, message: dict, finish: str, usage: dict, body: dict,
             logprobs: list[dict] | None) -> dict:
    """The Responses API's answer for the chat reply `message` (content, tool_calls) that ended
    with `finish` ("length": incomplete); logprobs: the text's tokens' (request_fields' include)."""
    output, incomplete = [], finish == "length"
    if message["content"]:
        part = {"type": "output_text", "text": message["content"], "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        # A reply cut at its token limit: its message is as incomplete as the response (OpenAI's own say so).
        output.append({"type": "message", "id": f"msg_{response_id}", "status": "incomplete" if incomplete else
                       "completed", "role": "assistant", "content": [part]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        output.append({"type": "function_call", "id": f"fc_{response_id}_{i}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    return {
        "id": f"resp_{response_id}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "model": body.get("model") or "grpokit", "output": output,
        "instructions": body.get("instructions"), "tools": body.get("tools") or [], "tool_choice": "auto",
        "parallel_tool_calls": True, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


def events(whole: dict) -> list[str]:
    """The server-sent events of the Responses API's stream of response `whole`."""
    out: list[dict] = []
    started = {**whole, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    out += [{"type": "response.created", "response": started}, {"type": "response.in_progress", "response": started}]
    for index, item in enumerate(whole["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            empty = {**part, "text": ""}
            out += [{"type": "response.output_item.added", "output_index": index,
                     "item": {**item, "status": "in_progress", "content": []}},
                    {"type": "response.content_part.added", **at, "content_index": 0, "part": empty},
                    {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"],
                     "logprobs": part.get("logprobs", [])},
                    {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                     "logprobs": part.get("logprobs", [])},
                    {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
        else:
            out += [{"type": "response.output_item.added", "output_index": index,
                     "item": {**item, "status": "in_progress", "arguments": ""}},
                    {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                    {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}]
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
    out.append({"type": "response.completed" if whole["status"] == "completed" else "response.incomplete",
                "response": whole})
    return [f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n" for n, e in enumerate(out)]
