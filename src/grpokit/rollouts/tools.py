"""Tools and environments for multi-turn rollouts, in TRL's conventions.

- A tool is a plain Python function (sync or async) with type hints and a Google-style docstring;
  its JSON schema (transformers' `get_json_schema`) goes to the chat template's `tools` argument.
- An environment is a class (any factory): one instance per rollout; `reset(**row)` may return text
  that is appended to the prompt's last message; its public methods (not `reset`, not
  `get_reward`, no leading underscore) are the rollout's tools; an optional `get_reward()` is one
  more reward source, named after the class.
- The model calls tools in its family's format (rollout.tool_call_format: Hermes / Qwen's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3's, Mistral's, GPT-OSS's
  harmony, or transformers' response parsing): tool_formats.py.
- A call that raises, takes longer than rollout.tool_timeout, names no known tool, has the wrong
  arguments or is not valid JSON answers the model with the error as the tool's result (that is
  how agents learn to recover) and counts as a failure; the run goes on. A tool (or an
  environment's constructor or reset) that calls sys.exit() or raises KeyboardInterrupt stops the
  run instead (user_code.UserCodeExit), saved. A tool declared with *args or **kwargs is refused:
  the model can only call it with named arguments its schema describes.
- The model reads a result as text (a string as it is, anything else as JSON); reward functions
  get a list result as the list, as TRL passes it (`ToolResult.record`).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from grpokit.runtime import signals, user_code
from grpokit.runtime.errors import ConfigError, RunStopped
from grpokit.settings.schema import DataConfig, ModelConfig, RolloutConfig

# An environment's methods that are not tools (TRL's rule, plus names starting with "_").
NOT_TOOLS = ("reset", "get_reward")


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolResult:
    """One call's result: the text the model reads (the return value as it is when a string, else
    as JSON), and the return value itself."""

    name: str  # the tool called
    text: str
    value: object = None
    failed: bool = False

    @classmethod
    def failure(cls, name: str, problem: str) -> ToolResult:
        return cls(name, f"error: {problem}", failed=True)

    def message(self) -> dict:
        """The `tool` message the chat template renders for the model."""
        return {"role": "tool", "name": self.name, "content": self.text}

    def record(self) -> dict:
        """The `tool` message reward functions and completions.jsonl get: TRL's rule, a list result as
        the list (TRL passes it through; reward functions test `isinstance(content, list)`), any
        other as the text the model read."""
        return {"role": "tool", "name": self.name, "content": self.value if isinstance(self.value, list) else self.text}


def schema(fn: Callable, what: str) -> dict:
    """The JSON schema of tool `fn` for the chat template; a ConfigError naming `what` when its
    docstring or type hints cannot say it."""
    from transformers.utils import get_json_schema

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin: get_json_schema says what it lacks
        parameters = ()
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise ConfigError(f"{what}: takes {star}{p.name}, which a tool call cannot fill (the model calls a tool with "
                              "a JSON object of named arguments, each described in its schema): name every argument")
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException, ...
        raise ConfigError(f"{what}: {e}. A tool needs a type hint on every argument and a Google-style docstring "
                          "(a description, then 'Args:' with one line per argument)") from None


def environment_tools(instance) -> dict[str, Callable]:
    """The tools of an environment instance: its public methods but reset and get_reward."""
    return {name: method for name, method in inspect.getmembers(instance, inspect.ismethod)
            if name not in NOT_TOOLS and not name.startswith("_")}


class Tools:
    """A run's tools: the plain functions (rollout.tools) and the environment class
    (rollout.environment), their schemas, and per rollout, what each tool name calls."""

    def __init__(self, tool_names: list[str], environment: str | None, timeout: float | None):
        self.timeout = timeout
        self.functions: dict[str, Callable] = {}
        self.schemas = []
        for name in tool_names:
            fn = user_code.find(f"tool {name!r} (rollout.tools)", name)
            if fn.__name__ in self.functions:
                raise ConfigError(f"rollout.tools names two tools called {fn.__name__!r}: the model calls tools by name")
            self.functions[fn.__name__] = fn
            self.schemas.append(schema(fn, f"tool {name!r} (rollout.tools)"))
        self.environment = self.environment_name = None
        self.has_reward = False  # the environment has get_reward()
        if environment is not None:
            self.environment = user_code.find(f"environment {environment!r} (rollout.environment)", environment)
            self.environment_name = getattr(self.environment, "__name__", environment.rpartition(":")[2])
            # One instance now: a constructor that fails, or a method that is not a well-described
            # tool, is a start-up error rather than a failure at step 1.
            try:
                probe = self._new()
            except EnvironmentFailed as e:
                raise ConfigError(f"{e} (rollout.environment)") from None
            methods = environment_tools(probe)
            self.has_reward = callable(getattr(probe, "get_reward", None))
            self._async_reward = user_code.is_async(getattr(probe, "get_reward", None))
            clash = sorted(set(methods) & set(self.functions))
            if clash:
                raise ConfigError(f"environment {environment!r} has methods named like rollout.tools' functions: {clash}")
            if not methods and not self.functions:
                raise ConfigError(f"environment {environment!r} has no public method the model could call as a tool")
            self.schemas += [schema(m, f"environment {environment!r}: method {n!r}") for n, m in methods.items()]

    @classmethod
    def from_config(cls, r: RolloutConfig, data: DataConfig, model: ModelConfig, tokenizer,
                    model_name: str | None = None) -> Tools | None:
        """The run's tools (rollout.tools, or the task's own when null, and rollout.environment),
        None without any; gives `tokenizer`, model.name's or `model_name`'s, the chat template they
        need (models.use_chat_template). A model trained with tools was saved with that template."""
        from grpokit.models.templates import use_chat_template
        from grpokit.tasks.registry import tool_names

        names = tool_names(r, data)
        tools = cls(names, r.environment, r.tool_timeout) if names or r.environment else None
        use_chat_template(tokenizer, model.chat_template, model_name or model.name, tools is not None,
                          agent=r.agent is not None, kwargs=model.chat_template_kwargs)
        return tools

    def check(self, row: dict, prompt_from_reset: bool = False) -> None:
        """Start one rollout of `row` now: an environment whose reset fails on the data says so at
        start-up; so does one whose reset returns no text when it must give the prompt."""
        try:
            _, text = self.start(row)
        except EnvironmentFailed as e:
            raise ConfigError(f"{e} (on the first training prompt)") from None
        if prompt_from_reset and not (text or "").strip():
            raise ConfigError(f"environment {self.environment_name!r}: reset() returned {text!r}, and there is no dataset: "
                              "without one, the text reset() returns is the prompt (TRL's environment_factory without a "
                              "train_dataset). Return the task's prompt from reset(), or give a dataset (data.path, or "
                              "dataset= in Python) whose rows reset() receives")

    def _new(self):
        try:
            with user_code.exits_caught(f"the constructor of environment {self.environment_name!r}"):
                return self.environment()
        except user_code.UserCodeExit:
            raise
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise EnvironmentFailed(f"environment {self.environment_name!r}: its constructor raised "
                                    f"{type(e).__name__}: {e}") from e

    def start(self, row: dict) -> tuple[object | None, str | None]:
        """A new rollout of `row` (the prompt and every column): its environment instance (None
        without one) and the text its reset() returned (None: nothing to append)."""
        if self.environment is None:
            return None, None
        what = f"environment {self.environment_name!r}"
        instance = self._new()
        if not callable(getattr(instance, "reset", None)):
            raise ConfigError(f"{what} has no reset method (TRL's environments reset(**row) for every rollout)")
        try:
            with user_code.exits_caught(f"{what}: reset()"):
                text = instance.reset(**copy.deepcopy(row))  # the task's own examples stay as they are
        except user_code.UserCodeExit:
            raise
        except Exception as e:  # noqa: BLE001
            raise EnvironmentFailed(f"{what}: reset() raised {type(e).__name__}: {e}") from e
        if text is not None and not isinstance(text, str):
            raise EnvironmentFailed(f"{what}: reset() returned {type(text).__name__}; it may return text to append "
                                    "to the prompt, or None")
        return instance, text

    def callables(self, instance) -> dict[str, Callable]:
        """What each tool name calls in a rollout with environment `instance` (or None)."""
        return {**self.functions, **(environment_tools(instance) if instance is not None else {})}

    def call(self, tools: dict[str, Callable], call: ToolCall) -> ToolResult:
        """Run one call. A failure's text is the error, which the model reads."""
        fn = tools.get(call.name)
        if fn is None:
            return ToolResult.failure(call.name, f"there is no tool named {call.name!r}; the tools are: {', '.join(tools)}")
        what = f"tool {call.name!r}"
        future = None
        # Off the main thread (the pipeline's worker, generating ahead: rollout.max_staleness) no
        # signal ends a call: it runs in a thread of its own, given up on after rollout.tool_timeout.
        main = threading.current_thread() is threading.main_thread()
        try:  # a stop request (SIGTERM) and rollout.tool_timeout end a call that never returns
            with signals.waiting_on(what, self.timeout):
                if user_code.is_async(fn):  # on the long-lived loop; the wait here is what times out
                    future = user_code.submit(fn(**call.arguments), what)
                    result = user_code.wait(future, None if main else self.timeout, what)
                elif main:
                    with user_code.exits_caught(what):
                        result = fn(**call.arguments)
                else:
                    future = user_code.in_thread(lambda: fn(**call.arguments), what)
                    result = user_code.wait(future, self.timeout, what)
        except signals.WaitTimedOut:
            if future is not None:
                future.cancel()
            return ToolResult.failure(call.name, f"{what} did not return within {self.timeout:g} s")
        except (signals.StoppedWhileWaiting, user_code.UserCodeExit):
            if future is not None:
                future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the model reads the error (its own timeouts included), as in production
            return ToolResult.failure(call.name, f"{type(e).__name__}: {e}")
        return ToolResult(call.name, result if isinstance(result, str) else _as_text(result), result)


    @staticmethod
    def rewards(tools: Tools | None) -> tuple[tuple[str, Callable], ...]:
        """The reward functions `tools` bring (RewardSet's `extra`): the environment's get_reward, if any."""
        return (tools.reward(),) if tools is not None and tools.has_reward else ()

    def reward(self) -> tuple[str, Callable]:
        """The environment's get_reward() as a reward function, named after its class (TRL's rule)."""
        what = f"environment {self.environment_name!r}: get_reward()"
        if self._async_reward:
            async def reward(environments, **kwargs):
                return list(await asyncio.gather(*(user_code.exits_caught_async(e.get_reward(), what)
                                                   for e in environments)))
        else:
            def reward(environments, **kwargs):
                return [e.get_reward() for e in environments]
        return self.environment_name, reward


class EnvironmentFailed(RunStopped, RuntimeError):
    """An environment's constructor or reset raised, or reset returned something unusable."""

    in_users_code = True


def _as_text(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def call_message(call: ToolCall) -> dict:
    """A call as it goes into an assistant message (TRL's and the chat templates' shape)."""
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
