"""A run folder in a bad state, and bad news while a run writes to it, get a clear answer: one
`grpokit:` line naming the culprit (the folder, the checkpoint, the disk, the error that stopped
the run) and what to do, the right exit status, and nothing trained lost; `grpokit doctor` reads
what a folder holds, a partial config, a crashed run or a TRL run, and says what it could judge.
Each case here was once answered with a traceback, a wrong hint, or silence."""

import json

import pytest
import torch
from support.bad_input import T, run
from support.processes import free_port
from support.runs import assert_same_run

from grpokit.cli import main


def test_doctor_reads_a_partial_config_and_says_what_it_could_not_judge(capsys, tmp_path, finished_run):
    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text((finished_run / "metrics.jsonl").read_text())
    (folder / "config.yaml").write_text("algorithm:\n  beta: 0.0\n")
    assert main(["doctor", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"{folder}: stopped at step 2 (no checkpoint" in out
    assert "config.yaml does not say train.learning_rate, rollout.num_generations" in out
    (folder / "config.yaml").write_text("just a string\n")
    assert main(["doctor", str(folder)]) == 0
    assert "config.yaml does not say algorithm.beta" in capsys.readouterr().out


def test_a_refused_start_leaves_no_empty_folder_behind(capsys, tmp_path):
    out = tmp_path / "run"
    code, err = run(capsys, "train", *T, "rollout.engine=server", f"rollout.server_url=http://127.0.0.1:{free_port()}",
                    "rollout.server_timeout=1", f"train.output_dir={out}")
    assert code == 2 and "cannot be reached" in err
    assert not out.exists()


def test_a_folder_whose_run_died_before_step_1_is_reused_with_a_word(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    from grpokit.config.loading import load_config, save_config

    save_config(load_config(None, [*T, "train.learning_rate=0.5"]), out / "config.yaml")  # left by a run that died early
    code = main(["train", "--no-progress", *T, "train.max_steps=1", f"train.output_dir={out}"])
    assert code == 0
    said = capsys.readouterr().out
    assert f"{out} held a run that stopped before its first step, with another config (" in said
    assert "train.learning_rate: 0.5 then, 2e-05 now" in said and "starting afresh with this one" in said


def test_doctor_says_a_crashed_run_crashed_where_and_how_to_resume(capsys, tmp_path, finished_run):
    folder = tmp_path / "crashed"  # metrics of 2 steps, no checkpoint, no final/: killed before its end
    folder.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        (folder / name).write_text((finished_run / name).read_text())
    assert main(["doctor", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"stopped at step 2 of 2 (no checkpoint; `grpokit train --config {folder / 'config.yaml'}` resumes)" in out
    assert "it crashed or was killed after step 2 (its output's last lines say why), 2 step(s) after its start: " \
           "resuming trains steps 1-2 again" in out


@pytest.mark.parametrize("damage", ["optimizer.pt deleted", "model.safetensors truncated"])
def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_newest_whole_one(capsys, tmp_path, damage):
    out, whole = tmp_path / "run", tmp_path / "uninterrupted"
    base = ["train", "--no-progress", *T, "data.eval_size=4", "train.eval_every=2", "train.save_every=1",
            "train.keep_checkpoints=5"]
    assert main([*base, "train.max_steps=3", f"train.output_dir={out}"]) == 0
    newest = out / "checkpoints" / "step-3"
    if damage == "optimizer.pt deleted":
        (newest / "optimizer.pt").unlink()
    else:
        with (newest / "model.safetensors").open("r+b") as f:
            f.truncate(1000)
    capsys.readouterr()
    assert main([*base, "train.max_steps=4", f"train.output_dir={out}"]) == 0
    said = capsys.readouterr().out
    problem = "optimizer.pt missing" if damage == "optimizer.pt deleted" else "model.safetensors has 1000 bytes"
    assert f"checkpoint {newest} is damaged ({problem}" in said and "set aside as step-3.damaged; resuming from step-2" in said
    assert main([*base, "train.max_steps=4", f"train.output_dir={whole}"]) == 0
    assert_same_run(out, whole, steps=4)


@pytest.fixture
def small_disk(tmp_path):
    """A 200 MB filesystem of its own (tmpfs; needs root, as CI has), unmounted afterwards."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small filesystem here (mount needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.process  # small_disk runs mount
def test_a_full_disk_at_a_later_checkpoint_says_where_and_what_is_whole(capsys, tmp_path, small_disk):
    filler = small_disk / "filler"
    (tmp_path / "filling.py").write_text(
        "import os, shutil\n"
        "calls = []\n"
        "def filling(completions, **kw):\n"
        "    calls.append(1)\n"
        f"    if len(calls) == 3 and os.environ.get('GRPOKIT_TEST_FILL'):  # another program fills the disk\n"
        f"        free = shutil.disk_usage({str(small_disk)!r}).free\n"
        f"        with open({str(filler)!r}, 'wb') as f:\n"
        "            f.write(bytes(free - 20 * 2**20))\n"
        "    return [float(len(c[0]['content'])) for c in completions]\n")
    out = small_disk / "run"
    args = ["train", "--no-progress", *T, "train.max_steps=4", "train.save_every=1", "train.keep_checkpoints=1",
            f"reward.functions=[{tmp_path}/filling.py:filling]"]
    import os

    os.environ["GRPOKIT_TEST_FILL"] = "1"
    try:
        code, err = run(capsys, *args, f"train.output_dir={out}")
    finally:
        del os.environ["GRPOKIT_TEST_FILL"]
    assert code == 1 and "Traceback" not in err
    assert f"saving checkpoint step-3 in {out / 'checkpoints'} failed: the disk is full (0.02 GiB were free, the " \
           "checkpoint needs about 0.04 GiB" in err
    assert f"The previous checkpoint, {out / 'checkpoints' / 'step-2'}, is whole." in err
    assert "once the cause is fixed, resume from step-2" in err
    filler.unlink()
    assert main([*args, f"train.output_dir={out}"]) == 0
    assert main([*args, f"train.output_dir={tmp_path / 'uninterrupted'}"]) == 0
    assert_same_run(out, tmp_path / "uninterrupted", steps=4)


def write_trl_output_dir(folder, beta=0.0):
    """A TRL 1.16 GRPOTrainer output_dir as its Trainer writes it: checkpoint-60/trainer_state.json
    (transformers' TrainerState, log_history with TRL's GRPO keys) and training_args.bin (a pickled
    GRPOConfig; TRL itself is not installed, so a class of that module and name stands in while it is
    pickled). 60 steps with beta 0: the reward rises while grad_norm climbs from ~0.1 to ~1 after step 40."""
    import random
    import sys
    import types

    from transformers import TrainerState

    rng = random.Random(0)
    history = []
    for step in range(1, 61):
        late = step > 40
        history.append({
            "loss": 0.01, "grad_norm": (1.0 if late else 0.1) * (1 + 0.1 * rng.random()), "learning_rate": 1e-6,
            "num_tokens": 1000.0 * step, "completions/mean_length": 120.0, "completions/min_length": 40.0,
            "completions/max_length": 256.0, "completions/clipped_ratio": 0.1, "rewards/accuracy/mean": 0.3 + step / 100,
            "rewards/accuracy/std": 0.4, "reward": 0.3 + step / 100, "reward_std": 0.4, "frac_reward_zero_std": 0.2,
            "entropy": 0.9, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
            "epoch": step / 60, "step": step})
        if step % 20 == 0:
            history.append({"eval_loss": 0.0, "eval_reward": 0.3 + step / 100, "eval_runtime": 1.0, "epoch": step / 60,
                            "step": step})
    history.append({"train_runtime": 100.0, "train_loss": 0.01, "epoch": 1.0, "step": 60})
    checkpoint = folder / "checkpoint-60"
    checkpoint.mkdir(parents=True)
    TrainerState(global_step=60, max_steps=100, logging_steps=1, log_history=history).save_to_json(
        str(checkpoint / "trainer_state.json"))
    module = types.ModuleType("trl.trainer.grpo_config")

    class GRPOConfig:
        pass

    GRPOConfig.__module__, GRPOConfig.__qualname__ = module.__name__, "GRPOConfig"
    module.GRPOConfig = GRPOConfig
    config = GRPOConfig()
    config.__dict__.update(output_dir=str(folder), beta=beta, learning_rate=1e-6, num_generations=8,
                           max_completion_length=256, logging_steps=1, max_steps=100)
    saved = {name: sys.modules.get(name) for name in ("trl", "trl.trainer", "trl.trainer.grpo_config")}
    sys.modules.update({"trl": types.ModuleType("trl"), "trl.trainer": types.ModuleType("trl.trainer"),
                        "trl.trainer.grpo_config": module})
    try:
        torch.save(config, checkpoint / "training_args.bin")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = old


def test_doctor_diagnoses_a_trl_run_with_the_same_rules(capsys, tmp_path):
    folder = tmp_path / "trl-out"
    write_trl_output_dir(folder)
    assert main(["doctor", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"{folder}: a TRL run, 60 logged steps to step 60 of 100 (trl-out/checkpoint-60/trainer_state.json, " \
           "logged every 1 steps)" in out
    assert "settings read from trl-out/checkpoint-60/training_args.bin: beta=0.0, learning_rate=1e-06, " \
           "num_generations=8, max_completion_length=256" in out
    assert "1. grad_norm, from step" in out and "set beta=0.001" in out and "algorithm.beta" not in out
    (folder / "checkpoint-60" / "training_args.bin").write_bytes(b"not a pickle")
    assert main(["doctor", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "settings read from trl-out/checkpoint-60/training_args.bin: none; not read: beta, learning_rate, " \
           "num_generations, max_completion_length (the fixes below cannot quote them)" in out
    assert "1. grad_norm, from step" in out and "raise beta (its value not in the config)" in out


def test_a_failure_in_the_first_evaluation_is_recorded_too(capsys, tmp_path):
    (tmp_path / "broken.py").write_text("def broken(completions, **kw):\n    raise ValueError('no scorer')\n")
    out = tmp_path / "run"
    code, err = run(capsys, "train", "--no-progress", *T, "data.eval_size=2", f"reward.functions=[{tmp_path}/broken.py:broken]",
                    f"train.output_dir={out}")
    assert code == 1 and "reward function 'broken.py:broken' raised ValueError: no scorer" in err
    assert json.loads((out / "stop.json").read_text())["reason"] == "error"
    assert main(["doctor", str(out)]) == 0
    doctor = capsys.readouterr().out
    assert "it stopped after step 0 on an error: RewardError: reward function 'broken.py:broken' raised ValueError" in doctor
    assert "it had completed no step: resuming starts from step 1" in doctor


def test_the_stop_record_never_hides_the_error(tmp_path):
    from grpokit.rundir.folder import read_stop, record_stop

    class Unprintable(Exception):
        signum = 99  # no such signal

        def __str__(self):
            raise RuntimeError("cannot print")

    record_stop(tmp_path, 3, 2, Unprintable())  # says nothing, raises nothing
    assert read_stop(tmp_path) is None
    record_stop(tmp_path, 3, 2, ValueError("bad"))
    assert read_stop(tmp_path) == {"step": 3, "checkpoint": 2, "reason": "error", "message": "ValueError: bad"}


def test_resumed_logs_keep_one_encoding_of_nan(tmp_path):
    """A resume rewrote the kept metrics.jsonl rows with a bare NaN where new rows write "nan": a
    strict JSON reader failed on the resumed file."""
    (tmp_path / "once.py").write_text(
        "calls = []\n"
        "def once_unscored(completions, **kw):  # step 1 scores nothing: its reward is NaN\n"
        "    calls.append(1)\n"
        "    return [None if len(calls) == 1 else 1.0] * len(completions)\n")
    out = tmp_path / "run"
    args = ["train", "--no-progress", *T, "train.save_every=1", f"reward.functions=[{tmp_path}/once.py:once_unscored]",
            f"train.output_dir={out}"]
    assert main(args) == 0
    assert main([*args[:-2], "train.max_steps=3", *args[-2:]]) == 0  # resumed from step 2, to step 3
    lines = (out / "metrics.jsonl").read_text().splitlines()

    def strict(constant):
        raise ValueError(f"{constant} is not JSON")

    rows = [json.loads(line, parse_constant=strict) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["reward"] == "nan"
