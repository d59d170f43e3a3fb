"""`grpokit eval` and the pass@k summary."""

import json

import pytest

from grpokit.cli import main
from grpokit.sampling.evaluation import summarize


def test_pass_at_k_and_means():
    records = [
        {"index": 0, "sample": 0, "reward": 1.0, "rewards": {"acc": 1.0, "len": -3.0}, "length": 4, "truncated": False},
        {"index": 0, "sample": 1, "reward": 0.0, "rewards": {"acc": 0.0, "len": -1.0}, "length": 2, "truncated": True},
        {"index": 1, "sample": 0, "reward": 0.0, "rewards": {"acc": 0.0, "len": -2.0}, "length": 6, "truncated": False},
        {"index": 1, "sample": 1, "reward": None, "rewards": {"acc": None, "len": -2.0}, "length": 6, "truncated": False},
    ]
    m = summarize(records, ["acc", "len"], num_samples=2, prefix="")
    assert m["rewards/acc/mean"] == pytest.approx(1 / 3)  # None is left out
    assert m["rewards/acc/pass@2"] == 0.5  # prompt 0 solved, prompt 1 not
    assert "rewards/len/pass@2" not in m  # not a right-or-wrong reward
    assert m["reward"] == pytest.approx(1 / 3) and m["completions/clipped_ratio"] == 0.25


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "train.max_steps=1", "data.eval_size=0",
                 "train.prompts_per_step=2", "rollout.num_generations=2", f"train.output_dir={out}"]) == 0
    return out / "final"


def test_eval_on_the_task_with_samples(trained, tmp_path, capsys):
    output = tmp_path / "completions.jsonl"
    code = main(["eval", "--model", str(trained), "--task", "arithmetic", "--num-samples", "3",
                 "--output", str(output), "data.eval_size=5", "rollout.max_completion_length=4"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "rewards/exact_answer/mean" in printed and "rewards/exact_answer/pass@3" in printed
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 15 and {r["sample"] for r in rows} == {0, 1, 2}
    assert {"prompt", "completion", "rewards", "reward"} <= rows[0].keys()


def test_eval_on_a_dataset(trained, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": i + 1}) + "\n" for i in range(4)))
    code = main(["eval", "--model", str(trained), "--data", str(data), "data.eval_size=4",
                 "reward.functions=[math_accuracy, {name: length, target: 3}]", "rollout.max_completion_length=4"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "greedy" in printed and "rewards/math_accuracy/mean" in printed and "rewards/length/mean" in printed


LOGGING_REWARD = '''
def longish(prompts, completions, log_metric, **kwargs):
    """1 for a prompt and completion of an odd number of characters; logs the share in its call."""
    values = [float(len(str(p) + str(c)) % 2) for p, c in zip(prompts, completions)]
    log_metric("longish_share", sum(values) / len(values))
    return values
'''


def test_a_logged_metric_of_an_evaluation_in_chunks_is_its_mean_over_completions(trained, tmp_path, monkeypatch):
    """Held-out prompts are scored in chunks (of 64; here of 6, for 10 prompts: 6 and 4): a reward
    function's log_metric value for the evaluation is the mean over the completions, not the mean
    of the calls'."""
    import functools

    from grpokit.api import evaluate
    from grpokit.config.loading import load_config
    from grpokit.sampling import evaluation

    monkeypatch.setattr(evaluation, "score", functools.partial(evaluation.score, batch_size=6))
    (tmp_path / "rewards.py").write_text(LOGGING_REWARD)
    config = load_config(None, ["data.eval_size=10", "rollout.max_completion_length=4",
                                f"reward.functions=[{tmp_path}/rewards.py:longish]"])
    output = tmp_path / "out.jsonl"
    metrics = evaluate(config, str(trained), output=str(output))
    values = [json.loads(line)["rewards"]["rewards.py:longish"] for line in output.read_text().splitlines()]
    assert len(values) == 10 and sum(values[:6]) / 6 != sum(values[6:]) / 4
    assert metrics["longish_share"] == pytest.approx(sum(values) / 10, abs=1e-12)
