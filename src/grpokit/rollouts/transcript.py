"""What one rollout's agent sent and got through the endpoint (endpoint.py), token in, token out.

A chat request whose messages are the previous request's, then the reply it got, then new
messages (tool results, a user turn), is that exchange's ids as they were (prompt and sampled
tokens, never decoded and encoded again) and the new messages as the chat template renders them
after an assistant turn (conversation.turn_segment). A request that does not extend the previous
exchange so, or whose history the template renders otherwise than before (a thinking model
dropping earlier reasoning), starts a new sequence. A completions request continues the previous
one when its prompt is the previous prompt and the reply's text (stop string included) followed by
more text.
"""

import json
import time
from dataclasses import asdict, dataclass, field

from grpokit.rollouts.conversation import turn_segment
from grpokit.rollouts.request_fields import RequestError
from grpokit.runtime.errors import ConfigError


@dataclass
class Exchange:
    """One generated request of a rollout."""

    prompt: list[int]  # the context's ids
    extends: bool  # prompt = the previous exchange's prompt + sampled + a segment of new messages
    sampled: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    entropies: list[float] | None = None
    # The request's top_logprobs: beside each sampled token, the most likely ones, [[id, log-prob], ...].
    alternatives: list[list[list]] | None = None
    finish: str = "stop"
    # Where the reply's text ends, in the decoded sampled tokens: before the stop string the
    # request named (its tokens are kept: the model sampled them), or None: all of it.
    text_end: int | None = None



class Transcript:
    """What one rollout's agent sent and got (token in, token out: module docstring)."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.exchanges: list[Exchange] = []
        self.start = 0  # the exchange that begins the current sequence (the token budget counts from its prompt)
        self.errors: list[str] = []  # requests refused (messages the template cannot render, ...)
        self.problems: list[str] = []  # the replies' malformed tool calls (tool_formats.Replies)
        self.first_messages: list[dict] | None = None
        self.last_messages: list[dict] | None = None  # the last chat request's
        self._tools: list[dict] | None = None
        self._rendered: str | None = None  # its rendering, with the generation prompt
        self.last_reply: dict | None = None  # the assistant message it got
        self.pending = False  # a request of it is waiting or being generated
        self.wait_s = 0.0  # seconds its requests have waited for generation (rollout.agent_timeout leaves them out)
        self.waiting_since: float | None = None  # when the one pending began waiting
        self._text: str | None = None  # the last completions request's prompt and reply, as text

    def waited(self) -> float:
        """Seconds its requests have waited for generation, the one pending included."""
        since = self.waiting_since
        return self.wait_s + (0.0 if since is None else time.monotonic() - since)

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's error, told to the agent and counted
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    def chat(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], bool]:
        """A chat request's context ids, and whether it extends the previous exchange."""
        rendered = self.render(messages, tools)
        last = self.exchanges[-1] if self.exchanges else None
        n = len(self.last_messages or ())
        extends = (last is not None and self.last_messages is not None and tools == self._tools and len(messages) > n + 1
                   and messages[:n] == self.last_messages and same_reply(messages[n], self.last_reply)
                   and self._renders_as_before(rendered, messages[:n + 1], tools))
        if extends:
            after_eos = last.sampled[-1] if last.sampled and last.sampled[-1] in self.eos_ids else None
            try:
                ids = last.prompt + last.sampled + turn_segment(self.tokenizer, messages[n + 1:], tools, after_eos)
            except ConfigError:  # the template tells no turn apart from the history before it
                extends = False
        if not extends:
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if self.first_messages is None:
            self.first_messages = messages
        self.last_messages, self._tools, self._rendered, self._text = messages, tools, rendered, None
        return ids, extends

    def _renders_as_before(self, rendered: str, history: list[dict], tools: list[dict] | None) -> bool:
        """Whether `rendered` (a request's messages) begins with the last request's context and the
        reply it got as the template renders them as the last turn: a template that renders
        history otherwise once a turn follows (a thinking model's dropping earlier reasoning)
        does not."""
        try:
            before = self.tokenizer.apply_chat_template(history, tools=tools, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot end on an assistant turn: no telling
            return False
        return rendered.startswith(self._rendered) and rendered.startswith(before)

    def completion(self, prompt: str) -> tuple[list[int], bool]:
        """A completions request's context ids: the previous exchange's ids and the new text's when
        its prompt is the previous prompt and reply followed by more text."""
        last = self.exchanges[-1] if self.exchanges else None
        extends = last is not None and self._text is not None and prompt.startswith(self._text) and prompt != self._text
        if extends:
            ids = last.prompt + last.sampled + self.tokenizer(prompt[len(self._text):], add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        self.last_messages, self._text = None, prompt
        return ids, extends

    def replied(self, reply: dict | None, text: str) -> None:
        """What the last request was answered (the trainer's thread recorded its Exchange)."""
        self.last_reply = reply
        if self._text is not None:
            self._text += text

    def record(self) -> dict:
        """What the trainer builds the rollout's row from, as JSON (a rollout server's answer)."""
        return {"exchanges": [asdict(e) for e in self.exchanges], "errors": self.errors, "problems": self.problems,
                "first_messages": self.first_messages, "last_messages": self.last_messages,
                "last_reply": self.last_reply}

    @classmethod
    def from_record(cls, record: dict, tokenizer, eos_ids) -> "Transcript":
        t = cls(tokenizer, set(eos_ids))
        t.exchanges = [Exchange(**e) for e in record["exchanges"]]
        t.errors, t.problems, t.first_messages = record["errors"], record["problems"], record["first_messages"]
        t.last_messages, t.last_reply = record["last_messages"], record["last_reply"]
        return t


def same_reply(message: dict, reply: dict | None) -> bool:
    """Whether `message` (sent back by an agent) is the assistant `reply` it was given."""
    if reply is None or message.get("role") != "assistant" or (message.get("content") or "") != (reply["content"] or ""):
        return False
    return _calls(message.get("tool_calls")) == _calls(reply.get("tool_calls"))


def _calls(calls) -> list:
    out = []
    for call in calls or ():
        function = call.get("function", call)
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        out.append((function.get("name"), arguments))
    return out
