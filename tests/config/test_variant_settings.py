"""A setting that only one variant reads, set while that variant is off, is refused at start-up,
naming the setting and the switch that would turn its variant on (config.VARIANT_SETTINGS); set at
its default, or with its variant on, it loads. Every config file of the repository loads, and so
does what from_trl makes of a TRL config that sets nothing of a variant it has off."""

import os
from pathlib import Path

import pytest
import yaml

from grpokit.cli import main
from grpokit.config.checks import check
from grpokit.config.loading import flatten, load_config
from grpokit.config.variants import VARIANT_SETTINGS
from grpokit.runtime.errors import ConfigError
from grpokit.settings.schema import Config
from grpokit.trl_config import from_trl

ROOT = Path(__file__).parents[2]

# Each variant's setting: a value other than its default, the overrides that leave its variant off
# (beyond the defaults), the switch the refusal names, and the overrides that turn the variant on.
CASES = {
    "model.lora_alpha": ("32", [], "model.lora_rank=0", ["model.lora_rank=8"]),
    "model.lora_dropout": ("0.1", [], "model.lora_rank=0", ["model.lora_rank=8"]),
    "model.lora_target_modules": ("q_proj,v_proj", [], "model.lora_rank=0", ["model.lora_rank=8"]),
    "model.lora_target_parameters": ("experts", [], "model.lora_rank=0", ["model.lora_rank=8"]),
    "model.quantization": ("nf4", [], "model.lora_rank=0", ["model.lora_rank=8"]),
    "data.long_prompts": ("truncate", [], "data.max_prompt_length=null", ["data.max_prompt_length=64"]),
    "rollout.server_url": ("http://127.0.0.1:8000", [], "rollout.engine=transformers", ["rollout.engine=server"]),
    "rollout.server_timeout": ("60", ["rollout.engine=vllm"], "rollout.engine=vllm",
                               ["rollout.engine=server", "rollout.server_url=http://127.0.0.1:8000"]),
    "rollout.vllm_gpu_memory_utilization": ("0.5", [], "rollout.engine=transformers", ["rollout.engine=vllm"]),
    "rollout.vllm_sleep": ("false", [], "rollout.engine=transformers", ["rollout.engine=vllm"]),
    "rollout.decoder": ("static", ["rollout.engine=vllm"], "rollout.engine=vllm", ["rollout.engine=transformers"]),
    "rollout.decode_slots": ("4", ["rollout.engine=vllm"], "rollout.engine=vllm", ["rollout.engine=transformers"]),
    "rollout.is_level": ("sequence", ["rollout.is_correction=false", "rollout.engine=vllm"], "rollout.is_correction=false",
                         ["rollout.is_correction=true", "rollout.engine=vllm"]),
    "rollout.is_mode": ("mask", ["rollout.is_correction=false", "rollout.engine=vllm"], "rollout.is_correction=false",
                        ["rollout.is_correction=true", "rollout.engine=vllm"]),
    "rollout.is_cap": ("2.0", ["rollout.is_correction=false", "rollout.engine=vllm"], "rollout.is_correction=false",
                       ["rollout.is_correction=true", "rollout.engine=vllm"]),
    "rollout.is_min": ("0.5", ["rollout.is_correction=false", "rollout.engine=vllm"], "rollout.is_correction=false",
                       ["rollout.is_correction=true", "rollout.engine=vllm"]),
    "rollout.max_turns": ("3", [], "rollout.tools=null", ["data.task=calculator"]),  # the task's own tools
    "rollout.tool_call_format": ("mistral", [], "rollout.tools=null", ["data.task=calculator"]),
    "rollout.tool_timeout": ("null", ["data.task=calculator", "rollout.tools=[]"], "rollout.tools=[]",
                             ["rollout.tools=[my_tools.py:add]"]),
    "rollout.agent_timeout": ("60", [], "rollout.agent=null", ["rollout.agent=my_agent.py:agent"]),
    "rollout.max_sampling_rounds": ("2", [], "rollout.dynamic_sampling=false", ["rollout.dynamic_sampling=true"]),
    "rollout.in_flight_updates": ("true", [], "rollout.max_staleness=0", [
        "rollout.max_staleness=1", "rollout.engine=server", "rollout.server_url=http://127.0.0.1:8000"]),
    "rollout.partial_tokens": ("32", [], "rollout.partial=false", ["rollout.partial=true"]),
    "rollout.partial_spare": ("2", [], "rollout.partial=false", ["rollout.partial=true"]),
    "rollout.partial_max_lag": ("2", [], "rollout.partial=false", ["rollout.partial=true"]),
    "algorithm.kl_estimator": ("k2", [], "algorithm.beta=0", ["algorithm.beta=0.001"]),
    "algorithm.delta": ("2", ["algorithm.loss_type=cispo"], "algorithm.loss_type=cispo", ["algorithm.loss_type=dapo"]),
    "algorithm.sapo_temperature_pos": ("2", [], "algorithm.loss_type=grpo", ["algorithm.loss_type=sapo"]),
    "algorithm.sapo_temperature_neg": ("2", ["algorithm.loss_type=dr_grpo"], "algorithm.loss_type=dr_grpo",
                                       ["algorithm.loss_type=sapo"]),
    "algorithm.ref_model_mixup_alpha": ("0.5", [], "algorithm.sync_ref_model=false",
                                        ["algorithm.sync_ref_model=true", "algorithm.beta=0.01"]),
    "algorithm.ref_model_sync_steps": ("64", [], "algorithm.sync_ref_model=false",
                                       ["algorithm.sync_ref_model=true", "algorithm.beta=0.01"]),
}


@pytest.mark.parametrize("key", ["rollout.is_level", "rollout.is_mode", "rollout.is_cap", "rollout.is_min"])
def test_an_importance_weight_setting_with_an_engine_that_samples_with_the_trainer_s_code_is_refused(key):
    """rollout.is_correction on, but the transformers engine's log-probs are the trainer's own: the
    weight would be exactly 1, its settings read by nothing. A server says so only once connected."""
    value = CASES[key][0]
    with pytest.raises(ConfigError, match=f"{key}=.* is set but rollout.engine=transformers samples with the "
                                          "trainer's own code, so the rollout importance weight has nothing to "
                                          f"correct: use rollout.engine=vllm or a server, or remove {key}"):
        load_config(None, [f"{key}={value}"])
    load_config(None, [f"{key}={value}", "rollout.engine=server", "rollout.server_url=http://127.0.0.1:8000"])
    with pytest.raises(ConfigError, match=f"{key}=.* is set but rollout.is_correction=false, and rollout.engine="
                                          "transformers samples with the trainer's own code, so the rollout importance "
                                          "weight has nothing to correct: set rollout.is_correction=true and "
                                          f"rollout.engine=vllm \\(or a server\\), or remove {key}"):
        load_config(None, [f"{key}={value}", "rollout.is_correction=false"])


def test_a_run_s_config_evaluated_with_a_variant_switched_off_loads(tmp_path, capsys):
    """`grpokit eval` of a calculator run on the arithmetic task: the run's rollout.max_turns (read
    only with tools) is put back at its default, not refused; one given on the command line still is."""
    assert main(["eval", "--model", "tiny-random", "--config", str(ROOT / "examples" / "calculator.yaml"),
                 "--task", "arithmetic", "data.eval_size=2", "rollout.max_completion_length=2"]) == 0
    assert "rewards/exact_answer/mean" in capsys.readouterr().out  # the arithmetic task's reward
    assert main(["eval", "--model", "tiny-random", "--config", str(ROOT / "examples" / "calculator.yaml"),
                 "--task", "arithmetic", "rollout.max_turns=4"]) == 2
    assert "rollout.max_turns=4 is set but rollout.tools=null does not use it" in capsys.readouterr().err


def test_a_run_that_set_a_setting_for_nothing_resumes_without_it(tmp_path):
    """A run started before such settings were refused (rollout.is_cap with the transformers engine):
    its config.yaml is refused now, and without the setting it resumes (rundir.config_changes)."""
    from grpokit.rundir.folder import config_changes

    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({**Config().to_dict(), "rollout": {**Config().to_dict()["rollout"], "is_cap": 2.0}}))
    with pytest.raises(ConfigError, match="rollout.is_cap=2 is set but rollout.engine=transformers"):
        load_config(saved)
    assert config_changes(saved, load_config(None)) == []
    assert config_changes(saved, load_config(None, ["rollout.engine=vllm"])) != []  # read there: a change


def test_every_variant_setting_is_tested():
    assert set(CASES) == set(VARIANT_SETTINGS)


@pytest.mark.parametrize("key", list(CASES))
def test_a_setting_of_a_variant_that_is_off_is_refused_naming_its_switch(key):
    value, off, switch, on = CASES[key]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*off, f"{key}={value}"])
    message = next(line for line in str(e.value).splitlines() if f"{key}" in line and "is set but" in line)
    assert f"is set but {switch} " in message and message.endswith(f"or remove {key}"), message
    turn_on = VARIANT_SETTINGS[key].turn_on
    assert f"set {turn_on() if callable(turn_on) else turn_on} or remove" in message


@pytest.mark.parametrize("key", list(CASES))
def test_a_setting_with_its_variant_on_loads(key):
    value, off, _, on = CASES[key]
    config = load_config(None, [*off, *on, f"{key}={value}"])
    assert key in config.given


def test_the_messages_say_what_to_set():
    with pytest.raises(ConfigError, match=r"algorithm.sapo_temperature_pos=2 is set but algorithm.loss_type=grpo does "
                                          r"not use it: set algorithm.loss_type=sapo or remove "
                                          r"algorithm.sapo_temperature_pos"):
        load_config(None, ["algorithm.sapo_temperature_pos=2"])
    with pytest.raises(ConfigError, match=r"algorithm.delta=2 is set but algorithm.loss_type=sapo does not use it: set "
                                          r"algorithm.loss_type=grpo \(or dapo, dr_grpo\) or remove algorithm.delta"):
        load_config(None, ["algorithm.loss_type=sapo", "algorithm.delta=2"])
    with pytest.raises(ConfigError, match=r"rollout.max_turns=3 is set but rollout.tools=null does not use it: set "
                                          r"rollout.tools \(or rollout.environment, or a data.task with tools of its "
                                          r"own\) or remove rollout.max_turns"):
        load_config(None, ["rollout.max_turns=3"])


def test_every_refusal_is_reported_at_once_and_at_start_up(capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.lora_alpha=32", "rollout.vllm_sleep=false", "algorithm.ref_model_sync_steps=8"])
    assert all(k in str(e.value) for k in ("model.lora_alpha", "rollout.vllm_sleep", "algorithm.ref_model_sync_steps"))
    out = tmp_path / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "model.lora_dropout=0.1",
                 f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "model.lora_dropout=0.1 is set but model.lora_rank=0 does not use it" in err and "Traceback" not in err
    assert not out.exists()


def test_a_config_built_in_python_is_checked_alike():
    config = Config()
    config.rollout.dynamic_sampling = False
    config.rollout.max_sampling_rounds = 2
    assert config.given == set()  # not loaded: nothing counts as given, the values are what is checked
    with pytest.raises(ConfigError, match="rollout.max_sampling_rounds=2 is set but rollout.dynamic_sampling=false"):
        check(config)


def test_a_setting_at_its_default_loads_with_its_variant_off():
    """It asks for nothing the run does not do; a run's config.yaml records every field."""
    defaults = flatten(Config().to_dict())
    config = load_config(values={key: defaults[key] for key in VARIANT_SETTINGS})
    assert set(VARIANT_SETTINGS) <= config.given
    saved = load_config(values=Config().to_dict())  # as config.yaml holds it
    assert saved.to_dict() == Config().to_dict()


def test_the_defaults_and_every_config_file_of_the_repository_load():
    load_config()
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("runs", "node_modules")]
        files += [Path(folder) / name for name in names if name.endswith((".yaml", ".yml"))]
    sections = {name for name in Config().to_dict()}
    configs = [path for path in files if isinstance(tree := yaml.safe_load(path.read_text()), dict) and set(tree) <= sections]
    assert {p.name for p in configs} >= {"calculator.yaml", "math.yaml", "reasoning_gym.yaml", "tldr.yaml"}
    for path in configs:  # the others are accelerate's (examples/accelerate/)
        load_config(path)


@pytest.mark.parametrize("trl_fields", [
    {}, {"use_vllm": True}, {"use_vllm": True, "vllm_mode": "server"}, {"vllm_importance_sampling_correction": False},
    {"loss_type": "sapo", "sapo_temperature_pos": 2.0}, {"sync_ref_model": True, "beta": 0.1,
                                                         "use_bias_correction_kl": False},
    {"vllm_enable_sleep_mode": False}, {"delta": 1.5},
])
def test_from_trl_carries_no_default_of_a_variant_it_has_off(trl_fields):
    """TRL's defaults of a variant's settings (vllm_enable_sleep_mode=False, vllm_server_timeout=240,
    the sequence_mask mode without the correction) are left out where the variant is off."""
    config, _ = from_trl({"max_steps": 8, **trl_fields})
    load_config(values=config)


def test_from_trl_keeps_a_setting_the_trl_config_set_for_a_variant_it_has_off():
    config, _ = from_trl({"max_steps": 8, "sapo_temperature_pos": 2.0})  # loss_type dapo: TRL ignores it
    assert config["algorithm"]["sapo_temperature_pos"] == 2.0
    with pytest.raises(ConfigError, match="algorithm.sapo_temperature_pos=2 is set but algorithm.loss_type=dapo"):
        load_config(values=config)
