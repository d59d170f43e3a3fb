"""Bad input gets a clear answer: one `grpokit:` line naming the culprit and what to do, the right
exit status, and nothing trained lost. Each case here was once answered with a traceback, a wrong
hint, or silence."""

import json

import pytest
import torch
from support.processes import free_port, wait_for_rows
from support.runs import assert_same_run, metric_rows

from grpokit.cli import main
from grpokit.tasks.dataset import read_rows
from grpokit.tasks.task import DataError

# A tiny run, as a new user would start one.
T = ["model.name=tiny-random", "train.max_steps=2", "rollout.num_generations=4", "train.prompts_per_step=2",
     "rollout.max_completion_length=8", "data.eval_size=0"]


def run(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run trained with data.eval_size=0."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--no-progress", *T, f"train.output_dir={out}"]) == 0
    return out


def test_a_server_url_without_its_scheme_is_refused_at_start(capsys, tmp_path):
    code, err = run(capsys, "train", *T, "rollout.engine=server", "rollout.server_url=localhost:8391",
                    f"train.output_dir={tmp_path / 'run'}")
    assert code == 2
    assert "rollout.server_url=localhost:8391: must be a URL with its scheme and host, e.g. http://" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, message", [
    ("run", "is a training run's folder: its trained model is {run}/final"),
    ("empty", "has no config.json: not a model folder (for a training run, use <run>/final)"),
    ("missing", "no such folder"),
])
def test_eval_of_something_that_is_not_a_model_folder(capsys, tmp_path, finished_run, where, message):
    path = {"run": finished_run, "empty": tmp_path, "missing": tmp_path / "nothing"}[where]
    code, err = run(capsys, "eval", "--model", str(path))
    assert code == 2 and "Traceback" not in err
    assert f"grpokit: model.name={str(path)!r}" in err and message.format(run=finished_run) in err


def test_eval_of_a_run_trained_without_held_out_prompts_says_how_to_get_some(capsys, finished_run):
    code, err = run(capsys, "eval", "--model", str(finished_run / "final"))
    assert code == 2 and "Traceback" not in err
    assert "no held-out prompts to score: data.eval_size=0" in err and "add data.eval_size=100" in err


def test_a_chat_role_no_template_knows_is_refused_with_its_line(capsys, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
            {"prompt": [{"role": "wizard", "content": "What is 3 + 3?"}], "answer": "6"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = run(capsys, "train", *T, f"data.path={path}", "reward.functions=[exact_answer]",
                    f"train.output_dir={tmp_path / 'run'}")
    assert code == 2
    assert f"{path}:line 2: message 0 of the prompt (column 'prompt') has role 'wizard'" in err
    assert "system, user, assistant, tool" in err


@pytest.mark.parametrize("line,problem", [
    # json counts the line break: a row cut short was reported "at column 1" of the line.
    ('{"prompt": "What is 2 + 2?", "answer": "4"', "Expecting ',' delimiter at the end of the line)"),
    ('{"prompt": "What is 2 + 2?" "answer": "4"}', "Expecting ',' delimiter at column 29)"),
    ("{", "Expecting property name enclosed in double quotes at the end of the line); JSONL holds one object per line"),
])
def test_a_broken_jsonl_row_is_placed_where_it_breaks(tmp_path, line, problem):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        read_rows(str(path))
    assert str(e.value) == f"{path}:line 2: not valid JSON (" + problem


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('\ufeff{"prompt": "What is 1 + 1?", "answer": "2"}\n', encoding="utf-8")
    assert read_rows(str(path)) == [(f"{path}:line 1", {"prompt": "What is 1 + 1?", "answer": "2"})]


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


def test_a_type_error_does_not_hide_the_other_problems(capsys):
    code, err = run(capsys, "train", "train.max_steps=abc", "train.learning_rate=-1", "rollout.num_generations=1")
    assert code == 2
    for problem in ("train.max_steps must be an int, got 'abc'", "train.learning_rate=-1.0: must be > 0",
                    "rollout.num_generations=1: must be >= 2"):
        assert problem in err


def test_a_section_given_a_value_is_named_as_a_section(capsys, tmp_path):
    (tmp_path / "my.yaml").write_text("train: 5\n")
    code, err = run(capsys, "train", "--config", str(tmp_path / "my.yaml"))
    assert code == 2 and "train is a section: give its fields (e.g. train.prompts_per_step=...), not 5" in err
    assert "did you mean" not in err


def test_a_folder_given_as_config_file_is_named_a_folder(capsys, finished_run):
    code, err = run(capsys, "train", "--config", str(finished_run))
    assert code == 2
    assert f"config file {finished_run} is a folder, not a YAML file (this run's is {finished_run / 'config.yaml'})" in err


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


def test_a_reward_function_without_kwargs_is_refused_at_start(capsys, tmp_path):
    (tmp_path / "strict.py").write_text("def strict(completions, answer):\n    return [0.0] * len(completions)\n")
    code, err = run(capsys, "train", *T, f"reward.functions=[{tmp_path}/strict.py:strict]",
                    f"train.output_dir={tmp_path / 'run'}")
    assert code == 2
    assert ("strict.py:strict' takes no argument 'completion_ids', 'finish_reasons', 'log_extra', 'log_metric', "
            "'prompts', 'trainer_state'") in err
    assert "add **kwargs to its parameters" in err and not (tmp_path / "run").exists()
    (tmp_path / "needy.py").write_text("def needy(completions, solution, **kw):\n    return [0.0] * len(completions)\n")
    code, err = run(capsys, "train", *T, f"reward.functions=[{tmp_path}/needy.py:needy]",
                    f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and "needy.py:needy' needs 'solution', which no column of the data provides" in err


def test_a_reward_error_shows_the_line_of_its_code_and_the_command_that_resumes(capsys, tmp_path):
    (tmp_path / "flaky.py").write_text(
        "calls = []\n"
        "def flaky(completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        return [1 / 0 for c in completions]\n"
        "    return [float(len(c[0]['content'])) for c in completions]\n")
    out = tmp_path / "run"
    args = ["train", "--no-progress", *T, "train.max_steps=4", f"reward.functions=[{tmp_path}/flaky.py:flaky]",
            f"train.output_dir={out}"]
    code, err = run(capsys, *args)
    assert code == 1 and "Traceback" not in err
    assert f"  at {tmp_path / 'flaky.py'}:5: return [1 / 0 for c in completions]" in err
    assert f"once the cause is fixed, resume from step-2 with: grpokit train --config {out / 'config.yaml'}" in err
    assert main(args) == 0  # the function's counter is past its failure, as a fixed function would be
    assert main([*args[:-1], f"train.output_dir={tmp_path / 'uninterrupted'}"]) == 0  # the module, loaded once, is past it too
    assert_same_run(out, tmp_path / "uninterrupted", steps=4)


def test_rewards_that_are_all_none_are_said_at_once_and_stop_the_run(capsys, tmp_path):
    (tmp_path / "none.py").write_text("def nothing(completions, **kw):\n    return [None] * len(completions)\n")
    out = tmp_path / "run"
    code, err = run(capsys, "train", "--no-progress", *T, "train.max_steps=10",
                    f"reward.functions=[{tmp_path}/none.py:nothing]", f"train.output_dir={out}")
    assert code == 1
    assert "the reward functions (none.py:nothing) scored no completion in 3 steps in a row (to step 3)" in err
    assert "resume from step-2" in err
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    state = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["unscored_in_a_row"] == 2


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


def test_prompts_longer_than_the_models_positions_are_refused_unless_handled(capsys, tmp_path):
    long = "What is 2 + 2? " + "Think hard. " * 1000  # ~3,000 tokens, tiny-random has 1,024 positions
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"prompt": "What is 1 + 1?", "answer": "2"},
                                                          {"prompt": long, "answer": "4"})))
    base = ["train", "--no-progress", *T, f"data.path={path}", "reward.functions=[exact_answer]"]
    code, err = run(capsys, *base, f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and not (tmp_path / "run").exists()
    assert "1 of the 2 prompts are longer than the 1016 tokens that the model's 1024 positions leave beside " \
           "rollout.max_completion_length=8" in err and "set data.max_prompt_length=1016" in err
    code, err = run(capsys, *base, "data.max_prompt_length=1020", f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and "data.max_prompt_length=1020 + rollout.max_completion_length=8 exceeds the model's 1024" in err
    assert main([*base, "data.max_prompt_length=1016", "data.long_prompts=truncate",
                 f"train.output_dir={tmp_path / 'run'}"]) == 0


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


HANGING_REWARD = """
import os, time
calls = []

def hanging(completions, **kw):
    calls.append(1)
    if len(calls) == 3 and os.environ.get("GRPOKIT_TEST_HANG"):  # its third call never returns
        time.sleep(10**6)
    return [float(len(c[0]["content"])) for c in completions]
"""


def test_a_reward_call_past_reward_timeout_stops_the_run_as_a_raising_one_does(capsys, tmp_path, monkeypatch):
    (tmp_path / "hanging.py").write_text(HANGING_REWARD)
    out = tmp_path / "run"
    args = ["train", "--no-progress", *T, "train.max_steps=4", f"reward.functions=[{tmp_path}/hanging.py:hanging]",
            "reward.timeout=2"]
    monkeypatch.setenv("GRPOKIT_TEST_HANG", "1")
    code, err = run(capsys, *args, f"train.output_dir={out}")
    assert code == 1
    assert "reward function 'hanging.py:hanging' did not return within reward.timeout=2 s" in err
    assert "resume from step-2" in err
    monkeypatch.delenv("GRPOKIT_TEST_HANG")
    assert main([*args, f"train.output_dir={out}"]) == 0
    assert main([*args, f"train.output_dir={tmp_path / 'uninterrupted'}"]) == 0
    assert_same_run(out, tmp_path / "uninterrupted", steps=4)


@pytest.mark.process
def test_sigterm_while_a_reward_hangs_saves_the_last_step_and_exits_143(tmp_path, capsys):
    import signal
    import time

    from support.processes import grpokit, same_threads_env

    (tmp_path / "hanging.py").write_text(HANGING_REWARD)
    out = tmp_path / "run"
    args = ["train", "--no-progress", *T, "train.max_steps=4", f"reward.functions=[{tmp_path}/hanging.py:hanging]"]
    process = grpokit(*args, f"train.output_dir={out}", env={**same_threads_env(), "GRPOKIT_TEST_HANG": "1"})
    wait_for_rows(process, out, 2)
    time.sleep(1.0)  # step 3 is now waiting for the reward function
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-3000:]
    assert "grpokit: stopped: SIGTERM arrived while the step waited for reward function 'hanging.py:hanging'" in err
    assert f"resume from step-2 with: grpokit train --config {out / 'config.yaml'}" in err
    assert main(["doctor", str(out)]) == 0  # the folder says why and where it stopped
    assert "it was stopped by SIGTERM after step 2 (SIGTERM arrived while the step waited for reward function " \
           "'hanging.py:hanging'" in capsys.readouterr().out
    assert main([*args, f"train.output_dir={out}"]) == 0
    assert main([*args, f"train.output_dir={tmp_path / 'uninterrupted'}"]) == 0
    assert_same_run(out, tmp_path / "uninterrupted", steps=4)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_reward_timeout_ends_a_call_of_either_kind(tmp_path, kind):
    import time

    from grpokit.rewards.reward_set import RewardError, RewardSet
    from grpokit.tasks.task import Example

    (tmp_path / "slow.py").write_text(
        "import asyncio, time\n"
        "def slow_sync(completions, **kw):\n"
        "    try:\n"
        "        time.sleep(60)\n"
        "    except Exception:  # the user's code catching everything does not swallow the time limit\n"
        "        pass\n"
        "    return [0.0] * len(completions)\n"
        "async def slow_async(completions, **kw):\n"
        "    await asyncio.sleep(60)\n"
        "    return [0.0] * len(completions)\n")
    rewards = RewardSet(((f"{tmp_path}/slow.py:slow_{kind}", 1.0, {}),), timeout=0.5)
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"slow.py:slow_{kind}' did not return within reward.timeout=0.5 s"):
        rewards([Example("q")], ["a"], ["stop"])
    assert time.monotonic() - start < 5


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


@pytest.mark.parametrize("leave, said", [
    ("sys.exit(0)", "called sys.exit(0), which would have ended the process with nothing saved"),
    ("raise KeyboardInterrupt", "KeyboardInterrupt, raised by it, stopped reward function"),
])
def test_a_reward_function_that_exits_stops_the_run_named_saved_and_non_zero(capsys, tmp_path, leave, said):
    """sys.exit(0) in a reward function at step 3 of 4 made `grpokit train` exit 0 with no message
    and no checkpoint; KeyboardInterrupt gave a raw traceback. Now each is a named error, with step 2
    saved, exit status 1, the resume command, and doctor saying why the run stopped."""
    (tmp_path / "leave.py").write_text(
        "import sys\n"
        "calls = []\n"
        "def leave(completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        f"        {leave}\n"
        "    return [float(len(c[0]['content'])) for c in completions]\n")
    out = tmp_path / "run"
    code, err = run(capsys, "train", "--no-progress", *T, "train.max_steps=4", "train.save_every=0",
                    f"reward.functions=[{tmp_path}/leave.py:leave]", f"train.output_dir={out}")
    assert code == 1 and "Traceback" not in err
    assert f"grpokit: the run stopped: " in err and said in err and "'leave.py:leave'" in err
    assert f"once the cause is fixed, resume from step-2 with: grpokit train --config {out / 'config.yaml'}" in err
    assert (out / "checkpoints" / "step-2").is_dir() and not (out / "final").exists()
    assert main(["doctor", str(out)]) == 0
    doctor = capsys.readouterr().out
    assert "stopped at step 2 of 4" in doctor and f"it stopped after step 2 on an error: UserCodeExit: " in doctor
    assert said in doctor and "the state after step 2 is saved in step-2: resuming loses nothing" in doctor


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


def test_a_server_url_whose_port_cannot_be_is_refused_at_start(capsys, tmp_path):
    """It waited rollout.server_timeout (300 s) in silence, then crashed with `Port out of range`."""
    for port in ("99999", "0", "eighty"):
        code, err = run(capsys, "train", *T, "rollout.engine=server", f"rollout.server_url=http://127.0.0.1:{port}",
                        f"train.output_dir={tmp_path / 'run'}")
        assert code == 2 and "Traceback" not in err
        assert f"rollout.server_url=http://127.0.0.1:{port}: the port must be a number from 1 to 65535" in err


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


@pytest.mark.process
def test_the_console_holds_no_third_party_warnings(tmp_path):
    """The default run's console showed transformers' `past_key_values` FutureWarning (twice) and
    DeepSpeed's "Setting accelerator to CPU" at the first checkpoint."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "grpokit", "train", "--no-progress", *T, "data.eval_size=2",
                           f"train.output_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("Warning", "WARNING", "deprecated", "Setting accelerator"):
        assert noise not in done.stderr + done.stdout, done.stderr
