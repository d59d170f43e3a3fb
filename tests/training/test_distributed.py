"""The central promise: micro-batch size and process count never change the update. Checked in
float64 (see exact.py) on a fixed rollout batch, and with real multi-process runs (torchrun /
accelerate launch, gloo) of a training step on a fixed batch and of `grpokit train`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from support.exact import (cut_ragged, off_the_sampler, rmsnorm_in_input_dtype, step_on, update_difference,
                           with_tool_turns)
from support.processes import TESTS, free_port, run_grpokit, run_worker, torchrun
from support.rewards import shortness
from support.teachers import another_teacher
from support.runs import assert_close_metrics, measured, metric_rows, untimed_metrics
from transformers.models.llama import modeling_llama

from grpokit.algorithm.loss import LOSSES
from grpokit.config.loading import load_config
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.rewards.reward_set import REWARD_FUNCTIONS
from grpokit.runtime.distributed import shard_rows
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.training.trainer import Trainer

# float64 end to end: agreement to ~1e-13 is typical; 1e-9 leaves room and still catches any
# normalization or accumulation bug, which shows up at 1e-3 or more.
EXACT = 1e-9


def test_shard_rows_split_every_update_evenly():
    N, U, W = 16, 8, 2
    owned = [shard_rows(N, U, W, r) for r in range(W)]
    assert owned[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]  # update 0's first half, update 1's first half
    assert owned[1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert sorted(torch.cat(owned).tolist()) == list(range(N))
    assert shard_rows(N, U, 1, 0).tolist() == list(range(N))
    with pytest.raises(ValueError, match="cannot be split over 3 processes"):
        shard_rows(N, U, 3, 0)


@pytest.fixture
def make_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)
    monkeypatch.setitem(REWARD_FUNCTIONS, "shortness", shortness)
    monkeypatch.setitem(REWARD_FUNCTIONS, "oddness", lambda completions, **columns: [
        float(len(c[0]["content"]) % 2) for c in completions])
    runs = iter(range(1000))

    def make(*overrides):
        config = load_config(None, [
            "model.name=tiny-random", "model.dtype=float64", "reward.functions=[shortness]",
            "data.eval_size=0", "train.prompts_per_step=2", "rollout.num_generations=4",
            "rollout.max_completion_length=6", "train.learning_rate=1e-3",
            f"train.output_dir={tmp_path / f'run{next(runs)}'}", *overrides,
        ])
        return Trainer(config, progress=False)

    return make


def one_step(trainer, examples, batch):
    """Parameters before and after a training step on a fixed rollout batch, and its metrics."""
    start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    metrics = step_on(trainer, examples, batch)
    return start, {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}, metrics


def fixed_batch(trainer, seed=7):
    """A rollout batch of the trainer's first prompts; a random model never samples EOS, so most
    completions are cut to ragged lengths (ending in EOS) for the normalizers to matter."""
    examples = [next(trainer.sampler.stream) for _ in range(trainer.config.train.prompts_per_step)]
    batch = trainer.sampler.engine.generate(
        [trainer.sampler.kind.encoder(e) for e in examples], trainer.config.rollout.num_generations, trainer.sampler.sampling,
        seeds=range(seed * 1000, seed * 1000 + trainer.config.completions_per_step),
    )
    return examples, cut_ragged(batch, trainer.tokenizer.eos_token_id)


# Each normalization on-policy without a KL term, and off-policy (a second pass) with one; the
# variants below add more of each.
CASES = [(loss, beta, iters, 1) for loss in ("grpo", "dapo", "dr_grpo") for beta, iters in ((0.0, 1), (0.04, 2))]
CASES += [("grpo", 0.04, 1, 2), ("dapo", 0.0, 2, 2)]  # two optimizer updates per step as well

# Every other variant and estimator, each with a KL term and two passes (the second off-policy, so
# that ratios leave 1 and the clips bind). "off_sampler": the rollout importance weight is on (exact.py).
VARIANTS = {
    "cispo": ["algorithm.loss_type=cispo", "algorithm.epsilon_high=0.02"],
    "sapo": ["algorithm.loss_type=sapo"],
    "gspo": ["algorithm.importance_sampling_level=sequence"],
    "gspo-dapo": ["algorithm.importance_sampling_level=sequence", "algorithm.loss_type=dapo"],
    "dual-clip": ["algorithm.delta=1.021", "algorithm.epsilon=0.02"],
    "rloo": ["algorithm.advantage_estimator=rloo"],
    "rloo-batch-scaled": ["algorithm.advantage_estimator=rloo", "algorithm.scale_rewards=batch", "algorithm.loss_type=dr_grpo"],
    "normalize-then-sum": ["reward.functions=[shortness, {name: oddness, weight: 0.5}]",
                           "algorithm.reward_aggregation=normalize_then_sum"],
    "mask-truncated": ["algorithm.mask_truncated_completions=true", "algorithm.loss_type=dapo"],
    "top-entropy": ["algorithm.top_entropy_quantile=0.3"],
    "entropy-bonus": ["algorithm.entropy_coef=0.05"],
    "is-token-truncate": ["off_sampler", "rollout.is_cap=1.2", "rollout.is_min=0.9"],
    "is-sequence-mask": ["off_sampler", "rollout.is_level=sequence", "rollout.is_mode=mask", "rollout.is_cap=1.5"],
}
VARIANT_KNOBS = ["algorithm.beta=0.04", "algorithm.num_iterations=2"]


@pytest.mark.parametrize("loss_type,beta,num_iterations,updates_per_step", CASES)
def test_micro_batch_size_never_changes_the_update(make_trainer, loss_type, beta, num_iterations, updates_per_step):
    knobs = [f"algorithm.loss_type={loss_type}", f"algorithm.beta={beta}",
             f"algorithm.num_iterations={num_iterations}", f"train.updates_per_step={updates_per_step}"]
    examples, batch = fixed_batch(make_trainer(*knobs))
    assert batch.completion_mask.sum(-1).unique().numel() > 1  # ragged lengths: normalizers matter
    per_update = 8 // updates_per_step
    sizes = (per_update, per_update // 2, 3, 1)  # 3 does not divide the update: a ragged last micro-batch
    results = {m: one_step(make_trainer(*knobs, f"train.micro_batch_size={m}"), examples, batch) for m in sizes}
    start, whole, whole_metrics = results[per_update]
    assert whole_metrics["reward_std"] > 0 and update_difference(start, whole, start) > 0
    for m in sizes[1:]:
        _, params, metrics = results[m]
        # The parameters, and (since AdamW's first step and clipping hide a constant factor on the
        # gradient) the loss and the gradient norm before clipping.
        assert update_difference(start, whole, params) < EXACT, f"micro_batch_size={m}"
        for key in ("loss", "grad_norm", "clip_ratio/region_mean", *(("kl",) if beta else ())):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-9, abs=1e-12), key


def test_the_token_budget_never_changes_the_update(make_trainer):
    """train.micro_batch_tokens from one completion per packed micro-batch (a budget of 1) to the
    whole update in one, against padded micro-batches: the same parameters, loss, gradient norm and
    KL, over two updates of two passes each, each completion with a tool result (context only)
    inside it. (1 and 2 processes, packed: test_two_processes_compute_the_one_process_update.)"""
    knobs = ["algorithm.loss_type=dapo", "algorithm.beta=0.04", "algorithm.num_iterations=2", "train.updates_per_step=2",
             "rollout.tools=[grpokit.tasks.calculator:calculator]"]
    trainer = make_trainer(*knobs)
    examples, batch = fixed_batch(trainer)
    batch = with_tool_turns(batch, trainer.tokenizer("<tool_response>\n42\n</tool_response>")["input_ids"])
    start, whole, whole_metrics = one_step(trainer, examples, batch)  # padded: micro_batch_size left null
    assert update_difference(start, whole, start) > 0
    for budget in (1, 30, 10**6):
        _, params, metrics = one_step(make_trainer(*knobs, f"train.micro_batch_tokens={budget}"), examples, batch)
        assert update_difference(start, whole, params) < EXACT, f"micro_batch_tokens={budget}"
        for key in ("loss", "grad_norm", "kl"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-9, abs=1e-12), (budget, key)


# What shows, in a variant's metrics on that batch, that its mechanism acted (the cases are not
# vacuous); and every variant's update differs from plain GRPO's on the same batch.
ACTED = {
    "cispo": lambda m: m["cispo_clip_ratio"] > 0,
    "is-token-truncate": lambda m: m["sampling/is_truncated_fraction"] > 0,
    "is-sequence-mask": lambda m: 0 < m["sampling/is_masked_fraction"] < 1,
    "mask-truncated": lambda m: 0 < m["completions/clipped_ratio"] < 1,
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_micro_batch_size_never_changes_a_variant_update(make_trainer, variant, monkeypatch):
    """Whole / half / single-completion micro-batches give the same update, for every variant."""
    knobs = [*VARIANT_KNOBS, *(o for o in VARIANTS[variant] if o != "off_sampler")]
    off_sampler = "off_sampler" in VARIANTS[variant]
    results = {}
    with monkeypatch.context() as patched:
        if off_sampler:  # sampled by other kernels than the trainer's, as vLLM's (exact.off_the_sampler)
            patched.setattr(TransformersEngine, "exact_logprobs", False)
        first = make_trainer(*knobs)  # micro_batch_size null: the whole update at once, 8
        examples, batch = fixed_batch(first)
        for m in (8, 4, 1):
            trainer = first if m == 8 else make_trainer(*knobs, f"train.micro_batch_size={m}")
            results[m] = one_step(trainer, examples, off_the_sampler(trainer, batch) if off_sampler else batch)
    start, whole, whole_metrics = results[8]
    assert ACTED.get(variant, lambda m: True)(whole_metrics), variant
    _, grpo, _ = one_step(make_trainer(*VARIANT_KNOBS, *(o for o in knobs if "epsilon" in o)), examples, batch)
    assert update_difference(start, whole, grpo) > 1e-6  # the setting reached the update
    for m in (4, 1):
        _, params, metrics = results[m]
        assert update_difference(start, whole, params) < EXACT, f"micro_batch_size={m}"
        for key, value in whole_metrics.items():
            if not measured(key):
                assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_size_never_changes_a_multi_turn_update(make_trainer, loss_type):
    """Completions with a tool result between two model turns: the tool tokens are context only,
    and whole / half / single micro-batches still give the same update. (A run with a tool: its
    rollout kind reports the tool metrics.)"""
    knobs = [f"algorithm.loss_type={loss_type}", "algorithm.beta=0.04", "rollout.tools=[grpokit.tasks.calculator:calculator]"]
    examples, batch = fixed_batch(make_trainer(*knobs))
    tool_ids = make_trainer(*knobs).tokenizer("<tool_response>\n42\n</tool_response>")["input_ids"]
    batch = with_tool_turns(batch, tool_ids)
    assert (batch.trained_mask != batch.completion_mask).any()
    results = {m: one_step(make_trainer(*knobs, f"train.micro_batch_size={m}"), examples, batch) for m in (8, 4, 1)}
    start, whole, whole_metrics = results[8]
    assert whole_metrics["tools/calls_per_rollout"] == 1.0 and whole_metrics["turns/mean"] == 2.0
    for m in (4, 1):
        _, params, metrics = results[m]
        assert update_difference(start, whole, params) < EXACT, f"micro_batch_size={m}"
        for key in ("loss", "grad_norm", "kl", "completions/mean_length"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_accumulation_over_micro_batches_equals_one_pass(make_trainer, loss_type):
    """num_generations 4: (4 completions per micro-batch, 1 accumulation step) == (2 per micro-batch, 2 steps).

    AdamW's first step (about lr * sign(grad)) and gradient clipping hide a gradient scaled by a
    constant, so the loss and the gradient norm before clipping are compared too.
    """
    knobs = ["train.prompts_per_step=1", "rollout.num_generations=4", "algorithm.beta=0.04",
             f"algorithm.loss_type={loss_type}"]
    examples, batch = fixed_batch(make_trainer(*knobs), seed=3)
    start, four, four_metrics = one_step(make_trainer(*knobs, "train.micro_batch_size=4"), examples, batch)
    _, two, two_metrics = one_step(make_trainer(*knobs, "train.micro_batch_size=2"), examples, batch)
    assert update_difference(start, four, two) < EXACT
    for key in ("loss", "grad_norm", "kl"):
        assert two_metrics[key] == pytest.approx(four_metrics[key], rel=1e-9), key


def test_old_logps_cost_a_forward_only_when_samples_are_reused(make_trainer, monkeypatch):
    for overrides, expected in ((["algorithm.num_iterations=1"], 0), (["algorithm.num_iterations=2"], 1),
                                (["train.updates_per_step=2"], 1)):
        trainer = make_trainer("algorithm.beta=0.04", *overrides)
        calls = []
        original = trainer.logprobs.frozen
        monkeypatch.setattr(trainer.logprobs, "frozen", lambda model, *a: calls.append(model) or original(model, *a))
        step_on(trainer, *fixed_batch(trainer))
        assert sum(model is trainer.policy for model in calls) == expected, overrides
        assert sum(model is trainer.reference for model in calls) == 1


def test_same_seed_same_run(make_trainer):
    def run(seed):
        trainer = make_trainer("train.max_steps=2", f"train.seed={seed}", "model.dtype=float32")
        trainer.train()
        return untimed_metrics(trainer.run_dir)

    first = run(0)
    assert run(0) == first
    assert run(1) != first


def test_micro_batch_size_never_changes_a_distilled_update(make_trainer, tmp_path):
    """distill.teacher (with a KL term and two passes): whole, ragged (3 + 3 + 2) and packed
    micro-batches give the same update, which the teacher's signal changed."""
    knobs = [*VARIANT_KNOBS, f"distill.teacher={another_teacher(tmp_path / 'teacher', scale=5.0)}"]
    first = make_trainer(*knobs)
    examples, batch = fixed_batch(first)
    results = [one_step(trainer, examples, batch) for trainer in (
        first, make_trainer(*knobs, "train.micro_batch_size=3"), make_trainer(*knobs, "train.micro_batch_tokens=20"))]
    start, whole, whole_metrics = results[0]
    assert whole_metrics["distill/reverse_kl"] != 0
    _, without, _ = one_step(make_trainer(*VARIANT_KNOBS), examples, batch)
    assert update_difference(start, whole, without) > 1e-6  # the teacher reached the update
    for _, params, metrics in results[1:]:
        assert update_difference(start, whole, params) < EXACT
        for key, value in whole_metrics.items():
            if not measured(key):
                assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key


# ---------------------------------------------------------------- real processes


@pytest.mark.process
@pytest.mark.parametrize("overrides", [
    # 4 completions per update, 2 per process: every group is split across the two processes; each
    # completion has a tool result between two model turns (exact.with_tool_turns); packed
    # micro-batches of one completion or two (padded ones: the every-variant test below).
    ["train.prompts_per_step=2", "rollout.num_generations=4", "train.updates_per_step=2", "algorithm.beta=0.04",
     "algorithm.num_iterations=2", "algorithm.scale_rewards=batch", "train.micro_batch_tokens=40", "multi_turn"],
    # Whole groups per process; process 1's groups have constant rewards: it back-propagates nothing.
    ["train.prompts_per_step=4", "rollout.num_generations=4", "algorithm.loss_type=dapo", "half_constant"],
], ids=["groups-span-processes-multi-turn", "dapo-one-process-idle"])
def test_two_processes_compute_the_one_process_update(tmp_path, overrides):
    one, two = run_worker(tmp_path, "learn", overrides)
    assert sorted(torch.cat([t["rows"] for t in two]).tolist()) == one["rows"].tolist()
    for name in one["params"]:
        assert torch.equal(one["start"][name], two[0]["start"][name]), name
        assert torch.equal(two[0]["params"][name], two[1]["params"][name]), name  # lockstep, bit for bit
    assert update_difference(one["start"], one["params"], two[0]["params"]) < EXACT
    for key, value in one["metrics"].items():
        if not measured(key):
            assert two[0]["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
            assert two[1]["metrics"][key] == two[0]["metrics"][key], key
    if "half_constant" in overrides:
        assert one["metrics"]["frac_reward_zero_std"] == 0.5


@pytest.mark.process
def test_two_processes_compute_the_one_process_update_of_every_variant(tmp_path):
    """Each variant of VARIANTS and a teacher's, its one group split across the two processes (2 completions each,
    in one micro-batch; several updates a step, several groups, and micro-batches accumulated on
    each of two processes are test_two_processes_compute_the_one_process_update's)."""
    teacher = f"distill.teacher={another_teacher(tmp_path / 'teacher', scale=5.0)}"
    # (multi_turn: a tool result inside each completion, which the teacher's signal leaves out)
    variants = {**VARIANTS, "distill": [teacher], "distill-multi-turn": [teacher, "multi_turn"]}
    cases = [["train.prompts_per_step=1", "rollout.num_generations=4", "train.micro_batch_size=2", "ragged",
              *VARIANT_KNOBS, *variants[v]] for v in variants]
    one, two = run_worker(tmp_path, "learn-each", cases)
    for variant, a, b0, b1 in zip(variants, one, *two):
        assert update_difference(a["start"], a["params"], b0["params"]) < EXACT, variant
        for name in a["params"]:
            assert torch.equal(b0["params"][name], b1["params"][name]), (variant, name)
        for key, value in a["metrics"].items():
            if not measured(key):
                assert b0["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), (variant, key)


@pytest.mark.process
def test_dynamic_sampling_is_the_same_run_on_two_processes(tmp_path):
    """About half the groups have equal rewards ("parity"): steps sample one or two rounds, or fill
    their batch; 1 and 2 processes log the same metrics and end with the same weights."""
    overrides = ["train.prompts_per_step=2", "rollout.num_generations=4", "train.max_steps=4", "algorithm.beta=0.04",
                 "reward.functions=[parity]", "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2",
                 "algorithm.loss_type=dapo"]
    one, two = run_worker(tmp_path, "train", overrides)
    assert update_difference(one["start"], one["params"], two[0]["params"]) < EXACT
    rows = [metric_rows(tmp_path / f"p{n}" / "run") for n in (1, 2)]
    kept = [r["dynamic_sampling/groups_kept"] for r in rows[0]]
    assert 2.0 in kept and min(kept) < 2  # steps that found their groups, and steps that filled their batch
    assert {r["dynamic_sampling/rounds"] for r in rows[0]} == {2.0}  # (filling comes after the last round)
    assert all(r["frac_reward_zero_std"] == (2 - k) / 2 for r, k in zip(rows[0], kept))
    assert_close_metrics(*rows)


@pytest.mark.process
def test_partial_rollouts_are_the_same_run_on_two_processes(tmp_path):
    """rollout.partial: groups carried from step to step, completions of tokens of two versions
    (sampling/partial.py); 1 and 2 processes log the same metrics and end with the same weights
    (under FSDP2: test_sharding.py)."""
    overrides = ["train.prompts_per_step=2", "rollout.num_generations=4", "train.max_steps=4", "algorithm.beta=0.04",
                 "rollout.partial=true", "rollout.partial_tokens=2"]
    one, two = run_worker(tmp_path, "train", overrides)
    assert update_difference(one["start"], one["params"], two[0]["params"]) < EXACT
    rows = [metric_rows(tmp_path / f"p{n}" / "run") for n in (1, 2)]
    assert any(r["partial/carried_groups"] for r in rows[0]) and max(r["partial/lag_max"] for r in rows[0]) >= 1
    assert_close_metrics(*rows)


@pytest.mark.process
def test_the_process_count_does_not_change_a_run(tmp_path):
    """Each completion samples from its own seed: 1 and 2 processes make the same 3-step run."""
    overrides = ["train.prompts_per_step=2", "rollout.num_generations=4", "train.max_steps=3",
                 "data.eval_size=5", "train.eval_every=2", "algorithm.beta=0.04"]
    one, two = run_worker(tmp_path, "train", overrides)
    assert update_difference(one["start"], one["params"], two[0]["params"]) < EXACT
    rows = [metric_rows(tmp_path / f"p{n}" / "run") for n in (1, 2)]
    assert len(rows[0]) == len(rows[1]) == 6  # 3 steps, evaluations at steps 0, 2 and 3
    assert_close_metrics(*rows)


RECORDING_REWARD = '''
import json, os

def shortness(completions, answer, **columns):
    values = [-float(len(c[0]["content"])) for c in completions]
    with open(f"rewards-rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps({"rewards": values, "answers": answer}) + "\\n")
    return values
'''


@pytest.mark.process
def test_two_process_grpokit_train(tmp_path):
    """`grpokit train` on 2 processes: one run directory, metrics of all completions, sharded eval."""
    (tmp_path / "rec.py").write_text(RECORDING_REWARD)
    args = ["model.name=tiny-random", "reward.functions=[rec.py:shortness]", "train.prompts_per_step=2",
            "rollout.num_generations=4", "train.max_steps=2", "data.eval_size=7", "train.eval_every=0",
            "train.learning_rate=1e-3"]
    torchrun(2, ["-m", "grpokit", "train", "--no-progress", *args], tmp_path)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs  # process 1 wrote nothing of its own
    assert (runs[0] / "final" / "model.safetensors").exists()
    rows = metric_rows(runs[0])
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]

    # Calls per process: eval (step 0), step 1, step 2, eval (step 2).
    calls = [[json.loads(line) for line in (tmp_path / f"rewards-rank{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)]
    assert [len(c["rewards"]) for c in calls[0]] == [3, 4, 4, 3] and [len(c["rewards"]) for c in calls[1]] == [4] * 4
    task = ArithmeticTask(seed=0, eval_size=7)
    stream = task.train_stream()
    for i, step in ((1, steps[0]), (2, steps[1])):
        everything = calls[0][i]["rewards"] + calls[1][i]["rewards"]
        assert step["reward"] == pytest.approx(sum(everything) / 8, rel=1e-6)
        assert step["completions/max_length"] >= step["completions/mean_length"] >= step["completions/min_length"]
        # Each process scored its own completions: those of the step's prompts its rows belong to.
        answers = [e.columns["answer"] for e in (next(stream), next(stream))]
        for r in (0, 1):
            assert calls[r][i]["answers"] == [answers[row // 4] for row in shard_rows(8, 8, 2, r).tolist()]
    for i, row in ((0, evals[0]), (3, evals[1])):
        everything = calls[0][i]["rewards"] + calls[1][i]["rewards"]
        assert row["eval/reward"] == pytest.approx(sum(everything) / 7, rel=1e-6)
        assert calls[0][i]["answers"] + calls[1][i]["answers"] == [e.columns["answer"] for e in task.eval_examples]

    # Evaluation before training, on one process, scores the same 7 greedy completions.
    (tmp_path / "single").mkdir()
    (tmp_path / "rec.py").rename(tmp_path / "single" / "rec.py")
    result = run_grpokit("train", "--no-progress", *args, "train.max_steps=0", "train.output_dir=one",
                         cwd=tmp_path / "single", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    single = metric_rows(tmp_path / "single" / "one")[0]
    assert single["eval/reward"] == pytest.approx(evals[0]["eval/reward"], rel=1e-6)


CONFIGS = sorted((TESTS.parent / "examples" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_accelerate_configs_load_in_accelerate(path):
    """examples/accelerate/: each file is read by accelerate's own config loader, and describes a
    launch grpokit runs (data parallel, FSDP2 or ZeRO-2/3; mixed precision is model.dtype's)."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    kind = str(config.distributed_type).removeprefix("DistributedType.")
    assert kind in ("MULTI_GPU", "FSDP", "DEEPSPEED")  # data parallel, or sharded (test_sharding.py)
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2 and not config.fsdp_config["fsdp_activation_checkpointing"]
    if kind == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] in (2, 3)
    assert config.num_processes % config.num_machines == 0 and config.mixed_precision == "no"
    assert f"examples/accelerate/{path.name}" in path.read_text()  # its own launch command is in it


@pytest.mark.process
def test_the_cpu_accelerate_config_launches_a_run(tmp_path):
    config = TESTS.parent / "examples" / "accelerate" / "cpu-2-processes.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
         f"--main_process_port={free_port()}", "-m", "grpokit", "train", "--no-progress", "model.name=tiny-random",
         "train.max_steps=2", "data.eval_size=0", "train.prompts_per_step=2", "rollout.num_generations=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert [r["step"] for r in metric_rows(run)] == [1, 2]
