"""The rollout protocols (engines/protocols.py) are the contract between the engines and their callers;
the rollout kinds (rollouts/kinds.py) are one protocol of their own.

    RolloutEngine   every engine of ENGINES (and the tests' ScriptedEngine): what the trainer asks
    PipelineEngine  the engines that rollout.max_staleness > 0 accepts (the config decides): server
    ServedEngine    the engines `grpokit serve` accepts (the CLI decides: those not `remote`), and
                    DataParallelVLLM, which serve() builds for --data-parallel-size > 1
    AgentsEngine    the engines whose servers host the agents' OpenAI routes: server

Each engine class is checked without making one (vLLM's module imports without vLLM): it has
every member of the protocols it must satisfy, methods with the protocol's parameters (the same
names and kinds, in the same order; a default where the protocol has one; any parameter of its
own after them, optional), class methods where the protocol has one, data members as class
attributes, properties or `self.<name> = ...` in its __init__. And every engine member a caller
uses (trainer, evaluation, multi-turn, pipeline, server) is declared by the protocol it holds.

    RolloutKind     single-turn, multi-turn and agents' rollouts, the one choice between them
                    (kinds.kind_of), and the sampling layer asking a kind, never which kind it is
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from pathlib import Path

import pytest

import grpokit
from grpokit.engines.protocols import AgentsEngine, ENGINES, PipelineEngine, RolloutEngine, ServedEngine, engine_class

SRC = Path(grpokit.__file__).parent


# ---------------------------------------------------------------- the checker


def protocol_members(protocol: type) -> dict[str, object]:
    """name -> what `protocol` (with the protocols it extends) declares: a function, a classmethod,
    or its type hint (a data member)."""
    hints = typing.get_type_hints(protocol, include_extras=True)
    declared: dict[str, object] = {}
    for klass in reversed(protocol.__mro__):
        if not getattr(klass, "_is_protocol", False) or klass is typing.Protocol:
            continue
        for name in klass.__dict__.get("__annotations__", {}):
            declared[name] = hints[name]
        for name, value in vars(klass).items():
            if not name.startswith("_") and isinstance(value, (classmethod, staticmethod, property)) or (
                    inspect.isfunction(value) and not name.startswith("_")):
                declared[name] = value
    return declared


def _set_in_init(cls: type, name: str) -> bool:
    """Whether the __init__ of `cls` or of a class it extends assigns self.<name>."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        return True
    return False


def signature_problem(declared, actual) -> str | None:
    """Why a method with signature `actual` cannot stand for the protocol's `declared` (both with
    self or cls first), or None: the declared parameters, in order, with the same names and kinds,
    a default wherever the protocol has one; any further parameter optional."""
    d, a = list(inspect.signature(declared).parameters.values()), list(inspect.signature(actual).parameters.values())
    for i, p in enumerate(d):
        if i >= len(a):
            return f"lacks parameter {p.name!r}"
        q = a[i]
        if (i > 0 and q.name != p.name) or q.kind != p.kind:
            return f"parameter {i} is {q.name!r} ({q.kind.description}), the protocol's is {p.name!r} ({p.kind.description})"
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            return f"parameter {p.name!r} has no default, the protocol's has one"
    for q in a[len(d):]:
        if q.default is inspect.Parameter.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            return f"requires parameter {q.name!r}, which the protocol's callers do not pass"
    return None


def problems(cls: type, protocol: type) -> list[str]:
    """Every way class `cls` falls short of `protocol` (empty: it satisfies it)."""
    out = []
    for name, declared in protocol_members(protocol).items():
        try:
            actual = inspect.getattr_static(cls, name)
        except AttributeError:
            actual = None
        if not isinstance(declared, (classmethod, staticmethod, property)) and not inspect.isfunction(declared):
            if typing.get_origin(declared) is typing.ClassVar:  # read from the class: a value there
                kind = typing.get_args(declared)[0]
                if actual is None or isinstance(actual, property) or not isinstance(getattr(cls, name), kind):
                    out.append(f"{name}: no class attribute of type {kind.__name__}")
            elif actual is None and not _set_in_init(cls, name):
                out.append(f"{name}: neither a class attribute, a property, nor set in __init__")
            continue
        if actual is None:
            out.append(f"{name}: missing")
            continue
        if isinstance(declared, classmethod) != isinstance(actual, classmethod):
            out.append(f"{name}: {'not ' if isinstance(declared, classmethod) else ''}a classmethod, as the protocol's")
            continue
        if not isinstance(declared, classmethod) and not inspect.isfunction(actual):
            out.append(f"{name}: not a method ({type(actual).__name__})")
            continue
        unwrap = lambda f: f.__func__ if isinstance(f, (classmethod, staticmethod)) else f
        if why := signature_problem(unwrap(declared), unwrap(actual)):
            out.append(f"{name}: {why}")
    return out


# ---------------------------------------------------------------- which engines must satisfy which


def pipeline_engines() -> list[str]:
    """The engines of ENGINES the config accepts with rollout.max_staleness > 0."""
    from grpokit.config.loading import load_config
    from grpokit.runtime.errors import ConfigError

    accepted = []
    for name in ENGINES:
        try:
            load_config(None, [f"rollout.engine={name}", "rollout.max_staleness=1"])
        except ConfigError as e:
            if "rollout.max_staleness=1" in str(e):
                continue
        accepted.append(name)
    return accepted


def served_engines(monkeypatch) -> list[str]:
    """The engines of ENGINES `grpokit serve --engine` accepts (the server's start stubbed out)."""
    from grpokit import server
    from grpokit.cli import main
    from grpokit.engines import vllm_engine

    started = []
    monkeypatch.setattr(server, "serve", lambda model, engine, *args: started.append(engine))
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: None)
    for name in ENGINES:
        main(["serve", "--model", "tiny-random", "--engine", name])  # 2 when refused
    return started


# Served, built by serve() itself rather than registered: vLLM over several replicas.
SERVED_UNREGISTERED = ["grpokit.engines.vllm_engine:DataParallelVLLM"]


def _class(path: str) -> type:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------- the engines


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_registered_engine_is_a_rollout_engine(name):
    assert problems(engine_class(name), RolloutEngine) == []


def test_the_scripted_test_engine_is_a_rollout_engine(monkeypatch):
    from support import scripted_engine

    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")  # as the tests register it
    assert engine_class("scripted") is scripted_engine.ScriptedEngine
    assert problems(scripted_engine.ScriptedEngine, RolloutEngine) == []


def test_the_engines_generating_ahead_are_pipeline_engines():
    accepted = pipeline_engines()
    assert "server" in accepted and "transformers" not in accepted  # the config's rule, as documented
    faults = {name: problems(engine_class(name), PipelineEngine) for name in accepted}
    assert not any(faults.values()), faults


def test_the_engines_grpokit_serve_serves_are_served_engines(monkeypatch):
    served = served_engines(monkeypatch)
    assert "transformers" in served and "server" not in served  # a server cannot serve a server
    assert served == [name for name in ENGINES if not engine_class(name).remote]
    faults = {path: problems(_class(path), ServedEngine) for path in [ENGINES[name] for name in served] + SERVED_UNREGISTERED}
    assert not any(faults.values()), faults
    assert all(callable(getattr(engine_class(name), "served", None)) for name in served)  # how setup.build makes each


def test_the_server_engine_hosts_agents_and_no_other_does():
    assert problems(engine_class("server"), AgentsEngine) == []
    assert [name for name in ENGINES if name != "server" and not problems(engine_class(name), AgentsEngine)] == []


def test_a_transformers_engine_is_each_protocol_it_must_be_at_runtime(tiny):
    from grpokit.engines.transformers_engine import TransformersEngine

    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    assert isinstance(engine, RolloutEngine) and isinstance(engine, ServedEngine)
    assert not isinstance(engine, PipelineEngine)  # no weights_step: it cannot generate ahead
    assert not isinstance(engine, AgentsEngine)  # agents reach it through the trainer's endpoint


# ---------------------------------------------------------------- the callers


# The modules that hold an engine of another protocol than RolloutEngine; every other module of
# grpokit that uses an engine uses a RolloutEngine (the trainer, evaluation, multi-turn, the CLI).
CALLERS = {"sampling/pipeline.py": PipelineEngine, "server.py": ServedEngine, "rollouts/agents.py": AgentsEngine,
           "training/setup.py": ServedEngine}  # (setup builds engines; it reads the device of the one it serves)
NOT_CALLERS = {
    "training/sharding.py": "DeepSpeed's engine, not a rollout engine",
    "engines/vllm_engine.py": "DataParallelVLLM's replicas drive their own VLLMEngine",
}


def engine_members_used(path: Path) -> set[str]:
    """Every `<engine>.name` in a module: on a variable or attribute called `engine` (not
    config.rollout.engine), or on what engine_class() or make_engine() returns."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        held = node.value
        if isinstance(held, ast.Name) and held.id == "engine" or \
                isinstance(held, ast.Attribute) and held.attr == "engine" and not (
                    isinstance(held.value, ast.Attribute) and held.value.attr == "rollout") or \
                isinstance(held, ast.Call) and isinstance(held.func, ast.Name) and held.func.id in ("engine_class", "make_engine"):
            used.add(node.attr)
    return used


def callers() -> dict[str, tuple[type, set[str]]]:
    """Each module of grpokit that uses engine members: (the protocol of its engine, those members)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if module not in NOT_CALLERS and (used := engine_members_used(path)):
            out[module] = (CALLERS.get(module, RolloutEngine), used)
    return out


def test_callers_use_only_what_their_protocol_declares():
    found = callers()
    assert set(CALLERS) <= set(found), "CALLERS names a module that uses no engine member: out of date?"
    assert any(protocol is RolloutEngine for protocol, _ in found.values())
    undeclared = {module: sorted(used - set(protocol_members(protocol)))
                  for module, (protocol, used) in found.items() if not used <= set(protocol_members(protocol))}
    assert undeclared == {}, "engine members used but not declared by the engine's protocol (engines/protocols.py)"


def test_the_protocols_declare_what_their_callers_use():
    assert set(protocol_members(RolloutEngine)) == {
        "exact_logprobs", "measures_entropies", "remote", "from_config", "generate", "weights_updated", "needs_weights",
        "use_weights", "sleep", "close"}
    assert set(protocol_members(PipelineEngine)) == set(protocol_members(RolloutEngine)) | {"weights_step", "push"}
    assert set(protocol_members(ServedEngine)) == {"device", "generate", "weights_checksum", "load_weights", "close",
                                                   "takes_adapters", "adapter_layout", "load_adapters",
                                                   "stops_between_tokens"}
    assert engine_members_used(SRC / "sampling/pipeline.py") >= {"use_weights", "weights_step", "push"}
    assert engine_members_used(SRC / "server.py") == set(protocol_members(ServedEngine))


# ---------------------------------------------------------------- the checker fails when it should


class _Good:
    """A minimal engine of RolloutEngine's shape; the faults below each break one member of it."""

    exact_logprobs = measures_entropies = True
    remote = False
    from_config = classmethod(lambda cls, rollout, model, tokenizer, eos_ids, model_name, lockstep, vision=None: cls())

    def generate(self, prompts, n, params, seeds=None, images=None, extra=1):  # an optional parameter of its own
        pass

    weights_updated = sleep = close = lambda self: None
    needs_weights = lambda self: False
    use_weights = lambda self, weights, step=None: None


def _variant(**members):
    return type("Variant", (_Good,), members)


def _without(name: str):
    body = {k: v for k, v in vars(_Good).items() if k != name}
    return type("Without", (), body)


def test_the_checker_accepts_a_good_engine_and_refuses_each_fault():
    assert problems(_Good, RolloutEngine) == []
    faults = {
        "close: missing": _without("close"),
        "remote: no class attribute": _without("remote"),
        "exact_logprobs: neither": _without("exact_logprobs"),
        "from_config: not a classmethod": _variant(from_config=lambda self, *a: None),
        "generate: lacks parameter 'seeds'": _variant(generate=lambda self, prompts, n, params: None),
        "generate: parameter 4 is 'seed'": _variant(generate=lambda self, prompts, n, params, seed=None: None),
        "generate: parameter 'seeds' has no default": _variant(generate=lambda self, prompts, n, params, seeds: None),
        "generate: parameter 2 is 'n' (keyword-only)": _variant(generate=lambda self, prompts, *, n, params, seeds=None: None),
        "use_weights: requires parameter 'step'": _variant(use_weights=lambda self, weights, step: None),
    }
    for expected, cls in faults.items():
        found = problems(cls, RolloutEngine)
        assert any(p.startswith(expected) for p in found), (expected, found)


def test_data_members_may_be_set_in_init():
    class Late(_Good):
        def __init__(self):
            self.weights_step = None

        def push(self, weights, step):
            pass

    assert "weights_step" in problems(_Good, PipelineEngine)[0]
    assert problems(Late, PipelineEngine) == []


# ---------------------------------------------------------------- the rollout kinds


def test_every_rollout_kind_is_one_and_the_choice_picks_among_them():
    from grpokit.config.loading import load_config
    from grpokit.rollouts.agents import Agents
    from grpokit.rollouts.conversation import MultiTurn
    from grpokit.rollouts.kinds import RolloutKind, SingleTurn, kind_of

    for kind in (SingleTurn, MultiTurn, Agents):
        assert problems(kind, RolloutKind) == [], kind
        assert callable(getattr(kind, "rewards", None)), kind  # the reward functions its rollouts bring
    config = load_config(None, [], check=False)
    assert kind_of(config.rollout, None) is SingleTurn and kind_of(config.rollout, object()) is MultiTurn
    config.rollout.agent = "agents.py:agent"
    assert kind_of(config.rollout, None) is Agents


def test_sampling_asks_a_kind_and_never_which_kind_it_is():
    """No module above rollouts/ tells the kinds apart (an isinstance or a name of one of them):
    what differs between them is the kinds' own to do."""
    names = {"SingleTurn", "MultiTurn", "Agents", "AgentOutcome"}
    found = {}
    for path in [*(SRC / "sampling").glob("*.py"), *(SRC / "training").glob("*.py")]:
        used = {node.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Name)} | \
               {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}
        if used & names:
            found[path.name] = sorted(used & names)
    assert found == {}
