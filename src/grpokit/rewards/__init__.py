"""Reward functions, with TRL's calling convention: f(prompts=..., completions=..., **columns).

Each returns one float (or None: not applicable) per completion. Besides the dataset's columns,
functions receive `finish_reasons` ("stop" or "length" per completion); TRL-style functions that
take **kwargs simply ignore it. A function is named in configs by a built-in name, by
`package.module:function`, or by `path/to/file.py:function`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types
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
    module = _load_file(name, Path(where)) if where.endswith(".py") else _import(name, where)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward function {name!r}: {where} has no function named {attr!r}")
    return fn


def _import(name: str, module_name: str):
    # `python -m grpokit` puts the working directory on sys.path, the `grpokit` script does not;
    # a module next to the user should be found either way.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"reward function {name!r}: cannot import module {module_name!r} ({e}); "
            f"a file can be named by its path instead, e.g. 'path/to/{module_name.split('.')[-1]}.py:function'"
        ) from None


_loaded_files: dict[Path, types.ModuleType] = {}


def _load_file(name: str, path: Path):
    """Run a user's reward file once (however many functions are taken from it)."""
    path = path.resolve()
    if path in _loaded_files:
        return _loaded_files[path]
    if not path.is_file():
        raise ConfigError(f"reward function {name!r}: file {path} does not exist")
    # A unique module name per file: two files with the same name in different folders both load.
    module_name = f"grpokit_user_rewards_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and typing look a class's module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    _loaded_files[path] = module
    return module
