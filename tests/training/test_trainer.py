"""Training steps on tiny-random: parameters move, the run directory is complete, final/ reloads."""

import json

import pytest
import torch
import yaml
from support.rewards import shortness
from support.runs import measured

from grpokit.config.loading import load_config
from grpokit.rewards.reward_set import RewardSet
from grpokit.training.trainer import Trainer


@pytest.fixture
def make_trainer(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("grpokit.rewards", fromlist=["x"]).REWARD_FUNCTIONS, "shortness", shortness)

    def make(*overrides, reward="shortness"):
        config = load_config(None, [
            "model.name=tiny-random", "data.eval_size=6", "train.prompts_per_step=2",
            "rollout.num_generations=4", "rollout.max_completion_length=6", "train.learning_rate=1e-3",
            f"train.output_dir={tmp_path / 'run'}", *overrides,
        ])
        trainer = Trainer(config, progress=False)
        trainer.rewards = trainer.scorer.rewards = RewardSet(((reward, 1.0, {}),))
        return trainer

    return make


def test_two_steps_change_every_parameter_and_write_the_run_dir(make_trainer, tmp_path):
    trainer = make_trainer("train.max_steps=2", "algorithm.beta=0.01", "train.eval_every=1")
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    result = trainer.train()
    for name, p in trainer.policy.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change"
    # The reference model is a frozen copy of the initial policy.
    for name, p in trainer.reference.named_parameters():
        assert torch.equal(p, before[name]) and not p.requires_grad

    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["algorithm"]["beta"] == 0.01
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in evals] == [0, 1, 2]  # before, during (eval_every=1), after
    required = {
        "step", "loss", "reward", "reward_std", "rewards/shortness/mean", "frac_reward_zero_std", "kl",
        "entropy", "clip_ratio/region_mean", "grad_norm", "learning_rate", "completions/mean_length",
        "completions/clipped_ratio", "step_time", "num_tokens",
    }
    assert required <= steps[0].keys()
    parts = ("time/generate", "time/logprobs", "time/update", "time/optimizer")  # the step's phases, apart
    for row in steps:
        assert all(row[p] > 0 for p in parts) and sum(row[p] for p in parts) <= row["step_time"]
    assert steps[0]["grad_norm"] > 0 and steps[0]["kl"] == 0  # policy == reference before update 1
    assert steps[1]["kl"] > 0 and steps[1]["num_tokens"] > steps[0]["num_tokens"]
    assert result.eval_history[0]["step"] == 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, dict(trainer.policy.named_parameters())[name])


def test_no_reference_model_when_beta_is_zero(make_trainer):
    trainer = make_trainer("train.max_steps=1")
    assert trainer.reference is None
    trainer.train()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "kl" not in next(r for r in rows if "loss" in r)


def test_a_step_without_signal_still_steps(make_trainer, monkeypatch):
    """Every group constant: no forward/backward is needed, the step completes with zero gradient."""
    monkeypatch.setitem(__import__("grpokit.rewards", fromlist=["x"]).REWARD_FUNCTIONS, "zero", lambda completions, **_: [0.0] * len(completions))
    trainer = make_trainer("train.max_steps=1", "data.eval_size=0", reward="zero")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train()
    row = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["frac_reward_zero_std"] == 1.0 and row["loss"] == 0 and row["grad_norm"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_a_failing_reward_stops_the_run_and_keeps_what_was_written(tmp_path, capsys):
    """The second call raises: the run stops with the function named, step 1 stays in metrics.jsonl."""
    from grpokit.cli import main

    (tmp_path / "flaky.py").write_text(
        "calls = []\n"
        "def flaky(completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        raise RuntimeError('scorer went away')\n"
        "    return [0.0] * len(completions)\n"
    )
    out = tmp_path / "run"
    code = main(["train", "--no-progress", "model.name=tiny-random", "data.eval_size=0", "train.max_steps=3",
                 "train.prompts_per_step=2", "rollout.num_generations=2", f"train.output_dir={out}",
                 f"reward.functions=[{tmp_path}/flaky.py:flaky]"])
    assert code == 1
    out_text, err = capsys.readouterr()
    assert "reward function 'flaky.py:flaky' raised RuntimeError: scorer went away" in err
    assert "on a batch of 4 completions" in err and "of prompt:" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    # Step 2 failed before any weight changed, so step 1 was saved: the same command resumes there
    # (here the function's call counter is past its failure, as a fixed function would be).
    assert "the run stopped after step 1; that state is saved in" in out_text
    assert (out / "checkpoints" / "step-1" / "trainer_state.json").exists()
    assert main(["train", "--no-progress", "model.name=tiny-random", "data.eval_size=0", "train.max_steps=3",
                 "train.prompts_per_step=2", "rollout.num_generations=2", f"train.output_dir={out}",
                 f"reward.functions=[{tmp_path}/flaky.py:flaky]"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_none_rewards_train_and_are_left_out_of_the_metrics(make_trainer, monkeypatch):
    """Completions a function does not apply to (None) are left out; a step still trains."""
    def half(completions, **columns):
        return [None if i % 2 else -float(len(c[0]["content"])) for i, c in enumerate(completions)]

    monkeypatch.setitem(__import__("grpokit.rewards", fromlist=["x"]).REWARD_FUNCTIONS, "half", half)
    trainer = make_trainer("train.max_steps=1", "data.eval_size=0", reward="half")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train()
    row = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["reward"] < 0 and row["rewards/half/mean"] == row["reward"]  # means over scored ones
    assert row["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_memory_knobs_leave_the_run_unchanged(tmp_path, monkeypatch):
    """model.gradient_checkpointing and train.logprob_chunk_size change memory, not the math: a
    3-step float64 run (beta > 0, two iterations: old and reference log-probs too) ends with the
    same weights and metrics as without them."""
    from support.exact import rmsnorm_in_input_dtype, update_difference
    from transformers.models.llama import modeling_llama

    from grpokit.models.loading import load_model

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)
    monkeypatch.setitem(__import__("grpokit.rewards", fromlist=["x"]).REWARD_FUNCTIONS, "shortness", shortness)
    runs = {}
    for name, knobs in (("plain", []), ("knobs", ["model.gradient_checkpointing=true", "train.logprob_chunk_size=5"])):
        config = load_config(None, [
            "model.name=tiny-random", "model.dtype=float64", "reward.functions=[shortness]", "data.eval_size=0",
            "train.prompts_per_step=2", "rollout.num_generations=4", "train.learning_rate=1e-3", "train.max_steps=3",
            "algorithm.beta=0.04", "algorithm.num_iterations=2", f"train.output_dir={tmp_path / name}", *knobs])
        trainer = Trainer(config, progress=False)
        assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.policy.modules()) == (name == "knobs")
        trainer.train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ({n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, rows)
    start = {n: p.detach() for n, p in load_model("tiny-random", "float64").named_parameters()}
    assert update_difference(start, runs["plain"][0], runs["knobs"][0]) < 1e-9
    for a, b in zip(runs["plain"][1], runs["knobs"][1]):
        for key, value in a.items():
            if not measured(key):
                assert b[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_optimizer_is_fused_adamw_and_steps_as_adamw(make_trainer):
    """The fused AdamW (one kernel over all weights, ~5x faster than the per-weight loop on CPU)
    against AdamW written out in float64, over three updates."""
    trainer = make_trainer("train.weight_decay=0.1", "train.learning_rate=1e-2")
    assert trainer.optimizer.defaults["fused"]
    params = trainer.params[:3]
    trainer.optimizer.param_groups[0]["params"] = params  # three weights are enough
    w = [p.detach().double().clone() for p in params]
    m, v = [torch.zeros_like(x) for x in w], [torch.zeros_like(x) for x in w]
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.999), 1e-8
    torch.manual_seed(0)
    for t in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        trainer.optimizer.step()
        for i, g in enumerate(grads):
            g = g.double()
            w[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            w[i] -= lr * (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
    for p, ref in zip(params, w):
        torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved", [None, False])
def test_a_resumed_run_runs_adamw_as_built_not_as_saved(make_trainer, tmp_path, saved):
    """A checkpoint's param groups say how the optimizer that wrote it ran (FSDP2's per-weight
    AdamW: fused False; a grpokit before the fused one: None). Resuming keeps this run's choice:
    torch's load_state_dict alone would take the saved one (and FSDP2 fails on a fused one)."""
    make_trainer("train.max_steps=1", "data.eval_size=0").train()
    path = tmp_path / "run" / "checkpoints" / "step-1" / "optimizer.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["param_groups"][0]["fused"] = saved
    torch.save(state, path)
    (path.parent / "manifest.json").unlink()  # as written by those versions, which wrote no manifest
    resumed = make_trainer("train.max_steps=2", "data.eval_size=0")
    assert resumed.progress.step == 1  # it did resume
    assert resumed.optimizer.param_groups[0]["fused"] is True
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-3  # the saved hyperparameters still load


@pytest.mark.parametrize("failing_call,saved", [(3, True), (4, False)], ids=["before-an-update", "after-an-update"])
def test_a_failure_inside_a_step_saves_the_step_before_unless_an_update_had_begun(make_trainer, monkeypatch,
                                                                                 failing_call, saved):
    """Two optimizer updates a step, one loss call each. Step 2's first call failing leaves the weights
    of step 1: that state is saved, weights included. Its second call fails after step 2's first
    update: the weights are those of no step, and nothing is saved."""
    from safetensors.torch import load_file

    from grpokit.algorithm.loss import LOSSES

    real, calls = LOSSES["grpo"], []

    def failing(inputs, settings):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("the loss went away")
        return real(inputs, settings)

    monkeypatch.setitem(LOSSES, "grpo", failing)
    trainer = make_trainer("train.max_steps=3", "data.eval_size=0", "train.updates_per_step=2", "algorithm.beta=0.01")
    after_step_1 = {}
    train_step = trainer.train_step

    def recording_step(step):
        row = train_step(step)
        after_step_1.update({n: p.detach().clone() for n, p in trainer.policy.named_parameters()})
        return row

    trainer.train_step = recording_step
    with pytest.raises(RuntimeError, match="the loss went away"):
        trainer.train()
    checkpoint = trainer.run_dir / "checkpoints" / "step-1"
    assert checkpoint.exists() == saved
    if saved:
        assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 1
        weights = load_file(checkpoint / "model.safetensors")
        assert all(torch.equal(weights[n], after_step_1[n]) for n in weights)


def test_a_loss_metric_the_loss_does_not_declare_is_an_error(make_trainer, monkeypatch):
    """Every process must log the same keys, so a loss's metrics are declared (loss.token_metric_names):
    one returned without a declaration stops the run rather than vanish from the metrics."""
    from grpokit.algorithm.loss import LOSSES

    real = LOSSES["grpo"]

    def with_extra_metric(inputs, settings):
        out = real(inputs, settings)
        out.token_sums["entropy_of_mine"] = out.token_sums["clip_ratio/low_mean"]
        return out

    monkeypatch.setitem(LOSSES, "grpo", with_extra_metric)
    trainer = make_trainer("train.max_steps=1", "data.eval_size=0", "algorithm.beta=0.01")
    with pytest.raises(ValueError, match=r"\['entropy_of_mine'\] that loss.token_metric_names does not name"):
        trainer.train()
