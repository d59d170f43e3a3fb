"""Checkpoints and resume, with real processes: a run killed (SIGKILL) at a random moment, or
while it writes a checkpoint, or stopped by SIGTERM / Ctrl-C, and then resumed, ends with the same
weights and logs the same metrics as a run that was never interrupted."""

import hashlib
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.processes import TESTS, Process, free_port, grpokit, run_grpokit, same_threads_env, torchrun
from support.runs import assert_same_final_weights, measured

from grpokit.cli import main
from grpokit.rundir.checkpoint import (checkpoint_step, checkpoints, latest_checkpoint, load_weights, rng_state,
                                       set_rng_state, write_checkpoint)
from grpokit.rundir.folder import read_metrics, release_run_dir

# 24 short steps on tiny-random (a few tenths of a second each) with a reward it learns that also
# draws from every global RNG, and a learning rate still warming up: resuming must
# restore the RNGs, the scheduler, the optimizer, the sampling seeds and the data position to match.
# Dynamic sampling is on and about half the groups have equal rewards, so steps take one or two
# rounds of sampling (the data position moves by a varying number of prompts) or fill their batch;
# the reference model moves towards the policy every second update (it is saved with the weights).
# The passes are packed (train.micro_batch_tokens: a group a micro-batch), so a packed run resumes
# exactly too; padded micro-batches resume in the other killed-and-resumed runs (agents, vision, LoRA).
ARGS = ["model.name=tiny-random", f"reward.functions=[{TESTS / 'support' / 'noisy_reward.py'}:noisy_parity]",
        "train.micro_batch_tokens=64",
        "train.prompts_per_step=2", "rollout.num_generations=4", "data.eval_size=4", "train.learning_rate=1e-3",
        "train.warmup_steps=30", "train.eval_every=5", "train.save_every=3",
        "train.max_steps=24", "algorithm.beta=0.01", "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2",
        "algorithm.sync_ref_model=true", "algorithm.ref_model_sync_steps=2"]


def launch(out: Path, *extra: str, env: dict | None = None, processes: int = 1) -> subprocess.Popen | Process:
    """`grpokit train` writing to `out`, its output appended to out.log: one process (forked,
    support/processes.py), or `processes` under torchrun itself (whose signal handling is tested)."""
    log = out.with_name(out.name + ".log")
    args = ["train", "--no-progress", *ARGS, f"train.output_dir={out}", *extra]
    if processes == 1:
        return grpokit(*args, env={**same_threads_env(), **(env or {})}, log=log)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--master_port={free_port()}",
         "-m", "grpokit", *args],
        stdout=log.open("a"), stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def finish(process: subprocess.Popen | Process, out: Path) -> int:
    code = process.wait(timeout=300)
    assert code in (0, 1, 2, 130, 143), out.with_name(out.name + ".log").read_text()[-3000:]
    return code


def train_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def wait_for(condition, process: subprocess.Popen | Process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "the run ended before the moment the test waited for"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not measured(k)} for r in rows]


def assert_same_resumed_run(out: Path, reference: Path, metrics: str = "all") -> None:
    """`out` (stopped and resumed) ended with `reference`'s weights, bit for bit, and logged its
    metrics as grpokit reads them back (rundir.read_metrics: "nan" a float again), timings (time/*,
    step_time) aside; metrics="train": the training rows only."""
    assert_same_final_weights(out, reference)
    if metrics == "all":
        assert without_times(read_metrics(out / "metrics.jsonl")) == without_times(read_metrics(reference / "metrics.jsonl"))
    else:
        assert without_times(train_rows(out)) == without_times(train_rows(reference))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert finish(launch(out), out) == 0
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 25))
    rounds = {r["dynamic_sampling/rounds"] for r in rows}
    assert rounds == {1.0, 2.0} and any(r["dynamic_sampling/groups_kept"] < 2 for r in rows)  # each path taken
    return out


@pytest.mark.process
def test_sigkill_at_random_moments_then_resume_is_the_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "run"
    # Killed twice: anywhere, then after a resume, past the first checkpoint (step 3) so that there
    # is one to resume from (a kill at step 3 itself may land inside its write).
    rng = random.Random()
    first = rng.randrange(2, 19)
    moments = [first, rng.randrange(max(first, 3) + 1, 20)]
    print("killed after steps", sorted(moments))
    for at in sorted(moments):
        before = _inode(out / "metrics.jsonl")
        process = launch(out)
        # This launch's metrics.jsonl (a resume rewrites it, truncated) holds `at` steps.
        wait_for(lambda: _inode(out / "metrics.jsonl") not in (None, before) and len(train_rows(out)) >= at, process)
        time.sleep(random.uniform(0, 0.3))  # anywhere in the following step (or checkpoint write)
        assert process.poll() is None
        process.kill()
        process.wait()
        assert not (out / "final").exists()
    assert finish(launch(out), out) == 0
    assert "resuming from" in (tmp_path / "run.log").read_text()
    assert_same_resumed_run(out, reference)
    assert [checkpoint_step(c) for c in checkpoints(out)] == [21, 24]  # train.keep_checkpoints=2


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


@pytest.mark.process
def test_killed_while_writing_a_checkpoint_the_previous_one_loads(reference, tmp_path, tiny):
    out = tmp_path / "run"
    assert finish(launch(out, "train.max_steps=6"), out) == 0  # checkpoints at steps 3 and 6
    # Continue it to 24, held inside the write of the step-9 checkpoint, and kill it there.
    process = launch(out, env={"GRPOKIT_TEST_CHECKPOINT_DELAY": "60"})
    partial = out / "checkpoints" / ".step-9.tmp"
    wait_for(lambda: (partial / "trainer_state.json").exists(), process)
    process.kill()
    process.wait()
    assert partial.exists() and latest_checkpoint(out).name == "step-6"
    model = tiny[0].__class__(tiny[0].config)
    load_weights(model, latest_checkpoint(out))  # the previous checkpoint is whole

    assert finish(launch(out), out) == 0
    assert not partial.exists()
    # The same weights and training rows; the 6-step run's final evaluation (step 6) is extra.
    assert_same_resumed_run(out, reference, metrics="train")


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_saves_the_step_and_exits_with_128_plus_the_signal(reference, tmp_path, signum):
    out = tmp_path / "run"
    process = launch(out)
    wait_for(lambda: len(train_rows(out)) >= 4, process)
    process.send_signal(signum)
    assert finish(process, out) == 128 + signum
    log = (tmp_path / "run.log").read_text()
    assert f"{signal.Signals(signum).name} received: stopping after this step" in log
    assert f"resume with: grpokit train --config {out}/config.yaml" in log
    last = train_rows(out)[-1]["step"]
    assert checkpoint_step(latest_checkpoint(out)) == last  # nothing done is lost
    if signum == signal.SIGTERM:
        resumed = run_grpokit("train", "--no-progress", "--config", str(out / "config.yaml"), timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_same_resumed_run(out, reference)


@pytest.mark.process
def test_two_processes_stop_after_the_same_step_and_resume(tmp_path):
    """torchrun passes SIGTERM to both processes; they agree on the step, save once, and resume.
    torchrun itself starts the run it signals; the reference run and the resumed one are forked as
    it starts its workers (support/processes.py), which spares their imports."""
    reference, out = tmp_path / "reference", tmp_path / "run"
    args = ["-m", "grpokit", "train", "--no-progress", *ARGS, "train.max_steps=4"]
    torchrun(2, [*args, f"train.output_dir={reference}"], tmp_path)
    process = launch(out, "train.max_steps=4", processes=2)
    wait_for(lambda: len(train_rows(out)) >= 2, process)
    process.send_signal(signal.SIGTERM)
    finish(process, out)  # torchrun's own status (1: its workers did not exit 0)
    assert (tmp_path / "run.log").read_text().count("SIGTERM received") == 1  # process 0 speaks
    assert checkpoint_step(latest_checkpoint(out)) == train_rows(out)[-1]["step"] < 4
    torchrun(2, [*args, f"train.output_dir={out}"], tmp_path)
    assert_same_resumed_run(out, reference)


# ---------------------------------------------------------------- start-up checks


def tree(folder: Path) -> dict:
    """Every file under `folder` with a hash of its content."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


SMALL = ["model.name=tiny-random", "train.prompts_per_step=2", "rollout.num_generations=2", "data.eval_size=2",
         "train.max_steps=2", "train.save_every=1", "reward.functions=[length]"]


@pytest.fixture
def small_run(tmp_path):
    """A finished 2-step run."""
    out = tmp_path / "run"
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={out}"]) == 0
    return out


@pytest.mark.parametrize("overrides, message", [
    (["train.learning_rate=0.1"], "train.learning_rate: 2e-05 in the run, 0.1 now"),
    (["algorithm.beta=0.1"], "algorithm.beta: 0.0 in the run, 0.1 now"),
    (["train.resume=never"], "holds a run and train.resume=never"),
    (["train.max_steps=1"], "already at step 2"),
    ("no-checkpoint", "holds a trained model (final/) but no checkpoint"),
])
def test_an_existing_run_is_never_written_over(small_run, capsys, overrides, message):
    if overrides == "no-checkpoint":
        import shutil

        shutil.rmtree(small_run / "checkpoints")
        overrides = []
    before = tree(small_run)
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", *overrides]) == 2
    assert message in capsys.readouterr().err
    assert tree(small_run) == before


def test_a_run_dir_in_use_is_refused(small_run, capsys):
    """Another process holds the folder's lock (as a live run does): refused, nothing touched."""
    import fcntl

    before = tree(small_run)
    release_run_dir(small_run)  # this process's own lock, from training it
    fd = os.open(small_run, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", "train.max_steps=3"]) == 2
    finally:
        os.close(fd)
    assert "is in use by another grpokit run that is still running" in capsys.readouterr().err
    assert tree(small_run) == before


def test_a_run_that_died_before_its_first_checkpoint(small_run, capsys):
    """No weights survived: the same config starts again from step 0, another one is refused."""
    import shutil

    shutil.rmtree(small_run / "checkpoints")
    shutil.rmtree(small_run / "final")
    before = tree(small_run)
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", "train.learning_rate=0.1"]) == 2
    assert "train.learning_rate: 2e-05 in the run, 0.1 now" in capsys.readouterr().err
    assert tree(small_run) == before
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}"]) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert [r["step"] for r in train_rows(small_run)] == [1, 2]


def test_a_finished_run_with_more_steps_continues(small_run):
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", "train.max_steps=3"]) == 0
    assert [r["step"] for r in train_rows(small_run)] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(small_run / "metrics.jsonl") if "eval/reward" in r] == [0, 2, 3]


def test_a_setting_added_since_the_run_started_resumes_at_its_default(small_run):
    """A config.yaml written before a setting existed does not name it: the run had its default."""
    import yaml

    saved = yaml.safe_load((small_run / "config.yaml").read_text())
    del saved["algorithm"]["sync_ref_model"], saved["rollout"]["dynamic_sampling"]
    (small_run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", "train.max_steps=3"]) == 0
    assert main(["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", "train.max_steps=4",
                 "rollout.dynamic_sampling=true"]) == 2  # set to another value: refused


def test_a_decaying_learning_rate_fixes_the_number_of_steps(small_run, capsys):
    import yaml

    saved = yaml.safe_load((small_run / "config.yaml").read_text())
    saved["train"]["lr_scheduler"] = "linear"  # as if the run had been started with it
    (small_run / "config.yaml").write_text(yaml.safe_dump(saved))
    args = ["train", "--no-progress", *SMALL, f"train.output_dir={small_run}", "train.lr_scheduler=linear"]
    assert main([*args, "train.max_steps=3"]) == 2
    assert "train.max_steps: 2 in the run, 3 now" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["file-in-path", "read-only", "disk-full", "model", "data", "kl", "kl-alias"])
def test_start_up_failures_say_what_and_exit_2(tmp_path, capsys, monkeypatch, case):
    out = tmp_path / "run"
    overrides = [f"train.output_dir={out}"]
    if case == "file-in-path":
        (tmp_path / "file").write_text("")
        overrides = [f"train.output_dir={tmp_path / 'file' / 'run'}"]
        message = f"train.output_dir={tmp_path / 'file' / 'run'} is not a writable folder"
    elif case == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders; the file-in-path case covers an unwritable folder")
        out.mkdir(mode=0o500)
        message = "is not a writable folder"
    elif case == "disk-full":
        import shutil

        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 5000, 5000))
        message = "GiB free, but this run holds 3 checkpoint(s) at once (train.keep_checkpoints=2, and the one being " \
                  "written), 3 more than there are now; one checkpoint of this model (weights and optimizer state) " \
                  "needs about 0.04 GiB, so 0.11 GiB in all"
    elif case == "model":
        overrides.append(f"model.name={tmp_path / 'missing-model'}")
        message = f"model.name='{tmp_path / 'missing-model'}': no such folder"
    elif case == "data":
        overrides.append(f"data.path={tmp_path / 'missing.jsonl'}")
        message = "missing.jsonl"
    elif case == "kl":
        overrides.append("algorithm.kl_estimator=k2")
        message = "algorithm.kl_estimator=k2 is set but algorithm.beta=0 turns the KL term off"
    else:
        overrides.append("algorithm.kl_coef=0.001")
        message = "unknown config key 'algorithm.kl_coef': grpokit has one KL setting, algorithm.beta"
    assert main(["train", "--no-progress", *SMALL, *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())  # nothing written


# ---------------------------------------------------------------- non-finite steps


def nan_at(steps: set[int], monkeypatch) -> None:
    """Make the loss of the given steps NaN (with beta > 0 every step makes exactly one loss call)."""
    from grpokit.algorithm.loss import LOSSES

    calls = []
    real = LOSSES["grpo"]

    def loss(inputs, settings):
        calls.append(1)
        out = real(inputs, settings)
        if len(calls) in steps:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setitem(LOSSES, "grpo", loss)


def test_a_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch, capsys):
    from grpokit.config.loading import load_config
    from grpokit.training.trainer import Trainer

    nan_at({2}, monkeypatch)
    config = load_config(None, [*SMALL, "train.max_steps=3", "algorithm.beta=0.01", f"train.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(config, progress=False)
    weights = []  # after each step
    train_step = trainer.train_step

    def recording_step(*args):
        metrics = train_step(*args)
        weights.append([p.detach().clone() for p in trainer.policy.parameters()])
        return metrics

    trainer.train_step = recording_step
    trainer.train()
    rows = train_rows(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1]
    assert math.isnan(rows[1]["loss"]) and not math.isnan(rows[0]["loss"]) and not math.isnan(rows[2]["loss"])
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))  # step 2 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(weights[1], weights[2]))
    assert trainer.scheduler.last_epoch == 2  # two updates applied
    assert "step 2: non-finite loss or gradient" in capsys.readouterr().out


def test_a_stream_of_non_finite_steps_stops_the_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    nan_at(set(range(2, 100)), monkeypatch)
    code = main(["train", "--no-progress", *SMALL, "train.max_steps=10", "train.max_skipped_steps=2",
                 "algorithm.beta=0.01", "train.save_every=0", f"train.output_dir={out}"])
    assert code == 1
    err = capsys.readouterr().err
    assert "the last 3 steps (to step 4) all had a non-finite loss or gradient" in err
    assert [r["skipped_steps"] for r in train_rows(out)] == [0, 1, 2, 3]
    assert latest_checkpoint(out) is None and not (out / "final").exists()


# ---------------------------------------------------------------- the pieces


def test_a_failed_checkpoint_write_leaves_the_previous_ones(tmp_path):
    def files(folder):
        (folder / "trainer_state.json").write_text("{}")

    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step, files, keep=2)
    assert [c.name for c in checkpoints(tmp_path)] == ["step-2", "step-3"]

    def fails(folder):
        (folder / "half").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_checkpoint(tmp_path, 4, fails, keep=2)
    assert [c.name for c in checkpoints(tmp_path)] == ["step-2", "step-3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]
    (tmp_path / "checkpoints" / "step-7").mkdir()  # no trainer_state.json: not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step-3"


def test_metrics_read_back_as_written(tmp_path):
    """A line cut off by a crash is dropped; non-finite values (written as strings) are floats again."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": "nan", "kl": "inf"}\n{"step": 2, "lo')
    [row] = read_metrics(tmp_path / "metrics.jsonl")
    assert row["step"] == 1 and row["loss"] != row["loss"] and row["kl"] == float("inf")


def test_rng_states_round_trip_through_a_file(tmp_path):
    import numpy as np

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(4), np.random.seed(4), torch.manual_seed(4)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_a_default_run_folder_is_one_folder_named_after_the_data():
    from grpokit.config.loading import load_config
    from grpokit.rundir.folder import default_output_dir

    for overrides, start in ((["data.task=verifiers:examples/verifiers_arithmetic.py:load_environment"],
                              "runs/verifiers-examples-verifiers_arithmetic.py-load_environment-"),
                             ([], "runs/arithmetic-"), (["data.task=textarena:Wordle-v0"], "runs/textarena-Wordle-v0-")):
        path = default_output_dir(load_config(None, overrides, check=False))
        assert path.startswith(start) and path.count("/") == 1, path
