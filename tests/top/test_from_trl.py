"""Coming from TRL: from_trl's mapping of every GRPOConfig field, and TRL's own reward functions
inside a grpokit run (TRL is a test dependency, never a runtime one)."""

import dataclasses
import json

import pytest

import grpokit
from support import scripted_engine
from grpokit.config.loading import load_config
from grpokit.engines.batch import from_completions
from grpokit.engines.protocols import ENGINES
from grpokit.trl_config import FIELDS, FILLED_IN, FromTRLError, from_trl, table

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")


# TRL's documented quick-start GRPOConfig (docs/source/quickstart.md), runnable on a CPU.
QUICK_START = dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, num_generations=4,
                   max_completion_length=512, bf16=False, use_cpu=True, output_dir="Qwen2-0.5B-GRPO")


def quick_start():
    return trl.GRPOConfig(**QUICK_START)


def test_every_grpo_config_field_is_mapped_with_trl_s_default():
    declared = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(FIELDS) == set(declared)
    for name, f in declared.items():
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if name not in FILLED_IN | {"optim"}:
            assert getattr(default, "value", default) == FIELDS[name].default, name
    rows = table().splitlines()
    assert len(rows) == len(FIELDS) + 2 and all(f"`{name}`" in table() for name in FIELDS)


def test_the_docs_table_is_from_trl_s():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "from-trl.md").read_text()
    start = readme.index("<!-- from_trl table -->\n") + len("<!-- from_trl table -->\n")
    assert readme[start:readme.index("<!-- end from_trl table -->")] == table() + "\n"


def test_the_quick_start_config_carries_over_and_loads():
    config, not_carried = from_trl(quick_start())
    # TRL's batch: 1 completion per device x 8 accumulation steps = one update of 8 completions, generated
    # 8 at a time: 2 prompts x 4 completions per grpokit step, one update, micro-batches of 1.
    flat = config["train"] | config["rollout"] | config["algorithm"]
    assert flat.items() >= {
        "prompts_per_step": 2, "updates_per_step": 1, "micro_batch_size": 1, "num_generations": 4,
        "max_completion_length": 512, "learning_rate": 1e-6, "lr_scheduler": "linear", "seed": 42,
        "loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2,
        "eval_every": 0, "save_every": 500, "output_dir": "Qwen2-0.5B-GRPO"}.items()
    # Generating in-process (use_vllm=False), the trainer's own log-probs leave the rollout
    # importance weight nothing to correct: its settings are not carried. With vLLM they are.
    assert not {"is_level", "is_mode", "is_cap", "is_min"} & flat.keys()
    with_vllm, _ = from_trl(trl.GRPOConfig(**{**QUICK_START, "use_vllm": True}))
    assert with_vllm["rollout"].items() >= {"engine": "vllm", "is_level": "sequence", "is_mode": "mask",
                                            "is_cap": 3.0}.items()
    # eval_strategy="no": no evaluation, nothing held out of the data; string prompts as plain text, as TRL sends them.
    assert config["data"] == {"eval_size": 0, "chat_template": False}
    assert [(n.field, n.value) for n in not_carried] == [("max_steps", -1)]  # epochs need the dataset's size
    _, on_a_gpu = from_trl({"bf16": True, "max_steps": 8})
    assert [(n.field, n.value) for n in on_a_gpu] == [("bf16", True)]
    loaded = load_config(values={**config, "train": {**config["train"], "max_steps": 10}})
    assert loaded.algorithm.loss_type == "dapo" and loaded.completions_per_update == 8


def test_settings_grpokit_lacks_are_errors_when_they_change_the_math_and_listed_when_not():
    with pytest.raises(FromTRLError, match=r"repetition_penalty=1.1: grpokit samples(.|\n)*use_adaptive_entropy=True"):
        from_trl({"repetition_penalty": 1.1, "use_adaptive_entropy": True, "max_steps": 8})
    with pytest.raises(FromTRLError, match="loss_type='luspo'"):
        from_trl({"loss_type": "luspo"})
    with pytest.raises(grpokit.config.ConfigError, match="num_generationz is not a field"):
        from_trl({"num_generationz": 4})
    config, not_carried = from_trl({"logging_steps": 1, "push_to_hub": True, "loss_type": "bnpo", "max_steps": 16,
                                    "steps_per_generation": 4, "per_device_train_batch_size": 4, "num_iterations": 2,
                                    "save_steps": 5, "report_to": ["trackio"], "vllm_importance_sampling_mode":
                                    "token_truncate", "max_tool_calling_iterations": 3})
    assert {n.field for n in not_carried} == {"logging_steps", "push_to_hub", "loss_type", "save_steps", "bf16"}
    assert config["algorithm"]["loss_type"] == "dapo"
    assert from_trl({"entropy_coef": 0.01, "max_steps": 8})[0]["algorithm"]["entropy_coef"] == 0.01
    # 4 per update x 4 generation steps: 16 completions per step feed 4 updates, twice: 8 TRL steps per grpokit step.
    assert (config["train"]["updates_per_step"], config["train"]["max_steps"], config["train"]["save_every"]) == (4, 2, 1)
    assert config["monitor"]["trackio"] and config["rollout"]["max_turns"] == 4
    assert (config["rollout"]["is_level"], config["rollout"]["is_mode"]) == ("token", "truncate")
    cispo, _ = from_trl({"loss_type": "cispo", "epsilon_high": 5.0, "max_steps": 1})
    assert cispo["algorithm"]["epsilon_high"] == 4.0  # TRL's cap, grpokit's offset


@pytest.mark.parametrize("fields,problem", [
    ({"beta": 0.04}, "use_bias_correction_kl=True .TRL's default. with beta=0.04: TRL multiplies the KL term"),
    ({"loss_type": "cispo"}, "loss_type='cispo' with epsilon_high=None: TRL caps CISPO's weight at epsilon_high .at "
                             "epsilon=0.2 without it."),
    ({"loss_type": "cispo", "epsilon_high": 1.0}, "loss_type='cispo' with epsilon_high=1.0"),
    ({"use_vllm": True, "vllm_importance_sampling_clip_max": None}, "vllm_importance_sampling_clip_max=None"),
])
def test_trl_defaults_that_would_change_the_math_are_errors(fields, problem):
    with pytest.raises(FromTRLError, match=problem):
        from_trl({"max_steps": 8, **fields})


def test_settings_carried_with_trl_s_meaning():
    # beta > 0 with the ratio-free KL term: carried, and nothing to say about it.
    config, notes = from_trl({"max_steps": 8, "beta": 0.04, "use_bias_correction_kl": False, "bf16": False})
    assert config["algorithm"]["beta"] == 0.04 and notes == []
    # transformers' constant schedule ignores warmup_steps; grpokit's would warm up.
    config, notes = from_trl({"max_steps": 8, "lr_scheduler_type": "constant", "warmup_steps": 5, "bf16": False})
    assert config["train"]["warmup_steps"] == 0 and [(n.field, n.value) for n in notes] == [("warmup_steps", 5)]
    config, notes = from_trl({"max_steps": 8, "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 5,
                              "bf16": False})
    assert (config["train"]["lr_scheduler"], config["train"]["warmup_steps"]) == ("constant", 5)
    assert [n.field for n in notes] == ["warmup_steps"] and "(u + 1) / W, transformers' x u / W" in notes[0].reason
    # save_steps and eval_steps below 1 are shares of max_steps (TRL's optimizer steps), as in transformers.
    config, notes = from_trl({"max_steps": 40, "num_iterations": 2, "save_steps": 0.25, "eval_strategy": "steps",
                              "eval_steps": 0.5, "bf16": False})
    assert (config["train"]["save_every"], config["train"]["eval_every"]) == (5, 10) and notes == []
    _, notes = from_trl({"save_steps": 0.25, "bf16": False})
    assert ("save_steps", 0.25) in [(n.field, n.value) for n in notes]
    # report_to="all" turns on every installed tracker in TRL; grpokit only those named.
    _, notes = from_trl({"max_steps": 8, "report_to": "all", "bf16": False})
    assert [(n.field, n.value) for n in notes] == [("report_to", "all")]
    # Normalizers and masks decided at another granularity than TRL's are listed.
    _, notes = from_trl({"max_steps": 8, "steps_per_generation": 2, "top_entropy_quantile": 0.2, "bf16": False})
    assert [n.field for n in notes] == ["loss_type", "top_entropy_quantile"]
    assert "each of the 2 updates per generation batch is normalized by its own tokens" in notes[0].reason
    # A GRPOConfig names its output folder "trainer_output" when not given one: not carried.
    config, _ = from_trl(trl.GRPOConfig(max_steps=8, use_cpu=True, bf16=False))
    assert "output_dir" not in config["train"]
    # TRL sized a GRPOConfig's generation batch for the processes that built it: a dict says what was set.
    with pytest.raises(grpokit.config.ConfigError, match=r"num_processes=2\) of a GRPOConfig built in a run of 1"):
        from_trl(trl.GRPOConfig(max_steps=8, per_device_train_batch_size=8, num_generations=8, use_cpu=True), 2)
    config, _ = from_trl({"max_steps": 8, "per_device_train_batch_size": 8, "num_generations": 8}, num_processes=2)
    assert (config["train"]["prompts_per_step"], config["train"]["micro_batch_size"]) == (2, 8)


def test_grpokit_from_trl_is_the_function_every_time():
    import grpokit.trl_config

    assert grpokit.from_trl is grpokit.trl_config.from_trl and grpokit.from_trl is grpokit.from_trl


# Completions of known shapes (answers right and wrong, with and without <think>, of several
# lengths), handed out in turn: TRL's functions must score each as TRL itself does.
REPLIES = ["<think>\n2 and 2\n</think>\n$\\boxed{4}$", "$\\boxed{5}$", "<think>no</think> The answer is 4",
           "<think>\nlong thinking " + "x " * 10 + "\n</think>\n\\boxed{4}", "nothing", "\\boxed{4}"]


class ReplyEngine(scripted_engine.ScriptedEngine):
    def generate(self, prompts, n, params, seeds=None):
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        completions = []
        for i in range(sum(counts)):
            ids = self.tokenizer(REPLIES[i % len(REPLIES)], add_special_tokens=False)["input_ids"] + [self.eos_id]
            ids = ids[: params.max_tokens]
            completions.append({"token_ids": ids, "logprobs": [0.0] * len(ids), "entropies": [1.0] * len(ids),
                                "finish_reason": "stop" if ids[-1] == self.eos_id else "length"})
        return from_completions(prompts, counts, completions, self.tokenizer.pad_token_id)


def test_trl_reward_functions_give_trl_s_values_in_a_grpokit_run(tmp_path, monkeypatch):
    from trl.rewards import accuracy_reward, get_cosine_scaled_reward, get_soft_overlong_punishment, think_format_reward

    monkeypatch.setitem(ENGINES, "scripted", "test_from_trl:ReplyEngine")
    overlong, cosine = get_soft_overlong_punishment(24, 12), get_cosine_scaled_reward(24)
    rows = [{"prompt": f"What is {i} + {4 - i}?", "solution": "$4$"} for i in range(5)]
    result = grpokit.train(model="tiny-random", dataset=rows, progress=False,
                           reward_functions=[accuracy_reward, think_format_reward, overlong, cosine],
                           rollout={"engine": "scripted", "num_generations": 6, "max_completion_length": 40},
                           train={"prompts_per_step": 2, "max_steps": 1, "output_dir": str(tmp_path / "run")},
                           data={"eval_size": 0}, monitor={"log_completions": 1})
    config = (result.run_dir / "config.yaml").read_text()
    assert "trl.rewards.accuracy_rewards:accuracy_reward" in config  # importable: recorded by module path
    records = [json.loads(line) for line in (result.run_dir / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 12 and len({r["completion"][0]["content"] for r in records}) == len(REPLIES)
    tokenizer = result.tokenizer
    for r in records:
        completion = r["completion"]
        # As TRL passes them: the sampled ids, the EOS that ended the completion included.
        ids = [tokenizer(completion[0]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
        expected = {
            "accuracy_reward": accuracy_reward([completion], solution=["$4$"])[0],
            "think_format_reward": think_format_reward([completion])[0],
            "soft_overlong_punishment_reward": overlong(completion_ids=ids)[0],
            "cosine_scaled_reward": cosine([completion], solution=["$4$"], completion_ids=ids)[0],
        }
        # Keys name an importable function by its module path, a factory's product by its own name.
        got = {k.removeprefix("rewards/").rsplit(":", 1)[-1]: v for k, v in r.items() if k.startswith("rewards/")}
        assert got == pytest.approx(expected), completion
    assert {r["rewards/trl.rewards.accuracy_rewards:accuracy_reward"] for r in records} == {0.0, 1.0}
    assert {r["rewards/trl.rewards.format_rewards:think_format_reward"] for r in records} == {0.0, 1.0}
    assert len({r["rewards/soft_overlong_punishment_reward"] for r in records}) > 2  # lengths in the punished zone


def test_trl_reward_functions_by_name_in_yaml(tmp_path):
    from grpokit.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "solution": f"${i + 1}$"}) + "\n"
                            for i in range(6)))
    assert main(["train", "--no-progress", "model.name=tiny-random", f"data.path={data}", "data.eval_size=2",
                 "train.max_steps=1", "train.prompts_per_step=2", "rollout.num_generations=2",
                 f"train.output_dir={tmp_path / 'run'}",
                 "reward.functions=[trl.rewards:accuracy_reward, trl.rewards:think_format_reward]"]) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert "rewards/trl.rewards:think_format_reward/mean" in row
