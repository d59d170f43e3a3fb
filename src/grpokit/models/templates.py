"""Chat templates: model.chat_template (a Jinja file that replaces the model's own, saved with the
trained model), and with tools a template that can express them (their schemas, the assistant's
calls, the tool results). SmolLM2's cannot, so the bundled model (and tiny-random, which shares its
tokenizer) then uses grpokit's templates/chatml_tools.jinja: ChatML, the tokens SmolLM2 was
trained with, with tools in the Hermes format.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpokit.models.bundled import BUNDLED, TINY
from grpokit.runtime.errors import ConfigError

TOOLS_TEMPLATE = Path(__file__).parents[1] / "templates" / "chatml_tools.jinja"


def use_chat_template(tokenizer, path: str | None, model_name: str, tools: bool, agent: bool = False,
                      kwargs: dict | None = None) -> None:
    """Give `tokenizer` model.chat_template (`path`), or with `tools` (or an `agent`, whose requests
    may carry tools) on the bundled model grpokit's template with tools, and model.chat_template_kwargs
    (`kwargs`: with_arguments); with `tools`, a template that cannot express them is refused."""
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"model.chat_template={path}: no such file")
        tokenizer.chat_template = Path(path).read_text()
    elif (tools or agent) and model_name in (BUNDLED, TINY) and not speaks_tools(tokenizer):
        tokenizer.chat_template = TOOLS_TEMPLATE.read_text()
    if kwargs:
        tokenizer.chat_template = with_arguments(tokenizer.chat_template, kwargs)
    if tools and not speaks_tools(tokenizer):
        where = f"the template in {path}" if path is not None else f"{model_name}'s chat template"
        raise ConfigError(f"{where} cannot express tools (their schemas, the assistant's tool calls and the tool "
                          "results do not all appear when it renders them), and rollout.tools / rollout.environment "
                          f"are set: set model.chat_template to a template file that can (grpokit's ChatML one is "
                          f"{TOOLS_TEMPLATE})")


# What transformers passes every rendering itself: not a chat_template_kwargs key.
RENDERING = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token",
             "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now")


def with_arguments(template, kwargs: dict):
    """`template` (a Jinja chat template, or a dict of named ones) rendering as if every call passed
    `kwargs` (model.chat_template_kwargs, as TRL's chat_template_kwargs do): each the default of its
    variable, set first, so that every rendering (prompts, tool results, an agent's requests, the
    trained model's) gets them, and a caller that passes one (at inference) still decides it."""
    if template is None:
        raise ConfigError("model.chat_template_kwargs is set, and the model has no chat template to pass them to")
    if isinstance(template, dict):
        return {name: with_arguments(t, kwargs) for name, t in template.items()}
    for key in kwargs:
        if not str(key).isidentifier() or key in RENDERING:
            raise ConfigError(f"model.chat_template_kwargs: {key!r} is not an argument of the template's own (the "
                              f"rendering passes {', '.join(RENDERING[:5])}, ... itself)")
    sets = "".join(f"{{%- if {key} is not defined %}}{{%- set {key} = {_literal(value)} %}}{{%- endif %}}"
                   for key, value in kwargs.items())
    return sets + template


def _literal(value) -> str:
    """`value` as a Jinja literal."""
    if value is None:
        return "none"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(str(k))}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_literal, value)) + "]"
    return json.dumps(value, ensure_ascii=False)  # true, false, numbers, strings


def speaks_tools(tokenizer) -> bool:
    """Whether the chat template renders a tool's schema, an assistant's call and the tool's result."""
    probe = {"type": "function", "function": {"name": "grpokit_probe_tool", "description": "grpokit_probe_description",
                                              "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                                             "required": ["x"]}}}
    messages = [
        {"role": "user", "content": "grpokit_probe_user"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "grpokit_probe_tool", "arguments": {"x": "grpokit_probe_value"}}}]},
        {"role": "tool", "name": "grpokit_probe_tool", "content": "grpokit_probe_result"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[probe], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that raises on these messages cannot express them
        return False
    return all(s in text for s in ("grpokit_probe_description", "grpokit_probe_value", "grpokit_probe_result"))

