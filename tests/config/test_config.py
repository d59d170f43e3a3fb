import pytest
import yaml

from grpokit.cli import main
from grpokit.config.checks import Facts, check
from grpokit.config.loading import describe, load_config
from grpokit.runtime.errors import ConfigError
from grpokit.runtime.launch import Launch
from grpokit.settings.schema import Config


def test_defaults_are_valid_and_overrides_apply(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump({"algorithm": {"beta": 0.04, "loss_type": "dapo"}, "train": {"max_steps": 7}}))
    c = load_config(path, ["algorithm.beta=0.001", "train.max_steps=50", "algorithm.epsilon_high=null"])
    assert c.algorithm.beta == 0.001  # the override wins over the file
    assert c.algorithm.loss_type == "dapo"
    assert c.train.max_steps == 50
    assert c.algorithm.epsilon_high is None
    assert isinstance(load_config(None, ["train.learning_rate=1"]).train.learning_rate, float)
    assert load_config(None, ["train.learning_rate=1e-5"]).train.learning_rate == 1e-5


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=1e-5", "train.lr"),  # unknown key
        ("train.learning_rat=1e-5", "did you mean 'train.learning_rate'"),
        ("trian.max_steps=3", "trian"),
        ("train.max_steps=abc", "train.max_steps"),  # wrong type
        ("train.max_steps=1.5", "train.max_steps"),
        ("algorithm.beta=true", "algorithm.beta"),
        ("rollout.num_generations=1", "rollout.num_generations"),
        ("algorithm.loss_type=bnpo", "algorithm.loss_type"),
        ("train.updates_per_step=3", "train.updates_per_step"),  # 8 x 8 = 64 is not divisible by 3
        ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("rollout.temperature=0", "rollout.temperature"),
    ],
)
def test_bad_values_fail_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, names", [
    (["algorithm.loss_type=cispo", "algorithm.delta=2"], ["algorithm.delta", "algorithm.loss_type=cispo"]),
    (["algorithm.loss_type=sapo", "algorithm.delta=2"], ["algorithm.delta", "algorithm.loss_type=sapo"]),
    (["algorithm.delta=1.1"], ["algorithm.delta", "algorithm.epsilon_high"]),
    (["algorithm.importance_sampling_level=sequence", "algorithm.top_entropy_quantile=0.2"],
     ["algorithm.importance_sampling_level=sequence", "algorithm.top_entropy_quantile"]),
    (["algorithm.reward_aggregation=normalize_then_sum", "algorithm.advantage_estimator=rloo"],
     ["normalize_then_sum", "algorithm.advantage_estimator=rloo"]),
    (["algorithm.reward_aggregation=normalize_then_sum", "algorithm.scale_rewards=batch"],
     ["normalize_then_sum", "algorithm.scale_rewards=batch"]),
    (["algorithm.sync_ref_model=true"], ["algorithm.sync_ref_model", "algorithm.beta=0"]),
    (["algorithm.sync_ref_model=true", "algorithm.beta=0.01", "model.lora_rank=8"],
     ["algorithm.sync_ref_model", "model.lora_rank"]),
    (["rollout.is_min=1.5"], ["rollout.is_min"]),
    (["rollout.max_sampling_rounds=0"], ["rollout.max_sampling_rounds"]),
    (["algorithm.top_entropy_quantile=1.5"], ["algorithm.top_entropy_quantile"]),
])
def test_contradictory_variant_settings_name_both(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.num_generations=1", "algorithm.beta=-1"])
    assert "rollout.num_generations" in str(e.value) and "algorithm.beta" in str(e.value)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  nonsense: 1\n")
    with pytest.raises(ConfigError, match="train.nonsense"):
        load_config(bad)


def test_derived_batch_values():
    c = load_config(None, ["train.prompts_per_step=4", "rollout.num_generations=8", "train.updates_per_step=2"])
    assert (c.completions_per_step, c.completions_per_update) == (32, 16)
    assert c.needs_old_logps
    assert not Config().needs_old_logps
    check(c, Facts(Launch(world_size=4)))  # 16 completions per update: 4 per process
    with pytest.raises(ConfigError, match="cannot be split evenly over 3 processes"):
        check(c, Facts(Launch(world_size=3)))


def test_rollout_engine_settings_that_contradict_each_other():
    with pytest.raises(ConfigError, match="rollout.engine=server needs rollout.server_url"):
        load_config(None, ["rollout.engine=server"])
    with pytest.raises(ConfigError, match="rollout.server_url is set but rollout.engine=transformers"):
        load_config(None, ["rollout.server_url=http://127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="rollout.is_cap=0.5: must be >= 1"):
        load_config(None, ["rollout.is_cap=0.5"])
    c = load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.engine=vllm runs vLLM inside one training process, not 2"):
        check(c, Facts(Launch(world_size=2)))


def test_reward_functions_field(tmp_path):
    from grpokit.settings.schema import reward_specs

    c = load_config(None, ["reward.functions=[exact_answer, {name: my.py:f, weight: 0.5, target: 3}]"])
    assert reward_specs(c, (("x", 1.0),)) == (("exact_answer", 1.0, {}), ("my.py:f", 0.5, {"target": 3}))
    assert reward_specs(Config(), (("x", 1.0),)) == (("x", 1.0, {}),)
    assert load_config(None, ["reward.functions=my.py:f"]).reward.functions == ["my.py:f"]  # one, no brackets
    for bad in ("[{weight: 1}]", "[{name: f, weight: heavy}]", "[]", "[{name: f, weight: .nan}]"):
        with pytest.raises(ConfigError, match="reward.functions"):
            load_config(None, [f"reward.functions={bad}"])


def test_cli_reports_config_errors(capsys):
    assert main(["train", "rollout.num_generations=1"]) == 2
    assert "rollout.num_generations" in capsys.readouterr().err


def test_reference_lists_every_field():
    text = describe()
    for section in ("model", "data", "rollout", "algorithm", "train"):
        assert f"{section}:" in text
    for field in ("num_generations", "loss_type", "kl_estimator", "scale_rewards", "micro_batch_size", "eval_every"):
        assert f"  {field}:" in text


def test_the_docs_config_reference_is_current():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    assert describe() in readme, "docs/configuration.md's config reference is stale: paste the output of `grpokit config`"


def test_allowed_values_come_from_the_registries(monkeypatch):
    """A loss, task or engine registered where it lives is accepted by the config, with nothing else to edit."""
    from grpokit import engines, tasks
    from grpokit.algorithm import loss

    for key, value in (("algorithm.loss_type", "mine"), ("data.task", "mine"), ("rollout.engine", "mine")):
        with pytest.raises(ConfigError, match=f"{key}='mine'(: must be| is not) one of"):
            load_config(None, [f"{key}=mine"])
    monkeypatch.setitem(loss.LOSSES, "mine", loss.LOSSES["dapo"])
    monkeypatch.setitem(tasks.TASKS, "mine", tasks.TASKS["arithmetic"])
    monkeypatch.setitem(engines.ENGINES, "mine", engines.ENGINES["transformers"])
    config = load_config(None, ["algorithm.loss_type=mine", "data.task=mine", "rollout.engine=mine"])
    assert (config.algorithm.loss_type, config.data.task, config.rollout.engine) == ("mine", "mine", "mine")
