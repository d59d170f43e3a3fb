"""grpokit.train from Python: in-memory data, callables, a loaded model; the same run as the CLI's."""

import json

import pytest
import torch

import grpokit
from grpokit.cli import main
from grpokit.rundir.folder import read_metrics
from grpokit.runtime.errors import ConfigError

ROWS = [{"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b)}
        for a in range(4) for b in range(5)]
# The same run's settings, as the API and the CLI take them.
SETTINGS = {"model": {"name": "tiny-random"}, "data": {"eval_size": 4},
            "rollout": {"num_generations": 3, "max_completion_length": 4},
            "train": {"prompts_per_step": 2, "max_steps": 2, "eval_every": 1, "learning_rate": 1e-3}}


def closure_reward(target):
    def near_length(completions, **kwargs):  # a closure: its config name is its own, registered
        return [-abs(len(c[0]["content"]) - target) / 10 for c in completions]
    return near_length


class AnswerReward:
    """A callable object, as TRL accepts: scores the completions that contain the answer."""

    __name__ = "answer_reward"

    def __call__(self, completions, answer, **kwargs):
        return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]


class AsyncLength:
    """A callable object whose __call__ is a coroutine function: awaited like an async function."""

    async def __call__(self, completions, **kwargs):
        return [-0.01 * len(c[0]["content"]) for c in completions]


def adder(offset):
    def add(a: int, b: int) -> int:
        """Add two integers and an offset.

        Args:
            a: The first.
            b: The second.
        """
        return a + b + offset
    return add


def test_the_api_trains_from_objects_and_gives_the_cli_s_run(tmp_path):
    from datasets import Dataset

    result = grpokit.train(SETTINGS, dataset=Dataset.from_list(ROWS),
                           reward_functions=[closure_reward(5), {"name": AnswerReward(), "weight": 0.5}],
                           progress=False, **{"train.output_dir": str(tmp_path / "api")})
    run = result.run_dir
    for name in ("config.yaml", "metrics.jsonl", "final/config.json", "final/README.md", "data/train.jsonl"):
        assert (run / name).is_file(), name
    assert [row["step"] for row in result.eval_history] == [0, 1, 2]
    # final/README.md is a model card: metadata, and the eval table at each evaluation.
    from huggingface_hub import ModelCard

    card = ModelCard.load(run / "final" / "README.md")
    assert card.data.library_name == "grpokit" and "grpo" in card.data.tags and card.data.base_model is None
    table = [line for line in card.text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| step | eval/reward | eval/rewards/near_length/mean | eval/rewards/answer_reward/mean")
    assert [line.split(" | ")[0] for line in table[1:]] == ["| 0", "| 1", "| 2"]
    assert f"| 2 | {result.eval_history[-1]['eval/reward']:.4f} |" in card.text
    assert (run / "final" / "reward.png").is_file() and "![reward per step](reward.png)" in card.text
    assert "near_length" in card.text and "answer_reward" in card.text
    # The trained model generates.
    ids = result.tokenizer("What is 1 + 2?", return_tensors="pt").input_ids
    out = result.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)

    # The CLI, on the same rows from a file and the same callables registered by name: the same run.
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    grpokit.rewards.REWARD_FUNCTIONS.update(near_length=closure_reward(5), answer_reward=AnswerReward())
    overrides = [f"{section}.{k}={v}" for section, fields in SETTINGS.items() for k, v in fields.items()]
    assert main(["train", "--no-progress", *overrides, f"data.path={data}", f"train.output_dir={tmp_path / 'cli'}",
                 "reward.functions=[near_length, {name: answer_reward, weight: 0.5}]"]) == 0
    api_rows, cli_rows = read_metrics(run / "metrics.jsonl"), read_metrics(tmp_path / "cli" / "metrics.jsonl")
    assert len(api_rows) == 5
    drop = ("step_time", "time/")
    assert ([{k: v for k, v in r.items() if not k.startswith(drop)} for r in api_rows]
            == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in cli_rows])


def test_a_loaded_model_is_trained_in_place_and_async_rewards_run(tmp_path, monkeypatch, capsys):
    from grpokit.models.loading import load_model, load_tokenizer
    import grpokit.training.trainer

    def broken_card(*args):
        raise OSError("no plotting today")

    monkeypatch.setattr(grpokit.training.trainer, "write_model_card", broken_card)  # the run is done all the same

    model, tokenizer = load_model("tiny-random"), load_tokenizer("tiny-random")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    async def answered(completions, answer, **kwargs):
        return [float(a in c[0]["content"]) - 0.1 * len(c[0]["content"]) for c, a in zip(completions, answer)]

    result = grpokit.train(model=model, tokenizer=tokenizer, dataset=ROWS[:12], eval_dataset=ROWS[12:],
                           reward_functions=[answered, AsyncLength()], progress=False,
                           **{**{f"{s}.{k}": v for s, f in SETTINGS.items() for k, v in f.items() if s != "model"},
                              "train.output_dir": str(tmp_path / "run"), "data.eval_size": 3})
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())  # trained in place
    final = load_model(str(result.run_dir / "final"))
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in final.named_parameters())
    saved = (result.run_dir / "config.yaml").read_text()
    assert "answered" in saved and "data/eval.jsonl" in saved
    steps = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "rewards/AsyncLength/mean" in r]
    assert len(steps) == 2 and all(r["rewards/AsyncLength/mean"] < 0 for r in steps)  # awaited, scored
    assert "model card (final/README.md) was not written: OSError: no plotting today" in capsys.readouterr().out
    assert not (result.run_dir / "final" / "README.md").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(reward_functions=["exact_answer", 3]), "reward_functions[1]=3 is not callable"),
    (dict(reward_functions=[lambda prompts: [0.0]]), "reward function 'lambda' takes no argument 'answer', 'completion_ids', 'completions'"),
    (dict(dataset=[{"question": "1 + 1?"}]), "no column 'prompt'"),
    (dict(dataset="missing.jsonl"), "does not exist"),
    (dict(dataset=42), "dataset must be a path, a datasets.Dataset or a list of dicts, got int"),
    (dict(model=torch.nn.Linear(2, 2)), "model= must be a model name"),
    (dict(tools=[print, "x"]), "tool"),
    (dict(tools=[adder(1), adder(2)]), "rollout.tools names two tools called 'add'"),
])
def test_bad_input_is_named_before_anything_is_trained(tmp_path, kwargs, message):
    kwargs = {"model": "tiny-random", "dataset": ROWS, "reward_functions": ["exact_answer"], **kwargs}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        grpokit.train(progress=False, data={"eval_size": 4},
                      **{"train.output_dir": str(tmp_path / "run")}, **kwargs)
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_a_refused_start_removes_only_the_folder_it_made(tmp_path, monkeypatch):
    # No train.output_dir, a dataset by path: the refusal comes before any run folder is named, and
    # the working directory's own data/ stays.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ConfigError, match="takes no argument"):
        grpokit.train(model="tiny-random", dataset="data/rows.jsonl", reward_functions=[lambda x: [0.0]], progress=False,
                      data={"eval_size": 4})
    assert (tmp_path / "data" / "rows.jsonl").is_file() and not (tmp_path / "runs").exists()
    # A folder that is not a run's keeps its own data/train.jsonl: the dataset is not written over it.
    mine = tmp_path / "project"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "train.jsonl").write_text("my notes\n")
    with pytest.raises(ConfigError, match=r"would be written to .*project/data/train.jsonl, which holds another file"):
        grpokit.train(model="tiny-random", dataset=ROWS, reward_functions=["exact_answer"], progress=False,
                      **{"train.output_dir": str(mine)})
    assert (mine / "data" / "train.jsonl").read_text() == "my notes\n"
    # A folder that existed before the call is left as it was, with what the call wrote.
    (mine / "data" / "train.jsonl").unlink()
    with pytest.raises(ConfigError, match="takes no argument"):
        grpokit.train(model="tiny-random", dataset=ROWS, reward_functions=[lambda x: [0.0]], progress=False, data={"eval_size": 4},
                      **{"train.output_dir": str(mine)})
    assert mine.is_dir()


def test_a_dataset_dict_gives_its_train_split_to_train_and_its_test_split_to_evaluate():
    from datasets import Dataset, DatasetDict

    from grpokit.api import _rows

    splits = DatasetDict({"train": Dataset.from_list(ROWS[:3]), "test": Dataset.from_list(ROWS[3:5])})
    assert _rows(splits, "dataset", "prompt") == ROWS[:3] and _rows(splits, "eval_dataset", "prompt") == ROWS[3:5]
    with pytest.raises(ConfigError, match="eval_dataset is a DatasetDict with splits \\['train'\\] but no 'test' or 'validation'"):
        _rows(DatasetDict({"train": splits["train"]}), "eval_dataset", "prompt")


def test_a_dataset_object_without_the_prompt_column_and_a_model_without_tokenizer(tmp_path, tiny):
    from datasets import Dataset

    with pytest.raises(ConfigError, match=r"dataset has no column 'prompt' \(data.prompt_column\); its columns: \['q'\]"):
        grpokit.train(dataset=Dataset.from_list([{"q": "x"}]), progress=False)
    with pytest.raises(ConfigError, match="tokenizer= is missing"):
        grpokit.train(model=tiny[0], dataset=ROWS, progress=False)
    with pytest.raises(ConfigError, match="reward_functions= and reward.functions both"):
        grpokit.train({"reward": {"functions": ["exact_answer"]}}, reward_functions=[AnswerReward()], progress=False)


def test_a_loaded_model_the_api_cannot_use_is_named(tiny):
    import copy

    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    with pytest.raises(ConfigError, match="model.dtype=float64 but model= holds float32 weights"):
        grpokit.train(model=model, tokenizer=tokenizer, dataset=ROWS, progress=False, **{"model.dtype": "float64"})
    config = copy.deepcopy(model.config)
    config._name_or_path = ""
    unnamed, bare_tokenizer = AutoModelForCausalLM.from_config(config), copy.deepcopy(tokenizer)
    bare_tokenizer.name_or_path = ""
    with pytest.raises(ConfigError, match="no name_or_path .* and model.lora_rank loads the model by that name"):
        grpokit.train(model=unnamed, tokenizer=bare_tokenizer, dataset=ROWS, progress=False, **{"model.lora_rank": 4})
    unnamed.hf_device_map = {"": "cpu"}
    with pytest.raises(ConfigError, match="loaded with device_map= or quantized"):
        grpokit.train(model=unnamed, tokenizer=tokenizer, dataset=ROWS, progress=False)
    with pytest.raises(ConfigError, match="model.quantization=nf4 quantizes the weights as model.name loads, but model="):
        grpokit.train(model=model, tokenizer=tokenizer, dataset=ROWS, progress=False,
                      **{"model.quantization": "nf4", "model.lora_rank": 4})


def test_a_config_given_is_never_changed(tmp_path):
    from grpokit.config.loading import load_config

    config = load_config(values={"model.name": "tiny-random"})
    for _ in range(2):  # the same call twice: the same refusal, not one left over from the first call
        with pytest.raises(ConfigError, match="no column 'prompt'"):
            grpokit.train(config, dataset=[{"q": "x"}], reward_functions=[AnswerReward()], progress=False)
    assert config.reward.functions is None and config.train.output_dir is None and config.data.path is None


def test_overrides_as_sections_and_dotted_keys_win_over_the_config(tmp_path):
    from grpokit.api import _config

    config = _config({"train": {"max_steps": 7, "seed": 3}, "data.task_args": {}},
                     {"train": {"max_steps": 2}, "rollout.num_generations": 4})
    assert (config.train.max_steps, config.train.seed, config.rollout.num_generations) == (2, 3, 4)
    with pytest.raises(ConfigError, match="unknown config key 'train.max_step'"):
        _config(None, {"train.max_step": 2})


def test_the_model_card_names_the_hub_model_and_dataset():
    from huggingface_hub import ModelCard

    from grpokit.rundir.model_card import model_card
    from grpokit.settings.schema import Config

    config = Config()
    config.data.path, config.model.lora_rank = "trl-lib/DeepMath-103K", 8
    card = ModelCard(model_card(config.to_dict(), [], ["accuracy_reward"], "run-1", None))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.base_model_relation == "adapter"
    assert card.data.datasets == ["trl-lib/DeepMath-103K"] and "peft" in card.data.tags


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """The README's example of grpokit.train, with tiny-random for the bundled model and 1 step."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("## From Python"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python"))]
    assert '"smollm2-135m-instruct"' in code and '"max_steps": 20' in code
    code = code.replace('"smollm2-135m-instruct"', '"tiny-random"').replace('"max_steps": 20', '"max_steps": 1')
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["result"].eval_history[-1]["step"] == 1 and namespace["model"] is not None


def test_tools_and_an_environment_as_python_objects(tmp_path, monkeypatch):
    """Tools and an environment class given as objects (a closure among them): registered, named in
    config.yaml, and called by the model's tool calls (the scripted engine writes them)."""
    from support import scripted_engine
    from grpokit.engines.protocols import ENGINES

    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")
    offset = 10

    def add(a: int, b: int) -> int:
        """Add two integers, plus an offset held by a closure.

        Args:
            a: The first.
            b: The second.
        """
        return a + b + offset

    class Counter:
        def reset(self, **row):
            self.calls = 0

        def bump(self) -> str:
            """Count a call."""
            self.calls += 1
            return str(self.calls)

        def get_reward(self) -> float:
            return float(self.calls)

    monkeypatch.setattr(scripted_engine, "SCRIPT", [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "bump", "arguments": {}}\n</tool_call>', "13"])
    result = grpokit.train(model="tiny-random", dataset=ROWS, tools=[add], environment=Counter, progress=False,
                           reward_functions=["exact_answer"],
                           rollout={"engine": "scripted", "num_generations": 2, "max_completion_length": 200},
                           train={"prompts_per_step": 2, "max_steps": 1, "output_dir": str(tmp_path / "run")},
                           data={"eval_size": 0}, monitor={"log_completions": 1})
    config = (result.run_dir / "config.yaml").read_text()
    assert "- add\n" in config and "environment: Counter" in config
    step = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert step["tools/calls_per_rollout"] == 2 and step["tools/failures"] == 0
    assert step["rewards/Counter/mean"] == 1.0
    record = json.loads((result.run_dir / "completions.jsonl").read_text().splitlines()[0])
    assert any(m.get("role") == "tool" and m["content"] == "13" for m in record["completion"])  # the closure's sum


def test_a_callable_never_takes_a_built_in_s_name_or_one_registered_by_hand(monkeypatch):
    from grpokit.api import _reward_entries
    from grpokit.rewards.reward_set import REWARD_FUNCTIONS

    def length(completions, **kwargs):
        return [0.0] * len(completions)

    def mine(completions, **kwargs):
        return [1.0] * len(completions)

    monkeypatch.setitem(REWARD_FUNCTIONS, "mine", lambda completions, **kwargs: [2.0] * len(completions))
    entries = _reward_entries([length, mine, {"name": mine, "weight": 2}])
    assert entries == ["length_2", "mine_2", {"name": "mine_3", "weight": 2}]
    assert REWARD_FUNCTIONS["length_2"] is length and REWARD_FUNCTIONS["mine"] is not mine
