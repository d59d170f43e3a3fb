"""Reward functions, with TRL's calling convention: f(prompts=..., completions=..., **columns).

Each returns one float (or None: not applicable) per completion. Besides the dataset's columns,
functions receive `finish_reasons` ("stop" or "length" per completion); TRL-style functions that
take **kwargs simply ignore it. A function is named in configs by a built-in name, by
`package.module:function`, or by `path/to/file.py:function`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from grpokit.config import ConfigError
from grpokit.rewards.exact_answer import exact_answer, final_number

REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "exact_answer": exact_answer,
    "final_number": final_number,
}


def get_reward_function(name: str) -> Callable[..., list[float | None]]:
    """Resolve a built-in name, `module:function` or `file.py:function` (ConfigError if it can't)."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(
            f"unknown reward function {name!r}: built-in ones are {', '.join(sorted(REWARD_FUNCTIONS))}; "
            "your own are named 'package.module:function' or 'path/to/file.py:function'"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"reward function {name!r}: file {path} does not exist")
        module_name = f"grpokit_user_rewards.{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # pickling and dataclasses look modules up here
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"reward function {name!r}: cannot import module {where!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward function {name!r}: {where} has no function named {attr!r}")
    return fn
