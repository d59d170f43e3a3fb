"""A completion's reasoning apart from its answer (model.reasoning_parser), as vLLM's reasoning
parsers and TRL hand them to reward functions: the assistant message's `content` is the answer,
its `reasoning_content` the reasoning.

- `think`: `<think>reasoning</think>answer` (Qwen3, Qwen3.5, DeepSeek-R1, and any model asked to
  write the tags). The opening tag may be the generation prompt's (a template that opens the block
  for the model, as Qwen3.5's does): then a completion without `</think>` is reasoning cut short.
  Without an opening tag anywhere, a completion without `</think>` is all answer.
- `harmony`: GPT-OSS's channels; the reasoning is the `analysis` channel, the answer the `final`
  one (rollouts/tool_formats.py reads the `commentary` channel's tool calls).
- `none`: the whole text is the answer.

`auto` picks from the chat template: `harmony` where it writes `<|channel|>`, `think` where it writes
`<think>`, else `none`. A completion whose reasoning never ended (cut at the token budget) is said:
its `reasoning_cut` is true and its answer is empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PARSERS = ("auto", "think", "harmony", "none")
THINK, END = "<think>", "</think>"
_CHANNEL = re.compile(r"<\|channel\|>(\w+)(?:[^<]|<\|constrain\|>)*<\|message\|>(.*?)"
                      r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)", re.DOTALL)


@dataclass(frozen=True)
class Reply:
    """A completion's text, split."""

    answer: str  # what the reward functions read as the reply (`content`)
    reasoning: str | None = None  # None: the completion has no reasoning
    cut: bool = False  # the reasoning never ended: the completion was cut inside it

    def message(self) -> dict:
        """The assistant message of TRL's completions: content, and reasoning_content where there is reasoning."""
        message = {"role": "assistant", "content": self.answer}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.cut:
            message["reasoning_cut"] = True
        return message


@dataclass(frozen=True)
class Reasoning:
    """A run's reasoning parser: `kind` (PARSERS but auto), and whether the generation prompt opens
    the reasoning block (`opened`: the model writes only its end)."""

    kind: str
    opened: bool = False

    @classmethod
    def of(cls, setting: str, tokenizer) -> Reasoning:
        """model.reasoning_parser = `setting` for a model of `tokenizer` (its chat template)."""
        if setting not in PARSERS:
            raise ValueError(f"model.reasoning_parser={setting!r}: one of {', '.join(PARSERS)}")
        template = str(getattr(tokenizer, "chat_template", None) or "")
        kind = setting if setting != "auto" else \
            "harmony" if "<|channel|>" in template else "think" if THINK in template else "none"
        return cls(kind, kind == "think" and _opens(tokenizer))

    def split(self, text: str) -> Reply:
        """`text` (a completion decoded) as its answer and reasoning."""
        if self.kind == "think":
            return _split_think(text, self.opened)
        if self.kind == "harmony":
            return _split_harmony(text)
        return Reply(text)


def _split_think(text: str, opened: bool) -> Reply:
    if END in text:
        before, after = text.split(END, 1)
        reasoning = before.split(THINK, 1)[1] if THINK in before else before
        return Reply(after.lstrip("\n"), reasoning.strip("\n"))
    stripped = text.lstrip()
    if opened or stripped.startswith(THINK):  # an opened block that never closed
        return Reply("", stripped[len(THINK):].strip("\n") if stripped.startswith(THINK) else text.strip("\n"), cut=True)
    return Reply(text)


def _split_harmony(text: str) -> Reply:
    channels = _CHANNEL.findall(text)
    if not channels:
        return Reply(text)
    analysis = "\n".join(m.strip() for c, m in channels if c == "analysis")
    final = [m for c, m in channels if c == "final"]
    commentary = any(c == "commentary" for c, _ in channels)
    ended = final or commentary or re.search(r"<\|channel\|>analysis.*?<\|end\|>", text, re.DOTALL)
    return Reply(final[-1].strip() if final else "", analysis if analysis else None, cut=not ended)


def _opens(tokenizer) -> bool:
    """Whether the template's generation prompt ends inside an opened `<think>` block."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a plain question tells nothing
        return False
    tail = text.rstrip()
    return tail.endswith(THINK) or (THINK in tail[-40:] and END not in tail[tail.rindex(THINK):])
