"""Reward functions, with TRL's calling convention: f(prompts=..., completions=..., **columns).

Each returns one float (or None: not applicable) per completion. Besides the dataset's columns,
functions receive what TRL 1.16 passes (`prompts`, `completions`, `completion_ids`,
`trainer_state`, `log_metric`, `log_extra`, and `environments` with an environment) and
`finish_reasons` ("stop" or "length" per completion); TRL-style functions that take **kwargs
simply ignore what they do not use. `async def` functions run concurrently. A function is named in
configs by a built-in name, by `package.module:function`, or by `path/to/file.py:function`.

`log_metric(name, value)` adds a metric to the step's row (the mean of the values logged for it,
all processes), `log_extra(column, values)` a column to the step's completions.jsonl records (one
value per completion of the call): `RewardLog`.

`RewardSet` calls them and sums them with weights. A None is left out: the total is the weighted
sum of the functions that applied, and a completion no function applied to has reward NaN, which
the advantage function turns into advantage 0. A function that raises, returns the wrong number of
values, or returns NaN / infinity stops the run with an error that names it and shows the
completion.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path

import torch

from grpokit.runtime import signals, user_code
from grpokit.runtime.errors import ConfigError, RunStopped
from grpokit.tasks.task import RESERVED


def completion_text(completion) -> str:
    """The reply in TRL's completion shapes: a plain string, or a list of messages (conversational;
    in a multi-turn rollout, its last assistant message is the reply: the tool results and the
    turns that called tools come before). Shared by the built-in reward functions."""
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if m.get("role", "assistant") == "assistant"]
    return replies[-1]["content"] if replies else ""


def written_text(completion) -> str:
    """The reply with its reasoning back in <think> tags before it, where model.reasoning_parser
    took it apart (what a format reward reads): completion_text otherwise."""
    if isinstance(completion, str):
        return completion
    replies = [m for m in completion if m.get("role", "assistant") == "assistant"]
    if not replies or replies[-1].get("reasoning_content") is None:
        return completion_text(completion)
    reasoning, answer = replies[-1]["reasoning_content"], replies[-1]["content"] or ""
    return f"<think>\n{reasoning}" + ("" if replies[-1].get("reasoning_cut") else f"\n</think>\n\n{answer}")


# The built-in reward functions: name -> module:function, imported when a run names them.
BUILTIN_REWARDS = {
    "math_accuracy": "grpokit.rewards.math_answer:math_accuracy",
    "think_format": "grpokit.rewards.math_answer:think_format",
    "format": "grpokit.rewards.math_answer:format_reward",
    "length": "grpokit.rewards.length:length",
    "overlong": "grpokit.rewards.length:overlong",
    "reward_model": "grpokit.rewards.reward_model:reward_model",
    "exact_answer": "grpokit.rewards.exact_answer:exact_answer",
    "leading_number": "grpokit.rewards.exact_answer:leading_number",
    "named_answer": "grpokit.rewards.word_answer:named_answer",
    "judge": "grpokit.rewards.judge:judge",
    "reasoning_gym": "grpokit.rewards.reasoning_gym:reasoning_gym",
}
# Functions a program registers by name (REWARD_FUNCTIONS["mine"] = fn), named in configs like
# the built-ins; they win over a built-in of the same name.
REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {}


# The keys of a completion's record (completions.jsonl, grpokit eval --output) that log_extra's
# columns may not take; nor may a column start with "rewards/".
RECORD_KEYS = ("step", "prompt", "completion", "finish_reason", "reward", "rewards", "index", "sample", "length",
               "truncated")
# grpokit's own metric names and namespaces (training/, sampling/evaluation.py), which log_metric may not take.
OWN_METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "grad_norm", "learning_rate",
               "num_tokens", "skipped_steps", "step_time", "staleness", "step")
OWN_NAMESPACES = ("rewards/", "completions/", "clip_ratio/", "time/", "tools/", "turns/", "agents/", "sampling/",
                  "dynamic_sampling/", "eval/", "distill/", "partial/", "staleness/")


class RewardLog:
    """What reward functions log through TRL's `log_metric` and `log_extra` while scoring one batch
    of completions: the values of each metric, and each extra column (one value per completion of
    the batch). A bad name or value raises inside the reward function that logged it, so the error
    names that function."""

    def __init__(self, n: int):
        self.n = n  # completions scored
        # Each value with the completions of the call that logged it: a metric's value over several
        # calls (an evaluation's chunks, processes, dynamic sampling's rounds) is their mean weighted
        # so, as if one call had scored them all (distributed.means).
        self.metrics: dict[str, list[tuple[float, int]]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or name in OWN_METRICS or name.startswith(OWN_NAMESPACES):
            raise ValueError(f"log_metric({name!r}, ...): {name!r} is one of grpokit's own metric names "
                             f"({', '.join(OWN_METRICS)}, and those under {', '.join(OWN_NAMESPACES)}): name it otherwise")
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a number")
        self.metrics.setdefault(name, []).append((float(value), self.n))

    def log_extra(self, column: str, values: list) -> None:
        if not isinstance(column, str) or column in RECORD_KEYS or column.startswith("rewards/"):
            raise ValueError(f"log_extra({column!r}, ...): {column!r} is a key of the completion records already "
                             f"({', '.join(RECORD_KEYS)}, rewards/<function>): name the column otherwise")
        if hasattr(values, "tolist"):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != self.n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"log_extra({column!r}, ...) got {got} for the {self.n} completions it was called with: "
                             "one value per completion")
        self.columns[column] = list(values)

    def record(self, i: int) -> dict:
        """The extra columns of completion i."""
        return {column: values[i] for column, values in self.columns.items()}


def trainer_state(step: int, max_steps: int, per_step: int, epoch: float = 0.0, tokens: int = 0, main: bool = True):
    """The `trainer_state` reward functions receive after `step` of `max_steps` steps of a run
    making `per_step` optimizer updates a step (train.updates_per_step x algorithm.num_iterations):
    a transformers TrainerState in TRL's units, optimizer updates, so that global_step / max_steps is
    the share of the run done, as in TRL."""
    from transformers import TrainerState

    return TrainerState(global_step=step * per_step, max_steps=max_steps * per_step, epoch=epoch,
                        num_input_tokens_seen=tokens, is_local_process_zero=main, is_world_process_zero=main)


def merge_metrics(into: dict[str, list[tuple]], more: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """Logged metric values of two batches as one."""
    return {name: [*into.get(name, ()), *more.get(name, ())] for name in {**into, **more}}


class RewardError(RunStopped, ValueError):
    """A reward function failed; the message names it and shows the prompt and completion."""

    in_users_code = True


def _where(error: BaseException) -> str:
    """The line of the user's code (outside grpokit) where `error` was raised, as "\n  at file:line: code"."""
    import traceback

    package = str(Path(__file__).resolve().parent.parent)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not str(Path(f.filename).resolve()).startswith(package)]
    if not frames:
        return ""
    f = frames[-1]
    return f"\n  at {f.filename}:{f.lineno}" + (f": {f.line.strip()}" if f.line else "")


def _short(value, limit: int = 300) -> str:
    if isinstance(value, list):  # messages: a prompt, or a completion with its tool turns
        text = "".join(str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in value)
    else:
        text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


class RewardSet:
    """Reward functions called with TRL's convention and summed with weights (see module doc)."""

    def __init__(self, specs: tuple[tuple[str, float, dict], ...], timeout: float | None = None,
                 extra: tuple[tuple[str, Callable], ...] = (), teacher: bool = False, reasoning=None):
        """specs: (name, weight, arguments) of the functions configured; extra: (name, function)
        of others the run brings (an environment's get_reward), weight 1; teacher: a teacher's
        per-token signal is the run's (distill.teacher), so no function is needed: without one,
        every completion's reward is 0; reasoning: how a completion's reasoning is told apart from
        its answer for the functions (models.reasoning.Reasoning; None: it is not)."""
        self.timeout = timeout  # seconds one call may take (reward.timeout); None: no limit
        self.reasoning = reasoning
        # Metric keys (rewards/<name>/mean) name a file's function without its folders.
        self.names = [name.rsplit("/", 1)[-1] for name, _, _ in specs] + [name for name, _ in extra]
        if not self.names and not teacher:
            raise ConfigError("nothing gives a reward: reward.functions is not set (reward_functions= in Python), the "
                              "data brings none (a dataset or an environment's prompts never do), and there is no "
                              "environment with a get_reward() method: name reward functions")
        if len(set(self.names)) < len(self.names):
            raise ConfigError(f"reward.functions names a function twice: {self.names}")
        self.weights = [weight for _, weight, _ in specs] + [1.0] * len(extra)
        self.specs = [(name, get_reward_function(name), arguments) for name, _, arguments in specs]
        self.specs += [(name, fn, {}) for name, fn in extra]
        self.functions = [_bind(name, fn, arguments) for name, fn, arguments in self.specs]

    def check_arguments(self, columns, environments: bool = False) -> None:
        """Every function can be called with what it will be given: TRL's arguments (RESERVED),
        `environments` with an environment, and the data's `columns`, by name. A function that takes
        neither **kwargs nor one of them, or that needs an argument nothing provides, is a
        ConfigError now rather than at step 1."""
        given = {*RESERVED, *columns, *(["environments"] if environments else [])}
        for name, fn, arguments in self.specs:
            try:
                parameters = inspect.signature(fn).parameters.values()
            except (TypeError, ValueError):  # a builtin or C function: nothing to read
                continue
            named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            needed = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                      and p.default is p.empty}
            unnamed = sorted(given - named - set(arguments))
            if unnamed and not any(p.kind is p.VAR_KEYWORD for p in parameters):
                raise ConfigError(f"reward function {name!r} takes no argument {', '.join(map(repr, unnamed))}, which "
                                  f"every call passes (reward functions get {', '.join(RESERVED)} and each column of "
                                  "the data by name): add **kwargs to its parameters")
            missing = sorted(needed - given - set(arguments))
            if missing:
                raise ConfigError(f"reward function {name!r} needs {', '.join(map(repr, missing))}, which no column of "
                                  f"the data provides (columns: {', '.join(sorted(columns)) or 'none'}); or set it in "
                                  f"reward.functions: {{name: {name}, {': ..., '.join(missing)}: ...}}")

    def __call__(
        self, examples: list, completions: list, finish_reasons: list[str], completion_ids: list | None = None,
        environments: list | None = None, prompts: list | None = None, state=None, log: RewardLog | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total rewards (N,) and each function's (N,), NaN where not applicable; N = len(completions).
        environments: each completion's environment instance (TRL passes them), with one; prompts:
        each completion's prompt as the model saw it (default: its example's); state: the
        `trainer_state` (a transformers TrainerState); log: what log_metric / log_extra record."""
        if not self.names:  # a teacher's signal alone (distill.teacher)
            return torch.zeros(len(completions)), {}
        prompts = [e.prompt for e in examples] if prompts is None else prompts
        columns = {k: [e.columns.get(k) for e in examples] for k in dict.fromkeys(k for e in examples for k in e.columns)}
        log = RewardLog(len(completions)) if log is None else log
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      finish_reasons=finish_reasons, trainer_state=state, log_metric=log.log_metric,
                      log_extra=log.log_extra, **columns)
        if environments is not None:
            kwargs["environments"] = environments
        values: dict[str, list] = {}
        pending = []  # the async functions, awaited together
        for name, fn in zip(self.names, self.functions):
            if user_code.is_async(fn):
                pending.append((name, fn))
            else:
                values[name] = self._call(name, fn, kwargs)
        if pending:
            async def run_all():
                return await asyncio.gather(*(asyncio.wait_for(user_code.exits_caught_async(
                    fn(**kwargs), f"reward function {name!r}"), self.timeout) for name, fn in pending),
                    return_exceptions=True)

            what = f"reward function(s) {', '.join(repr(name) for name, _ in pending)}"
            future = user_code.submit(run_all(), what)
            try:  # each function's time limit is asyncio's; a stop request ends the wait for them all
                with signals.waiting_on(what):
                    results = future.result()
            except signals.StoppedWhileWaiting:
                future.cancel()
                raise
            for (name, fn), result in zip(pending, results):
                if isinstance(result, (asyncio.TimeoutError, TimeoutError)):
                    raise self._timed_out(name)
                if isinstance(result, user_code.UserCodeExit):
                    raise result
                if isinstance(result, BaseException):
                    self._raise(name, fn, kwargs, result)
                values[name] = result
        per_function = {name: self._check(name, values[name], prompts, completions) for name in self.names}
        stacked = torch.stack([w * per_function[n] for n, w in zip(self.names, self.weights)])  # (F, N)
        applied = ~torch.isnan(stacked)  # (F, N)
        total = torch.where(applied, stacked, torch.zeros_like(stacked)).sum(0)  # (N,)
        total = torch.where(applied.any(0), total, torch.full_like(total, float("nan")))  # (N,)
        return total, per_function

    def _call(self, name, fn, kwargs) -> list:
        try:  # a stop request (SIGTERM) and reward.timeout end a call that never returns
            with signals.waiting_on(f"reward function {name!r}", self.timeout), \
                    user_code.exits_caught(f"reward function {name!r}"):
                return fn(**kwargs)
        except signals.WaitTimedOut:
            raise self._timed_out(name) from None
        except (signals.StoppedWhileWaiting, user_code.UserCodeExit):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the function and completion named
            self._raise(name, fn, kwargs, e)

    def _timed_out(self, name) -> RewardError:
        return RewardError(f"reward function {name!r} did not return within reward.timeout={self.timeout:g} s")

    def _raise(self, name, fn, kwargs, error: BaseException):
        """Find the completion `fn` fails on (calling it on one completion at a time) and say so."""
        n = len(kwargs["completions"])
        what = f"reward function {name!r}"
        for i in range(min(n, 16)):  # a few single calls at most (a remote scorer may be slow)
            one = {k: v[i : i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
            log = RewardLog(1)  # what it logs here is not kept
            one.update(log_metric=log.log_metric, log_extra=log.log_extra)
            try:
                with user_code.exits_caught(what):
                    result = fn(**one)
                if inspect.isawaitable(result):
                    user_code.submit(result, what).result()
            except user_code.UserCodeExit:
                raise
            except Exception as e:  # noqa: BLE001
                raise RewardError(
                    f"reward function {name!r} raised {type(e).__name__}: {e}\n"
                    f"  on completion {i}: {_short(kwargs['completions'][i])}\n"
                    f"  of prompt: {_short(kwargs['prompts'][i])}{_where(e)}{_shape_hint(e, kwargs)}"
                ) from error
        raise RewardError(
            f"reward function {name!r} raised {type(error).__name__}: {error}\n"
            f"  on a batch of {n} completions (called again on single ones, it did not fail), the first:"
            f" {_short(kwargs['completions'][0])}\n  of prompt: {_short(kwargs['prompts'][0])}{_where(error)}"
            f"{_shape_hint(error, kwargs)}"
        ) from error

    @staticmethod
    def _check(name, values, prompts, completions) -> torch.Tensor:
        if hasattr(values, "tolist"):  # a numpy array or a tensor, as TRL accepts
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(
                f"reward function {name!r} returned {got} for {len(completions)} completions; "
                "it must return one float (or None) per completion"
            )
        out = []
        for i, v in enumerate(values):
            # Any real number: int, float, bool, numpy scalars.
            if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(v)):
                raise RewardError(
                    f"reward function {name!r} returned {v!r} for completion {i}: {_short(completions[i])}\n"
                    f"  of prompt: {_short(prompts[i])}\n  rewards must be finite numbers, or None (not applicable)"
                )
            out.append(math.nan if v is None else float(v))
        return torch.tensor(out, dtype=torch.float32)


def _shape_hint(error: BaseException, kwargs: dict) -> str:
    """For a function that fails on a completion's shape: the setting that gives TRL's shapes. TRL
    sends a string prompt as plain text and passes its completion as a string; grpokit, unless
    data.chat_template=false, sends it through the chat template as a user message and passes
    the completion as a list of messages."""
    completions = kwargs["completions"]
    if not isinstance(error, (TypeError, AttributeError, KeyError, IndexError)) or not completions:
        return ""
    if isinstance(completions[0], list) and "environments" not in kwargs:
        return ("\n  the completions are lists of messages ([{'role': 'assistant', 'content': ...}]) because the "
                "prompts are chat messages: if the data's prompts are strings (and no tools take part), "
                "data.chat_template=false sends them as plain text and passes completions as strings, as TRL does")
    if isinstance(completions[0], str):
        return ("\n  the completions are strings because the prompts are plain text (data.chat_template=false): "
                "data.chat_template=true sends a string prompt as a user message, and passes completions as lists "
                "of messages")
    return ""


def _bind(name: str, fn, arguments: dict):
    """fn with the configured keyword `arguments`; they win over a dataset column of the same name.
    An argument the function does not name is a start-up error (a typo would pass silently)."""
    if not arguments:
        return fn
    named = {p.name for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(arguments) - named)
    if unknown:
        raise ConfigError(f"reward function {name!r} has no argument {', '.join(map(repr, unknown))} "
                          f"(its arguments: {', '.join(sorted(named))})")
    if user_code.is_async(fn):
        async def bound(**kwargs):
            return await fn(**{**kwargs, **arguments})
    else:
        def bound(**kwargs):
            return fn(**{**kwargs, **arguments})
    return bound


def get_reward_function(name: str) -> Callable[..., list[float | None]]:
    """Resolve a built-in name, `module:function` or `file.py:function` (ConfigError if it can't)."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if name in BUILTIN_REWARDS:
        module, function = BUILTIN_REWARDS[name].split(":")
        return getattr(importlib.import_module(module), function)
    if ":" not in name:
        raise ConfigError(
            f"unknown reward function {name!r}: built-in ones are {', '.join(sorted(BUILTIN_REWARDS.keys() | REWARD_FUNCTIONS.keys()))}; "
            "your own are named 'package.module:function' or 'path/to/file.py:function' (a function given to "
            "grpokit.train as a Python object is known by its name only to the process that ran it: pass it again)"
        )
    return user_code.find(f"reward function {name!r}", name)
