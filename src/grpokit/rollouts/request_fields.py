"""What the OpenAI endpoint (endpoint.py) does with each field of a request: honoured, accepted
without effect, or refused with HTTP 400 and a message naming the field and what to do instead.

The rule behind the table: what is trained is the log-prob of each sampled token under the
distribution the run samples from (rollout.temperature, top_p, top_k, min_p). A field that keeps
that true is honoured: `stop` cuts the reply after the token that completes a stop string (the
tokens kept are a prefix of a sample, so their log-probs are still the sampled ones), `max_tokens`
shortens it, `logprobs` returns the log-probs the tokens were sampled with (and `top_logprobs` the most
likely tokens beside each, under the same distribution, from the same sampling pass). A field that would
change the distribution (forcing a tool call, a JSON schema, a logit bias, another temperature) is
refused: training on tokens drawn from another distribution than the one the update assumes is
wrong in a way no metric shows. A field this endpoint does not know is refused too, as OpenAI's
API does, so nothing an agent asks for is dropped without a word.

`FIELDS` is the table (docs/agents.md prints it with `table()`); `asked` applies it to a request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from grpokit.engines.batch import SamplingParams


class RequestError(ValueError):
    """A request the endpoint cannot take: answered with HTTP 400 and its message, and recorded."""


@dataclass
class Asked:
    """What a request asks of its generation, besides its context."""

    max_tokens: int | None = None  # None: no limit of its own (the run's budget still applies)
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives listed beside each token's log-prob
    stream: dict | None = None  # stream options; None: not streamed


# A rule takes the field's value, the request's Asked to fill in, and the generation's sampling
# (the run's: training's, or evaluation's greedy one); it raises RequestError to refuse.
Rule = Callable[[object, Asked, SamplingParams], None]


def _accepted(value, asked: Asked, params: SamplingParams) -> None:
    """Taken, no effect on what is sampled or trained."""


def _unset(*allowed, why: str) -> Rule:
    """Accepted when absent or one of `allowed`; anything else refused with `why`."""
    def rule(value, asked: Asked, params: SamplingParams) -> None:
        if value is not None and value not in allowed:
            raise RequestError(f"{{name}}={value!r}: not supported: {why}")
    rule.doc = (f"refused unless {' or '.join(json.dumps(a) for a in allowed)}: " if allowed else "refused: ") + why
    return rule


def _max_tokens(value, asked: Asked, params: SamplingParams) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{{name}}={value!r}: must be a positive integer")
    asked.max_tokens = value if asked.max_tokens is None else min(asked.max_tokens, value)


def _n(value, asked: Asked, params: SamplingParams) -> None:
    if value not in (None, 1):
        raise RequestError("{name} must be 1: each request is one sample of a rollout (a group's samples are its "
                           "rollouts)")


def _stop(value, asked: Asked, params: SamplingParams) -> None:
    stops = [value] if isinstance(value, str) else value
    if value is None:
        return
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError(f"{{name}}={value!r}: must be a non-empty string or a list of up to 4 of them")
    asked.stop = stops


def _logprobs(value, asked: Asked, params: SamplingParams) -> None:
    if value not in (None, True, False):
        raise RequestError(f"{{name}}={value!r}: must be true or false")
    asked.logprobs = bool(value)


def _count(value, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise RequestError(f"{{name}}={value!r}: must be an integer from 0 to {most}")
    return value


def _legacy_logprobs(value, asked: Asked, params: SamplingParams) -> None:
    """/completions' logprobs: how many alternatives to list beside each token's own log-prob."""
    if value is not None:
        asked.logprobs, asked.top_logprobs = True, _count(value, 5)


def _top_logprobs(needs: str) -> Rule:
    """top_logprobs (after the field that asks for log-probs, `needs`, in FIELDS' order)."""
    def rule(value, asked: Asked, params: SamplingParams) -> None:
        if value is None:
            return
        asked.top_logprobs = _count(value, 20)
        if value and not asked.logprobs:
            raise RequestError(f"{{name}}={value!r} lists alternatives beside each token's log-prob, which the request "
                               f"does not ask for: add {needs}")
    rule.doc = ("honoured: the most likely tokens beside each, under the distribution it was sampled from, from the "
                f"sampling pass (with {needs})")
    return rule


def _sampling(setting: str, run_setting: str) -> Rule:
    """temperature / top_p: accepted when the generation samples at that value, else refused."""
    def rule(value, asked: Asked, params: SamplingParams) -> None:
        if value is None or params.temperature == 0:  # evaluation samples greedily, whatever a request says
            return
        current = getattr(params, setting)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != float(current):
            raise RequestError(f"{{name}}={value!r}: the run samples at {setting}={current} ({run_setting}), and "
                               f"the trained log-probs are of that distribution: leave {{name}} out, or set "
                               f"{run_setting}")
    rule.doc = (f"accepted when it is the run's ({run_setting}), refused otherwise; in evaluation accepted, no effect "
                "(greedy)")
    return rule


def _tool_choice(value, asked: Asked, params: SamplingParams) -> None:
    if value not in (None, "auto"):
        raise RequestError(f"{{name}}={value!r}: not supported: forcing or forbidding a tool call would train tokens "
                           "drawn from another distribution than the model's own; leave it out (\"auto\"), and "
                           "check in the agent what the model called")


def _text_format(value, asked: Asked, params: SamplingParams) -> None:
    """response_format (chat), or the Responses API's text.format."""
    if value is not None and (not isinstance(value, dict) or value.get("type") != "text"):
        raise RequestError(f"{{name}} {value!r}: not supported: decoding constrained to a JSON schema samples from "
                           "another distribution than the model's own, which is what is trained; describe the format "
                           "in the prompt, and parse (and reward) the reply in the agent")


def _responses_text(value, asked: Asked, params: SamplingParams) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise RequestError(f"{{name}}={value!r}: only text.format {{'type': 'text'}} is supported")
    try:
        _text_format(value.get("format"), asked, params)
    except RequestError as e:
        raise RequestError(str(e).replace("{name}", "{name}.format", 1)) from None
    if value.get("verbosity") not in (None, "medium"):
        raise RequestError(f"{{name}}.verbosity={value['verbosity']!r}: not supported: the model has no such setting")


def _include(value, asked: Asked, params: SamplingParams) -> None:
    """The Responses API's include: only the output text's log-probs can be included."""
    if value is None:
        return
    other = [v for v in value if v != "message.output_text.logprobs"] if isinstance(value, list) else [value]
    if other:
        raise RequestError(f"{{name}}: {other!r} not supported: only message.output_text.logprobs (the sampled tokens' "
                           "log-probs) can be included")
    asked.logprobs = bool(value)


def _reasoning(value, asked: Asked, params: SamplingParams) -> None:
    if value is not None and not isinstance(value, dict):
        raise RequestError(f"{{name}}={value!r}: must be an object")
    if value and any(v is not None for v in value.values()):
        raise RequestError(f"{{name}}={value!r}: not supported: the model being trained has no reasoning setting; a "
                           "thinking template's switch belongs in model.chat_template")


def _stream(value, asked: Asked, params: SamplingParams) -> None:
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{{name}} must be true or false, got {value!r}")
    asked.stream = {} if value else None


def _stream_options(value, asked: Asked, params: SamplingParams) -> None:
    """After `stream` (FIELDS' order)."""
    if value is None:
        return
    if asked.stream is None:
        raise RequestError("{name} is only allowed with stream: true")
    if not isinstance(value, dict) or set(value) - {"include_usage", "include_obfuscation"}:
        raise RequestError(f"{{name}}: only include_usage is supported, got {value!r}")
    asked.stream = {"include_usage": bool(value.get("include_usage"))}


def _tools(value, asked: Asked, params: SamplingParams) -> None:
    other = [t.get("type") if isinstance(t, dict) else t for t in value or () if not isinstance(t, dict)
             or t.get("type", "function") != "function"]
    if other:
        raise RequestError(f"{{name}}: only function tools are supported, got {other!r}; a built-in tool (web search, "
                           "files, code) is the agent's to run: give it to the model as a function")


def _previous_response(value, asked: Asked, params: SamplingParams) -> None:
    if value is not None:
        raise RequestError("{name}: not supported: this endpoint stores no responses; send the whole conversation as "
                           "input (the Agents SDK does so unless told to chain responses)")


# Honoured by the route itself (its messages, prompt or input), or checked by Endpoint._accepted (model).
_ROUTE = _accepted
_COMMON = {
    "model": (_ROUTE, "must be `grpokit` (the `model` argument an agent is given) or absent"),
    "stream": (_stream, "honoured: server-sent events of the whole reply, generated first"),
    "stream_options": (_stream_options, "honoured: include_usage"),
    "n": (_n, "1 only: each request is one sample of its rollout"),
    "temperature": (_sampling("temperature", "rollout.temperature"), None),
    "top_p": (_sampling("top_p", "rollout.top_p"), None),
    "user": (_accepted, "accepted, no effect"),
    "metadata": (_accepted, "accepted, no effect"),
    "store": (_accepted, "accepted, no effect (nothing is stored; the run records every exchange)"),
    "service_tier": (_accepted, "accepted, no effect"),
    "safety_identifier": (_accepted, "accepted, no effect"),
    "prompt_cache_key": (_accepted, "accepted, no effect (a rollout's prefix is reused token in, token out anyway)"),
    "seed": (_unset(why="each rollout samples from its own seed (train.seed), which makes the run reproducible"),
             None),
    "logit_bias": (_unset({}, why="a bias changes the distribution sampled from, and training would not apply it"),
                   None),
    "frequency_penalty": (_unset(0, why="a penalty changes the distribution sampled from, and training would "
                                 "not apply it"), None),
    "presence_penalty": (_unset(0, why="a penalty changes the distribution sampled from, and training would "
                                "not apply it"), None),
}
_CHAT = {
    "messages": (_ROUTE, "honoured: rendered by the chat template (text content parts only)"),
    "tools": (_tools, "honoured: function tools, rendered by the chat template"),
    "tool_choice": (_tool_choice, "\"auto\" only: forcing or forbidding a call is refused"),
    "parallel_tool_calls": (_unset(True, why="the model may write several calls in one reply, and that is what is "
                                   "trained"), None),
    "max_tokens": (_max_tokens, "honoured: can only shorten a reply (the run's rollout budget applies)"),
    "max_completion_tokens": (_max_tokens, "honoured, as max_tokens"),
    "stop": (_stop, "honoured: the reply ends after the token that completes a stop string; the text returned "
                    "stops before it"),
    "logprobs": (_logprobs, "honoured: each token's log-prob under the distribution it was sampled from"),
    "top_logprobs": (_top_logprobs("logprobs: true"), None),
    "response_format": (_text_format, "{\"type\": \"text\"} only: JSON modes and schemas are refused"),
    "reasoning_effort": (_unset(why="the model being trained has no such setting"), None),
    "verbosity": (_unset("medium", why="the model being trained has no such setting"), None),
    "modalities": (_unset(["text"], why="only text is generated"), None),
    "audio": (_unset(why="only text is generated"), None),
    "prediction": (_unset(why="predicted outputs are not supported"), None),
    "web_search_options": (_unset(why="web search is the agent's to run, as a function tool"), None),
    "functions": (_unset(why="the deprecated form of tools: send tools"), None),
    "function_call": (_unset(why="the deprecated form of tool_choice"), None),
}
_COMPLETIONS = {
    "prompt": (_ROUTE, "honoured: one string"),
    "max_tokens": (_max_tokens, "honoured: can only shorten a reply (the run's rollout budget applies)"),
    "stop": _CHAT["stop"],
    "logprobs": (_legacy_logprobs, "honoured: each token's log-prob, and up to 5 alternatives, under the "
                                   "distribution it was sampled from"),
    "echo": (_unset(False, why="the prompt is not returned"), None),
    "suffix": (_unset(why="insertion is not supported"), None),
    "best_of": (_unset(1, why="each request is one sample of its rollout"), None),
}
_RESPONSES = {
    "input": (_ROUTE, "honoured: text, or message, function_call and function_call_output items"),
    "instructions": (_ROUTE, "honoured: a system message before the input"),
    "tools": (_tools, "honoured: function tools, rendered by the chat template"),
    "tool_choice": _CHAT["tool_choice"],
    "parallel_tool_calls": _CHAT["parallel_tool_calls"],
    "max_output_tokens": (_max_tokens, "honoured: can only shorten a reply (the run's rollout budget applies)"),
    "include": (_include, "message.output_text.logprobs honoured; anything else refused"),
    "top_logprobs": (_top_logprobs("include: [\"message.output_text.logprobs\"]"), None),
    "text": (_responses_text, "format {\"type\": \"text\"} only: JSON schemas are refused"),
    "reasoning": (_reasoning, "no effort or summary: the model being trained has no such setting"),
    "truncation": (_unset("disabled", why="nothing is dropped from a conversation; a context over the run's budget "
                          "ends the reply with status incomplete"), None),
    "previous_response_id": (_previous_response, "refused: no responses are stored; send the whole conversation"),
    "conversation": (_unset(why="no conversations are stored; send the whole conversation as input"), None),
    "prompt": (_unset(why="stored prompts are not supported; send the text as input"), None),
    "background": (_unset(False, why="a rollout's requests are answered in the request"), None),
    "max_tool_calls": (_unset(why="the model's calls are what is trained; stop calling tools in the agent"), None),
}
FIELDS: dict[str, dict[str, tuple[Rule, str | None]]] = {
    "chat": {**_COMMON, **_CHAT},
    "completions": {**{k: v for k, v in _COMMON.items() if k not in ("store", "service_tier", "safety_identifier",
                                                                    "prompt_cache_key", "metadata")}, **_COMPLETIONS},
    "responses": {**{k: v for k, v in _COMMON.items() if k not in ("n", "seed", "logit_bias", "frequency_penalty",
                                                                  "presence_penalty")}, **_RESPONSES},
}
ROUTES = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses"}


def asked(api: str, body: dict, params: SamplingParams) -> Asked:
    """What request `body` to route `api` ("chat", "completions", "responses") asks, every field
    checked by FIELDS; RequestError names the first field refused (an unknown one included)."""
    rules = FIELDS[api]
    unknown = sorted(set(body) - set(rules))
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for {ROUTES[api]}: "
                           "every field this endpoint takes is honoured or refused by name (docs/agents.md)")
    out = Asked()
    for name, (rule, _) in rules.items():  # in the table's order: stream before stream_options
        if name in body:
            try:
                rule(body[name], out, params)
            except RequestError as e:
                raise RequestError(str(e).replace("{name}", name)) from None
    return out


def table() -> str:
    """FIELDS as the Markdown table docs/agents.md holds: every field of each route, and what it does."""
    lines = ["| field | /chat/completions | /completions | /responses |", "|---|---|---|---|"]
    names = list(dict.fromkeys(name for rules in FIELDS.values() for name in rules))
    for name in names:
        cells = []
        for api in FIELDS:
            rule, doc = FIELDS[api].get(name, (None, None))
            cells.append("" if rule is None else doc or rule.doc)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
