"""How a model writes a tool call, per family (rollout.tool_call_format), and how a model's turn is
read: its text decoded, its reasoning apart (models/reasoning.py), its calls parsed (`Replies`).

    hermes    <tool_call>{"name": ..., "arguments": {...}}</tool_call>      Qwen2.5/3/3.5, Hermes, grpokit's ChatML template
    llama3    {"name": ..., "parameters": {...}}, after <|python_tag|> or alone (several: ; between)   Llama 3.1-3.3
    mistral   [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name[ARGS]{...}   Mistral, Ministral
    harmony   <|channel|>commentary to=functions.name ... <|message|>{...}<|call|>   GPT-OSS
    template  the tokenizer's own parse_response (transformers' response templates)

`auto` takes `template` where the tokenizer has a response template, else the format whose marks
its chat template writes, hermes where it writes none. A malformed call is no call: it comes back
as a problem (the model reads it as an error result), and the turn's text stays as written.

harmony is read from the text the model wrote (its special tokens kept), by grpokit: the
openai-harmony package renders and parses it too, but loads its vocabulary file from the network
at first use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from grpokit.models.reasoning import Reasoning
from grpokit.rollouts.tools import ToolCall

Parsed = tuple[str, list[ToolCall], list[str]]  # content without the calls, the well-formed calls, a problem per malformed one

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_SHAPE = 'a tool call is {"name": <tool name>, "arguments": {<argument>: <value>, ...}}'


def call_from(obj, arguments_key: str = "arguments") -> ToolCall | str:
    """A call from its JSON ({"name": ..., "arguments": {...}}, arguments possibly a JSON string;
    OpenAI's {"type": "function", "function": {...}}), or the problem with it."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f"error: {_SHAPE}; got {json.dumps(obj)[:200]}"
    arguments = obj.get(arguments_key, obj.get("arguments")) or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"error: the arguments of the call to {obj['name']!r} are not valid JSON: {arguments[:200]}"
    if not isinstance(arguments, dict):
        return f"error: {_SHAPE}; the arguments of {obj['name']!r} are {type(arguments).__name__}"
    return ToolCall(obj["name"], arguments)


def _json_call(body: str, calls: list, problems: list, arguments_key: str = "arguments") -> None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        problems.append(f"error: the tool call is not valid JSON ({e.msg}): {body.strip()[:200]}")
        return
    call = call_from(obj, arguments_key)
    (problems if isinstance(call, str) else calls).append(call)


def _named_call(name: str, arguments: str, calls: list, problems: list) -> None:
    """A call written as its name, then its arguments' JSON."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        problems.append(f"error: the arguments of the call to {name!r} are not valid JSON ({e.msg}): {arguments[:200]}")
        return
    call = call_from({"name": name, "arguments": parsed})
    (problems if isinstance(call, str) else calls).append(call)


def hermes(text: str) -> Parsed:
    calls, problems = [], []
    for body in _HERMES.findall(text):
        _json_call(body, calls, problems)
    if text.count("<tool_call>") > text.count("</tool_call>"):
        problems.append("error: a <tool_call> without its </tool_call>")
    return _HERMES.sub("", text).strip(), calls, problems


def llama3(text: str) -> Parsed:
    tagged = text.lstrip().startswith("<|python_tag|>")
    body = _unmarked(text.replace("<|python_tag|>", "")).strip()
    if not tagged and not body.startswith("{"):
        return body, [], []
    calls, problems, decoder, at = [], [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            if not tagged and not calls:  # text that starts with a brace is an answer, not a call
                return body, [], []
            problems.append(f"error: the tool call is not valid JSON ({e.msg}): {body[at:at + 200]}")
            break
        if not tagged and not calls and not (isinstance(obj, dict) and "name" in obj):
            return body, [], []  # a JSON answer
        call = call_from(obj, "parameters")
        (problems if isinstance(call, str) else calls).append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
        if at < len(body) and body[at] != "{":  # text after the calls: what the turn says besides them
            return body[at:].strip(), calls, problems
    return "", calls, problems


def mistral(text: str) -> Parsed:
    if "[TOOL_CALLS]" not in text:
        return _unmarked(text).strip(), [], []
    content, *parts = text.split("[TOOL_CALLS]")
    calls, problems = [], []
    for part in (_unmarked(p).strip() for p in parts):
        if part.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            try:
                objs = json.loads(part)
            except json.JSONDecodeError as e:
                problems.append(f"error: the tool calls are not valid JSON ({e.msg}): {part[:200]}")
                continue
            for obj in objs if isinstance(objs, list) else [objs]:
                call = call_from(obj)
                (problems if isinstance(call, str) else calls).append(call)
        elif "[ARGS]" in part:  # name[ARGS]{...} (a [CALL_ID]id between them in some versions)
            name, _, arguments = part.partition("[ARGS]")
            _named_call(name.split("[CALL_ID]")[0].strip(), arguments.strip(), calls, problems)
        else:
            problems.append(f"error: [TOOL_CALLS] followed by neither a JSON list nor name[ARGS]{{...}}: {part[:200]}")
    return _unmarked(content).strip(), calls, problems


_HARMONY = re.compile(r"(?:<\|start\|>\w+)?(?P<head>[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?)<\|message\|>"
                      r"(?P<body>.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)", re.S)


def harmony(text: str) -> Parsed:
    if "<|message|>" not in text:  # no channel at all: the text is the answer
        return _unmarked(text).strip(), [], []
    calls, problems, final = [], [], []
    for m in _HARMONY.finditer(text):
        head, body = m.group("head"), m.group("body")
        recipient = re.search(r"to=functions\.([\w.-]+)", head)
        if recipient:
            _named_call(recipient.group(1), body.strip(), calls, problems)
        elif "final" in head:
            final.append(body.strip())
    return (final[-1] if final else ""), calls, problems


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parse: Callable[[str], Parsed]
    marks: tuple[str, ...]  # what its chat template writes (how auto finds it)
    special: bool = False  # its marks are special tokens: the text is read with them kept


# In the order auto tries them: a template that renders tool schemas (whose JSON has "parameters")
# in the Hermes format is hermes, not llama3.
FORMATS = {
    "harmony": ToolFormat("harmony", harmony, ("<|channel|>",), special=True),
    "mistral": ToolFormat("mistral", mistral, ("[TOOL_CALLS]",), special=True),
    "hermes": ToolFormat("hermes", hermes, ("<tool_call>",)),
    "llama3": ToolFormat("llama3", llama3, ("<|python_tag|>", "dictionary of argument name"), special=True),
}
CHOICES = ("auto", *FORMATS, "template")


def tool_format(setting: str, tokenizer) -> ToolFormat:
    """rollout.tool_call_format = `setting` for a model of `tokenizer`."""
    if setting not in CHOICES:
        raise ValueError(f"rollout.tool_call_format={setting!r}: one of {', '.join(CHOICES)}")
    if setting == "template" or (setting == "auto" and getattr(tokenizer, "response_template", None) is not None):
        return ToolFormat("template", lambda text: _with_template(tokenizer, text), ())
    if setting != "auto":
        return FORMATS[setting]
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return next((f for f in FORMATS.values() if any(mark in template for mark in f.marks)), FORMATS["hermes"])


def _with_template(tokenizer, text: str) -> Parsed:
    try:
        message = tokenizer.parse_response(text, prefix="")
    except Exception as e:  # noqa: BLE001 - the model's output did not fit its own format
        return text.strip(), [], [f"error: the reply could not be parsed ({type(e).__name__}: {e})"]
    calls, problems = [], []
    for obj in message.get("tool_calls") or []:
        call = call_from(obj)
        (problems if isinstance(call, str) else calls).append(call)
    return (message.get("content") or "").strip(), calls, problems


# Special tokens that end a turn, which a format that reads special tokens leaves out of the content.
_ENDS = re.compile(r"<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>|</s>|<\|im_end\|>|<\|endoftext\|>|<\|return\|>|"
                   r"<\|end\|>|<\|call\|>")


def _unmarked(text: str) -> str:
    return _ENDS.sub("", text)


class Replies:
    """How a run reads a model's turn (its sampled ids): the text, the reasoning apart from the
    answer, the tool calls in the run's format."""

    def __init__(self, tokenizer, calls: ToolFormat, reasoning: Reasoning):
        self.tokenizer, self.format, self.reasoning = tokenizer, calls, reasoning

    @classmethod
    def of(cls, tokenizer, tool_call_format: str = "auto", reasoning_parser: str = "auto") -> Replies:
        return cls(tokenizer, tool_format(tool_call_format, tokenizer), Reasoning.of(reasoning_parser, tokenizer))

    def text(self, ids: list[int]) -> str:
        """The turn's text: its special tokens kept where the format's marks are special tokens."""
        keep = self.format.special or self.reasoning.kind == "harmony"
        return self.tokenizer.decode(ids, skip_special_tokens=not keep)

    def read(self, text: str) -> tuple[dict, list[ToolCall], list[str]]:
        """A turn's text -> its assistant message (content, reasoning_content where it reasoned;
        the caller adds the calls), its well-formed calls, a problem for each malformed one."""
        reply = self.reasoning.split(text)
        source = text if self.format.name == "harmony" else reply.answer
        content, calls, problems = self.format.parse(source)
        message = {"role": "assistant", "content": content}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.cut:
            message["reasoning_cut"] = True
        return message, calls, problems
