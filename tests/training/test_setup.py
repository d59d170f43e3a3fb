"""setup.build, the one builder of a run's parts: the trainer, `grpokit eval` and `grpokit serve`
build nothing themselves, an engine is made only through ENGINES, and a config is settled and
checked once for the same values and facts."""

import ast
import inspect
import textwrap

import pytest

from grpokit import api, server
from grpokit.config.loading import load_config
from grpokit.training import setup
from grpokit.training.trainer import Trainer

# What builds a part: whoever calls one of these builds it.
BUILDERS = {"load_model", "load_policy", "load_teacher", "make_engine", "engine_class", "make_kind", "prepare",
            "checked_facts", "Sampler", "Scorer", "LogProbs", "from_launch", "open_run_dir", "TransformersEngine",
            "VLLMEngine", "DataParallelVLLM"}


def called(function) -> set[str]:
    """The names `function` calls (a.b(...) counts as b)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("user", [Trainer.__init__, api.evaluate, server.serve])
def test_train_eval_and_serve_build_their_parts_through_build_alone(user):
    calls = called(user)
    assert "build" in calls
    assert not calls & BUILDERS, f"{user.__qualname__} builds {calls & BUILDERS} itself"


def test_a_use_build_does_not_know_is_refused():
    with pytest.raises(ValueError, match="use='tune' is not one of"):
        setup.build(load_config(None, []), "tune")


def test_a_loaded_config_is_checked_once_unless_its_values_change(monkeypatch):
    config = load_config(None, ["model.name=tiny-random", "train.max_steps=3"])
    assert config.checked is not None  # load_config checked it against the launch and the model
    checks = []
    monkeypatch.setattr(setup, "check", lambda c, found: checks.append(found))
    setup.checked_facts(config)
    assert checks == []  # the same values, the same facts: not checked again
    config.train.max_steps = 4  # changed in Python after loading
    setup.checked_facts(config)
    assert len(checks) == 1
    setup.checked_facts(config)
    assert len(checks) == 1  # and now recorded as checked with those values


def test_eval_builds_the_model_its_engine_and_rollout_kind():
    run = setup.build(load_config(None, ["model.name=tiny-random", "data.eval_size=3"]), "eval",
                      model_name="tiny-random")
    try:
        assert run.engine.model is run.model and len(run.prepared.task.eval_examples) == 3
        assert run.eos_ids and type(run.kind).__name__ == "SingleTurn"
    finally:
        run.kind.close()
        run.engine.close()
