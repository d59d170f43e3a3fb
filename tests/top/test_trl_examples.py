"""TRL's own documented examples, in their TRL form, through `grpokit.train`: the GRPO quick start,
the reward-function examples (string prompts, `trainer_state`, `log_metric` / `log_extra`), the
Tools example with `examples/scripts/grpo_agent.py`'s reward functions, and the `IncrementEnv`
environments (without a dataset, with one, several of them). Each runs as TRL runs it, or is
refused with the reason; tiny-random generates, the scripted engines write the replies that
random weights never would (tool calls, boxed answers)."""

import json
import random
import re
import sqlite3

import pytest
from support.conversations import tool_call
from support.runs import completions_log, metric_rows

import grpokit
from support import scripted_engine
from grpokit.engines.batch import from_completions
from grpokit.engines.protocols import ENGINES
from grpokit.rewards.reward_set import RewardError
from grpokit.runtime.errors import ConfigError

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")

# A tiny run's settings, as grpokit.train takes them beside TRL's arguments.
TINY = {"rollout": {"num_generations": 2, "max_completion_length": 8}, "train": {"prompts_per_step": 2, "max_steps": 2},
        "data": {"eval_size": 0}, "monitor": {"log_completions": 1}}


def settings(tmp_path, **sections):
    return {**{k: {**v, **sections.get(k, {})} for k, v in TINY.items()},
            **{k: v for k, v in sections.items() if k not in TINY}, "progress": False,
            "train": {**TINY["train"], "output_dir": str(tmp_path / "run"), **sections.get("train", {})}}


BOXED = [" The solution is \\boxed{2}.", " The solution is \\boxed{6}."]


class BoxedEngine(scripted_engine.ScriptedEngine):
    """Replies BOXED[0] and BOXED[1] in turn, whatever the prompt."""

    def generate(self, prompts, n, params, seeds=None):
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        completions = []
        for i in range(sum(counts)):
            ids = (self.tokenizer(BOXED[i % 2], add_special_tokens=False)["input_ids"] + [self.eos_id])[:params.max_tokens]
            completions.append({"token_ids": ids, "logprobs": [0.0] * len(ids), "entropies": [1.0] * len(ids),
                                "finish_reason": "stop" if ids[-1] == self.eos_id else "length"})
        return from_completions(prompts, counts, completions, self.tokenizer.pad_token_id)


@pytest.fixture
def boxed(monkeypatch):
    monkeypatch.setitem(ENGINES, "boxed", "test_trl_examples:BoxedEngine")


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")

    def script(*replies):
        monkeypatch.setattr(scripted_engine, "SCRIPT", list(replies))
    return script


# ---------------------------------------------------------------- the quick start and the reward examples


def test_the_quick_start_a_single_reward_function_and_trl_s_argument_names(tmp_path):
    from datasets import Dataset
    from trl.rewards import accuracy_reward

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": f"${i + 1}$"}
                                 for i in range(4)])
    # TRL's quick start: one reward function (not a list), train_dataset=; a GRPOConfig as args=.
    result = grpokit.train(model="tiny-random", reward_funcs=accuracy_reward, train_dataset=dataset,
                           args=trl.GRPOConfig(max_steps=1, num_generations=2, per_device_train_batch_size=2,
                                               max_completion_length=4, bf16=False, use_cpu=True, report_to="none",
                                               eval_strategy="no", output_dir=str(tmp_path / "run")),
                           progress=False)
    assert "rewards/trl.rewards.accuracy_rewards:accuracy_reward/mean" in metric_rows(result.run_dir)[0]
    # grpokit's names take one function too; both names at once are refused.
    with pytest.raises(ConfigError, match="reward_functions= and reward_funcs= .TRL's name for it. are both given"):
        grpokit.train(model="tiny-random", reward_functions=accuracy_reward, reward_funcs=accuracy_reward)
    with pytest.raises(ConfigError, match="dataset= and train_dataset= .TRL's name for it. are both given"):
        grpokit.train(model="tiny-random", dataset=[{"prompt": "a"}], train_dataset=[{"prompt": "a"}])


def reward_func(completions, ground_truth, **kwargs):
    """TRL's reward Example 3 ("designed for standard format"), as documented."""
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


STANDARD = [{"prompt": "Problem: Solve the equation $2x + 3 = 7$. Solution:", "ground_truth": "2"},
            {"prompt": "Problem: Solve the equation $3x - 5 = 10$.", "ground_truth": "5"}] * 3


def test_string_prompts_go_as_plain_text_in_a_trl_shaped_call(tmp_path, boxed, capsys):
    """TRL sends a string prompt without the chat template and passes completions as strings: a
    TRL-shaped call does too; with grpokit's names the chat template is on, and the error says
    which setting gives TRL's behaviour."""
    result = grpokit.train(model="tiny-random", reward_funcs=reward_func, train_dataset=STANDARD,
                           **settings(tmp_path, rollout={"engine": "boxed", "max_completion_length": 16}))
    assert "string prompts are sent as plain text, as TRL does (data.chat_template=false" in capsys.readouterr().err
    assert "chat_template: false" in (result.run_dir / "config.yaml").read_text()
    for r in completions_log(result.run_dir):
        assert isinstance(r["prompt"], str) and isinstance(r["completion"], str)
        truth = next(row["ground_truth"] for row in STANDARD if row["prompt"] == r["prompt"])
        assert r["reward"] == float(re.search(r"\\boxed\{(.*?)\}", r["completion"]).group(1) == truth)
    with pytest.raises(RewardError) as e:
        grpokit.train(model="tiny-random", reward_functions=reward_func, dataset=STANDARD,
                      **settings(tmp_path, rollout={"engine": "boxed"}, train={"output_dir": str(tmp_path / "other")}))
    assert "data.chat_template=false sends them as plain text and passes completions as strings, as TRL" in str(e.value)


def logging_reward(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """TRL's reward Example 6 (logging extra columns and metrics), as documented."""
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards


def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A curriculum reward: it reads the trainer's progress (required parameters, as TRL passes them)."""
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("global_step", [trainer_state.global_step] * len(completions))
    return [float(trainer_state.global_step)] * len(completions)


def test_trainer_state_log_metric_and_log_extra_reach_reward_functions(tmp_path, boxed):
    result = grpokit.train(model="tiny-random", reward_funcs=[logging_reward, curriculum], train_dataset=STANDARD,
                           **settings(tmp_path, rollout={"engine": "boxed", "max_completion_length": 16},
                                      data={"eval_size": 2}, train={"eval_every": 1}))
    rows = metric_rows(result.run_dir)
    train = [r for r in rows if "loss" in r]
    # TRL's units: optimizer updates, so global_step / max_steps is the share of the run done.
    assert [r["progress"] for r in train] == [0.0, 0.5]
    # (Importable functions are named by their module path.)
    assert [r["rewards/test_trl_examples:curriculum/mean"] for r in train] == [0.0, 1.0]
    assert all(r["accuracy"] == r["rewards/test_trl_examples:logging_reward/mean"] for r in train)
    assert [r["eval/progress"] for r in rows if "eval/reward" in r] == [0.0, 0.5, 1.0]
    samples = completions_log(result.run_dir)
    assert {(s["step"], s["global_step"]) for s in samples} == {(1, 0), (2, 1)}
    for s in samples:
        assert s["golden_answer"] in ("2", "5") and s["extracted_answer"] in ("2", "6")
        assert s["rewards/test_trl_examples:logging_reward"] == float(s["golden_answer"] == s["extracted_answer"])


def test_a_logged_name_that_is_grpokit_s_own_is_named(tmp_path, boxed):
    def clashes(completions, log_metric, **kwargs):
        log_metric("reward", 1.0)
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="log_metric\\('reward', ...\\): 'reward' is one of grpokit's own metric names"):
        grpokit.train(model="tiny-random", reward_funcs=clashes, train_dataset=STANDARD,
                      **settings(tmp_path, rollout={"engine": "boxed"}))


# ---------------------------------------------------------------- tools: grpo_agent.py's rewards


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    conn = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
    try:
        return conn.execute(sql_command).fetchall()
    finally:
        conn.close()


def query_reward(completions, answer, **kwargs):
    """grpo_agent.py's query_reward: it reads the tool results as the tool returned them (a list)."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        reward = 0.0
        sql_queries = []
        tool_results = []
        for turn in completion:
            if turn.get("tool_calls"):
                for call in turn["tool_calls"]:
                    sql = call["function"]["arguments"].get("sql_command", "").lower()
                    sql_queries.append(sql)
            if turn.get("role") == "tool" and turn.get("content"):
                tool_results.append(turn["content"])
        if len(sql_queries) > 3:
            reward -= 1.5
        where_count = 0
        for q in sql_queries:
            if "limit 1" in q:
                reward -= 1.0
            if " where " not in q:
                reward -= 0.5
            else:
                where_count += 1
        reward += min(where_count, 3) * 0.4
        combined_results = []
        error_detected = False
        for res in tool_results:
            if isinstance(res, dict) and "error" in res:
                error_detected = True
            elif isinstance(res, list):
                combined_results.extend(res)
        if error_detected:
            reward -= 2.0
        elif len(sql_queries) == 0:
            reward -= 1.5
        else:
            has_hits = len(combined_results) > 0
            correct_answer = ans.lower()
            if (has_hits and correct_answer == "yes") or (not has_hits and correct_answer == "no"):
                reward += 2.0
            else:
                reward -= 1.5
        rewards.append(reward)
    return rewards


def correctness_reward(completions, answer, **kwargs):
    """grpo_agent.py's correctness_reward."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        match = re.search(r"\*(yes|no)\*", completion[-1]["content"].lower())
        guess = match.group(1) if match else None
        rewards.append(-0.5 if guess is None else 0.6 if guess == ans.lower() else -1.0)
    return rewards


def test_tool_results_reach_reward_functions_as_the_tool_returned_them(tmp_path, monkeypatch, scripted):
    """The agent example: a tool returning a list of rows; its reward tests `isinstance(res, list)`.
    The model reads the rows as text; the reward function gets the list, as in TRL."""
    monkeypatch.chdir(tmp_path)
    with sqlite3.connect("biogrid.db") as db:
        db.execute("CREATE TABLE interactions (gene TEXT, partner TEXT)")
        db.execute("INSERT INTO interactions VALUES ('JNKK', 'MAPK8')")
    scripted(tool_call("query_biogrid", sql_command="SELECT partner FROM interactions WHERE gene = 'JNKK'"), "*Yes*")
    dataset = [{"prompt": [{"role": "user", "content": "Does the gene JNKK interact with MAPK8?"}], "answer": "yes"},
               {"prompt": [{"role": "user", "content": "Does the gene JNKK interact with TP53?"}], "answer": "no"}]
    result = grpokit.train(model="tiny-random", tools=[query_biogrid], train_dataset=dataset,
                           reward_funcs=[correctness_reward, query_reward],
                           **settings(tmp_path, rollout={"engine": "scripted", "max_completion_length": 200}))
    for r in completions_log(result.run_dir):
        tool = next(m for m in r["completion"] if m["role"] == "tool")
        assert tool["content"] == [["MAPK8"]]  # the list (its tuple written as JSON)
        yes = "MAPK8" in r["prompt"][-1]["content"]
        assert r["rewards/test_trl_examples:query_reward"] == pytest.approx(2.4 if yes else -1.1)  # WHERE +0.4, hits +2 / -1.5
        assert r["rewards/test_trl_examples:correctness_reward"] == pytest.approx(0.6 if yes else -1.0)


# ---------------------------------------------------------------- environments: TRL's IncrementEnv


class IncrementEnv:
    """TRL's first environment example: reset() draws the task and returns the prompt; no dataset."""

    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def test_an_environment_without_a_dataset_brings_the_prompts(tmp_path, scripted):
    scripted(tool_call("increment", step=3), "Done.")
    result = grpokit.train(model="tiny-random", environment_factory=IncrementEnv,
                           args=trl.GRPOConfig(max_steps=2, num_generations=4, per_device_train_batch_size=8,
                                               max_completion_length=200, bf16=False, use_cpu=True, report_to="none",
                                               output_dir=str(tmp_path / "run")),
                           rollout={"engine": "scripted"}, monitor={"log_completions": 1}, progress=False)
    assert "task: environment" in (result.run_dir / "config.yaml").read_text()
    row = metric_rows(result.run_dir)[-1]
    assert [k for k in row if k.startswith("rewards/") and k.endswith("/mean")] == ["rewards/IncrementEnv/mean"]
    samples = completions_log(result.run_dir)
    assert len(samples) == 2 * 8
    targets = set()
    for s in samples:  # the prompt is reset()'s text, and get_reward() scored the counter it reached
        (message,) = s["prompt"]
        target = int(re.fullmatch(r"Increment the counter by (\d)\.", message["content"]).group(1))
        targets.add(target)
        assert s["reward"] == float(target == 3)
        assert [m["content"] for m in s["completion"] if m["role"] == "tool"] == ["3"]
    assert len(targets) > 1  # each rollout drew its own, as in TRL


def test_an_environment_without_a_dataset_must_return_the_prompt(tmp_path, scripted):
    class Silent(IncrementEnv):
        def reset(self, **kwargs) -> None:
            self.counter, self.target = 0, 3

    with pytest.raises(ConfigError, match="environment 'Silent': reset\\(\\) returned None, and there is no dataset"):
        grpokit.train(model="tiny-random", environment_factory=Silent, **settings(tmp_path, rollout={"engine": "scripted"}))
    assert not (tmp_path / "run").exists()


def test_an_environment_with_a_dataset_and_its_reward_alone(tmp_path, scripted):
    """TRL's "external dataset" example: reset(target) reads the row; get_reward() is the only reward."""
    from datasets import Dataset

    # Each row carries the prompt and the task data (here, the counter target to reach).
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )

    class IncrementToTarget(IncrementEnv):
        def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
            self.counter = 0
            self.target = target

    scripted(tool_call("increment", step=3), "Done.")
    result = grpokit.train(model="tiny-random", train_dataset=dataset, environment_factory=IncrementToTarget,
                           **settings(tmp_path, rollout={"engine": "scripted", "max_completion_length": 200}))
    for s in completions_log(result.run_dir):
        assert s["reward"] == float(s["prompt"][-1]["content"] == "Increment the counter to 3.")
    # The same with the data named by a config (it was refused there, before the environment was in).
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in dataset.to_list()))
    grpokit.train({"data": {"path": str(rows)}}, model="tiny-random", environment=IncrementToTarget,
                  **settings(tmp_path, rollout={"engine": "scripted", "max_completion_length": 200},
                             train={"max_steps": 1, "output_dir": str(tmp_path / "from-config")}))
    # No reward at all is refused, naming what would give one.
    class Unscored:
        def reset(self, **kwargs):
            return None

        def noop(self) -> str:
            """Do nothing."""
            return ""

    with pytest.raises(ConfigError, match="nothing gives a reward: reward.functions is not set"):
        grpokit.train(model="tiny-random", train_dataset=dataset, environment_factory=Unscored,
                      **settings(tmp_path, rollout={"engine": "scripted"}, train={"output_dir": str(tmp_path / "none")}))


def test_a_dict_of_environments_is_refused_saying_so(tmp_path):
    with pytest.raises(ConfigError, match="environment= is a dict of 2 environments .TRL's multi-environment form"):
        grpokit.train(model="tiny-random", environment_factory={"a": IncrementEnv, "b": IncrementEnv},
                      train_dataset=[{"environment": "a", "prompt": "x"}])
