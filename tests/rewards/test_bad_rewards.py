"""A bad reward function gets a clear answer: one `grpokit:` line naming the culprit (the function,
the line of its code, the argument it lacks) and what to do, the right exit status, and nothing
trained lost: the last whole step saved and the command that resumes from it. Each case here was
once answered with a traceback, a wrong hint, or silence."""

import json

import pytest
from support.bad_input import T, run
from support.processes import wait_for_rows
from support.runs import assert_same_run, metric_rows

from grpokit.cli import main


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
    assert "grpokit: the run stopped: " in err and said in err and "'leave.py:leave'" in err
    assert f"once the cause is fixed, resume from step-2 with: grpokit train --config {out / 'config.yaml'}" in err
    assert (out / "checkpoints" / "step-2").is_dir() and not (out / "final").exists()
    assert main(["doctor", str(out)]) == 0
    doctor = capsys.readouterr().out
    assert "stopped at step 2 of 4" in doctor and "it stopped after step 2 on an error: UserCodeExit: " in doctor
    assert said in doctor and "the state after step 2 is saved in step-2: resuming loses nothing" in doctor
