"""Sharded training (training/sharding.py) on CPU: `grpokit train` launched by `accelerate launch` with
the shipped FSDP2 and DeepSpeed config files, 2 gloo processes, reproduces the 1-process run; its
checkpoints are the same files, so a run moves between engines; a rollout server receives the
gathered weights; and every shipped config is one grpokit accepts.

`accelerate launch` itself runs the FSDP2 run; the others start the processes it would, with the
environment accelerate's own launch code computes from the config file (support/processes.py,
`accelerated`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.processes import TESTS, accelerate_env, accelerated, free_port, run_grpokit
from support.runs import assert_same_run_to_rounding, metric_rows, untimed_metrics
from support.servers import get_health
from safetensors.torch import load_file

pytest.importorskip("deepspeed", reason="the DeepSpeed tests need: pip install 'grpokit[deepspeed]'")
pytestmark = pytest.mark.process  # every test launches `grpokit train` processes

EXAMPLES = TESTS.parent / "examples" / "accelerate"
# A KL term (so a sharded reference model too), evaluation, a reward that moves the weights (shortness), two
# micro-batches per process to accumulate, two iterations (old log-probs), warm-up and weight decay.
RUN = ["--no-progress", "model.name=tiny-random", f"reward.functions=[{TESTS / 'support' / 'rewards.py'}:shortness]",
       "train.prompts_per_step=2", "rollout.num_generations=4", "data.eval_size=5", "train.eval_every=2",
       "algorithm.beta=0.04", "train.learning_rate=1e-3", "train.micro_batch_size=2", "algorithm.num_iterations=2",
       "train.warmup_steps=2", "train.weight_decay=0.1"]


def accelerate_launch(config: Path, args: list[str], cwd: Path, nproc: int | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch` itself, each process a fresh interpreter."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               f"--main_process_port={free_port()}", *([f"--num_processes={nproc}"] if nproc else []), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(TESTS)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def train(cwd: Path, out: str, *extra: str, config: Path | None = None, launcher: bool = False,
          script: Path | None = None) -> subprocess.CompletedProcess:
    """`grpokit train` on one process, or launched with accelerate `config`: by `accelerate launch`
    itself with `launcher`, else its processes forked as it would start them (running `script`,
    given, with grpokit's arguments)."""
    args = ["train", *RUN, f"train.output_dir={out}", *extra]
    if config is None:
        result = run_grpokit(*args, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elif launcher:
        result = accelerate_launch(config, ["-m", "grpokit", *args], cwd)
    else:
        result = accelerated(config, args, cwd, script=script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The unsharded, 1-process run of 3 steps every sharded run must reproduce."""
    cwd = tmp_path_factory.mktemp("one")
    train(cwd, "run", "train.max_steps=3")
    return cwd / "run"


def variant(tmp_path: Path, shipped: str, **changes: str) -> Path:
    """A copy of a shipped config with some `key: value` lines changed."""
    text = (EXAMPLES / shipped).read_text()
    for key, value in changes.items():
        lines = [line for line in text.splitlines() if line.strip().startswith(f"{key}:")]
        assert len(lines) == 1, key
        indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
        text = text.replace(lines[0], f"{indent}{key}: {value}")
    path = tmp_path / f"{Path(shipped).stem}-variant.yaml"
    path.write_text(text)
    return path


VARIANTS = {
    "fsdp2": ("cpu-2-processes-fsdp2.yaml", {}, [], "FSDP2 over 2 processes: process 0 holds 5"),
    # Parameters, gradients and AdamW state offloaded; the output layer applied in chunks.
    "fsdp2-offload-chunked": ("cpu-2-processes-fsdp2.yaml", {"fsdp_offload_params": "true"},
                              ["train.logprob_chunk_size=3", "model.gradient_checkpointing=true"], "CPU offload on"),
    # Packed micro-batches: the processes' plans differ in length, and the shorter is split to match.
    "zero3-packed": ("cpu-2-processes-zero3.yaml", {}, ["train.micro_batch_size=null", "train.micro_batch_tokens=64"],
                     "DeepSpeed ZeRO-3 over 2 processes: process 0 holds 5"),
    # ZeRO-2 and ZeRO-3 with offload: test_a_run_resumes_across_engines.
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_sharded_run_equals_the_one_process_run(name, one_process, tmp_path):
    shipped, changes, extra, described = VARIANTS[name]
    config = variant(tmp_path, shipped, **changes) if changes else EXAMPLES / shipped
    result = train(tmp_path, "run", "train.max_steps=3", *extra, config=config, launcher=name == "fsdp2")
    assert described in result.stderr + result.stdout  # sharded as asked, and said so
    assert "shm_comm" not in result.stderr + result.stdout  # DeepSpeed's inference all-reduce: not built on CPU
    assert_same_run_to_rounding(tmp_path / "run", one_process)
    from grpokit.models.loading import load_model

    load_model(str(tmp_path / "run" / "final"))  # a plain Hugging Face folder


def test_partial_rollouts_under_fsdp2_equal_the_one_process_run(tmp_path):
    """rollout.partial with sharded weights, whose forwards are collective: every process decodes
    the same rounds and carries the same groups (sampling/sampler.py), then keeps its rows."""
    partial = ["train.max_steps=3", "rollout.partial=true", "rollout.partial_tokens=3", "rollout.max_completion_length=12"]
    train(tmp_path, "one", *partial)
    train(tmp_path, "run", *partial, config=EXAMPLES / "cpu-2-processes-fsdp2.yaml")
    rows = [r for r in metric_rows(tmp_path / "one") if "loss" in r]
    assert any(r["partial/carried_groups"] for r in rows) and max(r["partial/lag_max"] for r in rows) >= 1
    assert_same_run_to_rounding(tmp_path / "run", tmp_path / "one")


def test_a_run_resumes_across_engines(one_process, tmp_path):
    """Checkpoints hold full weights and the full AdamW state whatever the engine: step 0 (no
    AdamW state yet) and step 1 under FSDP2, step 2 under DeepSpeed ZeRO-2 with the AdamW state
    offloaded, step 3 under ZeRO-3 with the weights offloaded too, is the 1-process run."""
    fsdp2 = EXAMPLES / "cpu-2-processes-fsdp2.yaml"
    train(tmp_path, "run", "train.max_steps=0", config=fsdp2)
    zero2 = variant(tmp_path, "cpu-2-processes-zero3.yaml", zero_stage="2", offload_optimizer_device="cpu")
    (tmp_path / "zero3").mkdir()
    zero3 = variant(tmp_path / "zero3", "cpu-2-processes-zero3.yaml", offload_optimizer_device="cpu",
                    offload_param_device="cpu")
    for steps, config, described in (
            (1, fsdp2, "FSDP2 over 2 processes: process 0 holds 5"),
            (2, zero2, "ZeRO-2 over 2 processes: every process holds the whole weights; gradients and AdamW state "
                       "are sharded (AdamW state offloaded to cpu)"),
            (3, zero3, "DeepSpeed ZeRO-3 over 2 processes: process 0 holds 5")):
        result = train(tmp_path, "run", f"train.max_steps={steps}", config=config)
        out = result.stderr + result.stdout
        assert f"resuming from {Path('run', 'checkpoints', f'step-{steps - 1}')}" in out
        assert described in out  # sharded as asked, and said so
    assert "(AdamW state offloaded to cpu, weights offloaded to cpu)" in out
    assert_same_run_to_rounding(tmp_path / "run", one_process, evals=False)
    from grpokit.models.loading import load_model

    load_model(str(tmp_path / "run" / "final"))  # a plain Hugging Face folder


def test_a_rollout_server_gets_the_gathered_weights(one_process, tmp_path, server):
    """rollout.engine=server under FSDP2: every push (checksum-verified by the client) carries
    the whole weights, gathered from both processes; the run is the 1-process in-process run."""
    pytest.importorskip("fastapi", reason="the server needs: pip install 'grpokit[server]'")
    s = server()
    train(tmp_path, "run", "train.max_steps=3", "rollout.engine=server", f"rollout.server_url={s.url}",
          config=EXAMPLES / "cpu-2-processes-fsdp2.yaml")
    assert get_health(s.url)["session"] is not None
    assert_same_run_to_rounding(tmp_path / "run", one_process)


def refused(result: subprocess.CompletedProcess) -> bool:
    """grpokit exited 2: a start-up refusal."""
    return result.returncode == 2


@pytest.mark.parametrize("changes, message", [
    ({"fsdp_version": "1"}, "fsdp_version: 1 (grpokit shards with FSDP2"),
    ({"fsdp_activation_checkpointing": "true"}, "model.gradient_checkpointing=true"),
    ({"mixed_precision": "bf16"}, "grpokit has one precision setting, model.dtype"),
], ids=["fsdp1", "fsdp-checkpointing", "mixed-precision"])
def test_fsdp_settings_grpokit_owns_are_refused(tmp_path, changes, message):
    config = variant(tmp_path, "cpu-2-processes-fsdp2.yaml", **changes)
    result = accelerated(config, ["train", *RUN, "train.output_dir=run"], tmp_path, nproc=1)
    assert refused(result) and message in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_deepspeed_settings_grpokit_owns_are_refused(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({
        "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}))
    config = tmp_path / "ds.yaml"
    config.write_text("distributed_type: DEEPSPEED\nnum_processes: 1\nuse_cpu: true\n"
                      f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false\n")
    result = accelerated(config, ["train", *RUN, "train.output_dir=run", "model.lora_rank=4", "model.dtype=bfloat16"],
                         tmp_path)
    assert refused(result), result.stderr[-3000:]
    for message in ("gradient_clipping is set by grpokit's train.max_grad_norm", "optimizer is set by grpokit's",
                    "zero_stage: 1", "model.dtype=bfloat16 (DeepSpeed keeps float32 master"):
        assert message in result.stderr, (message, result.stderr[-3000:])


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_is_accepted_by_grpokit(path, monkeypatch):
    """Each file gives, through accelerate's own launch code (as 1 process of 1 machine, here on
    CPU), the environment grpokit reads its strategy from, and grpokit accepts it."""
    from grpokit.config import Config, check, facts
    from grpokit.training import sharding

    _, env, _ = accelerate_env(path, 1, "--num_machines=1", "--machine_rank=0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = Config()
    found = facts(config, world_size=1)
    check(config, found)
    expected = {"FSDP": "FSDP2", "DEEPSPEED": "DeepSpeed", "MULTI_GPU": "replicated"}
    kind = next(line.split(":")[1].strip() for line in path.read_text().splitlines()
                if line.startswith("distributed_type:"))
    assert sharding.from_launch(config, found.launch).name == expected[kind]


# grpokit's CLI in each process, the loss of calls 5 to 8 made infinite first.
INFINITE_LOSS = '''
import sys
from grpokit.algorithm.loss import LOSSES
from grpokit.cli import main

first, last = 5, 8
real, calls = LOSSES["grpo"], []


def infinite_loss(inputs, settings):
    # An infinite loss whose gradient is finite (the loss's own): the hardest case to skip.
    calls.append(1)
    out = real(inputs, settings)
    if first <= len(calls) <= last:
        out.loss = out.loss + float("inf")
    return out


LOSSES["grpo"] = infinite_loss
sys.exit(main(sys.argv[1:]))
'''


def test_deepspeed_skips_a_non_finite_update_as_grpokit_does(tmp_path):
    """A step whose loss is infinite (its gradient finite) changes nothing under ZeRO-3: the
    weights and AdamW state after it are those before it, and it is counted as skipped."""
    # Per process and step: 2 iterations x 2 micro-batches = 4 loss calls; step 2 is calls 5-8.
    (tmp_path / "infinite_loss.py").write_text(INFINITE_LOSS)
    train(tmp_path, "run", "train.max_steps=2", "train.save_every=1", "train.keep_checkpoints=3",
          config=EXAMPLES / "cpu-2-processes-zero3.yaml", script=tmp_path / "infinite_loss.py")
    rows = [r for r in untimed_metrics(tmp_path / "run") if "loss" in r]
    assert [r["skipped_steps"] for r in rows] == [0, 1] and float(rows[1]["loss"]) == float("inf")
    before, after = (tmp_path / "run" / "checkpoints" / f"step-{n}" for n in (1, 2))
    w, v = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert all(torch.equal(w[k], v[k]) for k in w)
    o, p = (torch.load(c / "optimizer.pt", weights_only=True)["optimizer"]["state"] for c in (before, after))
    assert all(torch.equal(o[n]["exp_avg"], p[n]["exp_avg"]) and o[n]["step"] == p[n]["step"] for n in o)


def test_steps_generated_ahead_under_fsdp2(tmp_path, server):
    """rollout.max_staleness=1 under FSDP2: the weight copies pushed ahead are gathered from both
    processes (a collective at each step's start); the run is the 1-process run through the server."""
    pytest.importorskip("fastapi", reason="the server needs: pip install 'grpokit[server]'")
    s = server()
    ahead = ["train.max_steps=3", "rollout.engine=server", f"rollout.server_url={s.url}", "rollout.max_staleness=1"]
    train(tmp_path, "one", *ahead)
    train(tmp_path, "run", *ahead, config=EXAMPLES / "cpu-2-processes-fsdp2.yaml")
    assert [r["staleness"] for r in untimed_metrics(tmp_path / "run") if "loss" in r] == [0, 1, 1]
    assert_same_run_to_rounding(tmp_path / "run", tmp_path / "one")


def test_lora_under_fsdp2_equals_the_one_process_run(tmp_path, server):
    """LoRA with its frozen base sharded by FSDP2 on 2 processes: the same update as 1 process (the
    adapters alone have gradients and AdamW state, reduce-scattered), checkpoints holding the
    adapters whole, a run resumed under FSDP2 from a 1-process checkpoint, and a rollout server
    sent the adapters alone, gathered from both processes."""
    lora = ["model.lora_rank=4", "model.lora_alpha=8"]
    (tmp_path / "one").mkdir()
    train(tmp_path / "one", "run", "train.max_steps=3", *lora)
    fsdp2 = EXAMPLES / "cpu-2-processes-fsdp2.yaml"
    result = train(tmp_path, "run", "train.max_steps=3", *lora, config=fsdp2)
    assert "FSDP2 over 2 processes" in result.stderr + result.stdout
    assert_same_run_to_rounding(tmp_path / "run", tmp_path / "one" / "run")
    saved = load_file(tmp_path / "run" / "checkpoints" / "step-3" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # the adapters alone, whole
    # A 1-process checkpoint resumed on 2 processes: the same run.
    (tmp_path / "moved").mkdir()
    train(tmp_path / "moved", "run", "train.max_steps=1", *lora)
    train(tmp_path / "moved", "run", "train.max_steps=3", *lora, config=fsdp2)
    assert_same_run_to_rounding(tmp_path / "moved" / "run", tmp_path / "one" / "run", evals=False)
    pytest.importorskip("fastapi", reason="the server needs: pip install 'grpokit[server]'")
    s = server()
    (tmp_path / "served").mkdir()
    train(tmp_path / "served", "run", "train.max_steps=3", *lora, "rollout.engine=server", f"rollout.server_url={s.url}",
          config=fsdp2)
    assert get_health(s.url)["adapters"]
    pushed = [r["weights/push_bytes"] for r in metric_rows(tmp_path / "served" / "run") if "weights/push_bytes" in r]
    assert pushed and set(pushed) == {sum(t.numel() * t.element_size() for t in saved.values())}
    assert_same_run_to_rounding(tmp_path / "served" / "run", tmp_path / "one" / "run")
    # A server that takes whole weights only: the merged weights, gathered from both processes.
    (tmp_path / "merged").mkdir()
    (tmp_path / "whole_weights_only.py").write_text(WHOLE_WEIGHTS_ONLY)
    whole = server()
    train(tmp_path / "merged", "run", "train.max_steps=3", *lora, "rollout.engine=server",
          f"rollout.server_url={whole.url}", config=fsdp2, script=tmp_path / "whole_weights_only.py")
    from grpokit.engines.weights import checksum, named_weights
    from grpokit.models.loading import load_adapter, load_model

    merged = named_weights(load_adapter(load_model("tiny-random"), str(tmp_path / "merged" / "run" / "final")))
    assert get_health(whole.url)["checksum"] == checksum(merged)
    pushed = {r["weights/push_bytes"] for r in metric_rows(tmp_path / "merged" / "run") if "weights/push_bytes" in r}
    assert pushed == {sum(t.numel() * t.element_size() for _, t in merged)}


# grpokit's CLI in each process, its rollout servers said to take whole weights only (as vLLM's).
WHOLE_WEIGHTS_ONLY = '''
import sys
from grpokit.cli import main
from grpokit.engines.client import RolloutServer

checked = RolloutServer._check_server
RolloutServer._check_server = lambda self: {**checked(self), "adapters": False}
sys.exit(main(sys.argv[1:]))
'''


def test_lora_under_deepspeed_equals_the_one_process_run(tmp_path, server):
    """LoRA under ZeRO-3 (the frozen base partitioned, the adapters with it) and ZeRO-2 (AdamW state
    and gradients of the adapters partitioned) on 2 processes: the 1-process run to rounding; the
    checkpoints hold the adapters, gathered whole; a server that takes whole weights gets the merged
    ones, computed from the gathered partitions."""
    lora = ["model.lora_rank=4", "model.lora_alpha=8", "train.max_steps=3"]
    (tmp_path / "one").mkdir()
    train(tmp_path / "one", "run", *lora)
    (tmp_path / "zero2").mkdir()
    zero2 = variant(tmp_path / "zero2", "cpu-2-processes-zero3.yaml", zero_stage="2")
    for name, config in (("zero3", EXAMPLES / "cpu-2-processes-zero3.yaml"), ("zero2", zero2)):
        result = train(tmp_path, name, *lora, config=config)
        assert f"DeepSpeed ZeRO-{name[-1]} over 2 processes" in result.stderr + result.stdout
        assert_same_run_to_rounding(tmp_path / name, tmp_path / "one" / "run")
        saved = load_file(tmp_path / name / "checkpoints" / "step-3" / "adapter_model.safetensors")
        assert saved and all("lora_" in k for k in saved)
    pytest.importorskip("fastapi", reason="the server needs: pip install 'grpokit[server]'")
    (tmp_path / "whole_weights_only.py").write_text(WHOLE_WEIGHTS_ONLY)
    whole = server()
    train(tmp_path, "merged", *lora, "rollout.engine=server", f"rollout.server_url={whole.url}",
          config=EXAMPLES / "cpu-2-processes-zero3.yaml", script=tmp_path / "whole_weights_only.py")
    from grpokit.engines.weights import checksum, named_weights
    from grpokit.models.loading import load_adapter, load_model

    merged = named_weights(load_adapter(load_model("tiny-random"), str(tmp_path / "merged" / "final")))
    assert get_health(whole.url)["checksum"] == checksum(merged)
