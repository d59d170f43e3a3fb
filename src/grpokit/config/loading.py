"""Reading a config: defaults, then a YAML file, then dotted `section.field=value` overrides, then
values given from Python; what depends on which settings were given (`settle`); writing a run's
config.yaml; and the reference of every field (`describe`, what `grpokit config` prints).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from grpokit.config.checks import facts, problems
from grpokit.runtime.errors import ConfigError
from grpokit.settings.schema import Config, DataConfig

def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against the field's annotation; ints are accepted where floats are expected."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        tp = list
    if tp is list and isinstance(value, (str, dict)):
        return [value]  # a single entry needs no brackets
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{key} must be {'a' if tp is not int else 'an'} {_type_name(tp)}"
        f"{' or null' if args else ''}, got {value!r} ({type(value).__name__})"
    )


# Other trainers spread the KL term over several keys (EasyR1: algorithm.kl_coef, actor.use_kl_loss,
# actor.kl_loss_coef; TRL: beta, ref_model ...) that can contradict each other: a KL coefficient 0
# in one place and 1e-3 in another. grpokit has one: a key of that family gets this answer rather
# than a spelling suggestion.
_KL_KEY = re.compile(r"(^|_)kl(_|$)|^ref(erence)?(_|$)|_ref(erence)?(_|$)")
_KL_HINT = (
    "grpokit has one KL setting, algorithm.beta (with algorithm.kl_estimator); the reference model is "
    "the initial policy, loaded exactly when algorithm.beta > 0"
)


def _apply(config: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if len(parts) == 1 and parts[0] in sections:  # `train: 5` in a YAML file, or `train=5`
        raise ConfigError(f"{key} is a section: give its fields (e.g. {key}.{dataclasses.fields(sections[key].default_factory())[0].name}"
                          f"=...), not {value!r}")
    known = len(parts) == 2 and parts[0] in sections and hasattr(getattr(config, parts[0]), parts[1])
    if not known and _KL_KEY.search(parts[-1]):
        raise ConfigError(f"unknown config key {key!r}: {_KL_HINT}")
    if len(parts) != 2 or parts[0] not in sections:
        hint = difflib.get_close_matches(parts[0], sections, n=1)
        raise ConfigError(
            f"unknown config key {key!r}: keys look like section.field with section one of "
            f"{', '.join(sections)}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    section = getattr(config, parts[0])
    fields = {f.name: f for f in dataclasses.fields(section)}
    if parts[1] not in fields:
        hint = difflib.get_close_matches(parts[1], fields, n=1)
        raise ConfigError(
            f"unknown config key {key!r}"
            + (f": did you mean '{parts[0]}.{hint[0]}'?" if hint else "")
            + f" (fields of {parts[0]}: {', '.join(fields)})"
        )
    hints = typing.get_type_hints(type(section))
    setattr(section, parts[1], _coerce(key, value, hints[parts[1]]))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A mapping of sections ({"train": {"max_steps": 5}}) or dotted keys ({"train.max_steps": 5})
    as {"section.field": value}; a field's own value may be a mapping (data.task_args)."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix or 'the config file'} must be a mapping, got {tree!r}")
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "." not in key:  # a section
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=50` -> ("train.max_steps", 50); values are read as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] = (), values: dict | None = None,
                base: Config | None = None, check: bool = True) -> Config:
    """Defaults (or a copy of `base`), then the YAML file, then `key=value` overrides, then `values`
    (a mapping of sections or dotted keys, as Python gives them); settled and validated (with
    `check`, against the launch and, when it is on this machine already, the model it names:
    checks.py; a run checks it again as it starts only where that differs: the model fetched since,
    or values changed in Python, and grpokit.train once its arguments are in). Every problem is reported at once: a key or value that cannot be set does
    not hide the others."""
    config = Config() if base is None else copy.deepcopy(base)
    settings = []
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder, not a YAML file"
                              + (f" (this run's is {path / 'config.yaml'})" if (path / "config.yaml").is_file() else ""))
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        settings += flatten(tree).items()
    refused = []
    for text in overrides:
        try:
            settings.append(parse_override(text))
        except ConfigError as e:
            refused.append(str(e))
    if values:
        settings += flatten(values).items()
    for key, value in settings:
        try:
            _apply(config, key, value)
        except ConfigError as e:  # the field keeps its default, and the others are checked
            refused.append(str(e))
    config.given |= {key for key, _ in settings}
    settle(config)
    found = facts(config, local_only=True) if check else None
    checked = problems(config, found) if check else []
    if len(refused) == 1 and not checked:
        raise ConfigError(refused[0])
    if refused or checked:
        raise ConfigError.listing(refused + checked)
    if check:
        config.checked = (found, config.to_dict())
    return config


def settle(config: Config) -> None:
    """Decide what depends on which settings were given, once they all are: an environment with
    neither a dataset (data.path) nor a data.task of its own brings the prompts (data.task=environment:
    TRL's environment_factory without a train_dataset); an environment that is a task of its own (a
    verifiers environment) becomes data.task; a task that is run by an agent of its own (a TextArena
    game, a verifiers environment) gets it as rollout.agent unless one was given."""
    from grpokit.tasks.registry import environment_task, task_agent

    d, r = config.data, config.rollout
    if "data.task" not in config.given and d.task in (DataConfig().task, "environment"):
        environment = r.environment is not None and d.path is None
        d.task = "environment" if environment else DataConfig().task
    task = environment_task(r.environment)
    if task is not None:
        d.task, r.environment = task, None
        config.given |= {"data.task"}
    agent = task_agent(d.task)
    if agent is not None and "rollout.agent" not in config.given and d.path is None:
        r.agent = agent


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def describe() -> str:
    """The config reference: every field with its default and meaning, as YAML with comments."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        defaults = section.default_factory()
        for f in dataclasses.fields(defaults):
            default = yaml.safe_dump(getattr(defaults, f.name), default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"  {f.name}: {default}  # {f.metadata['help']}")
    return "\n".join(lines)
