"""A command given the wrong thing, and a run's console, get a clear answer: one `grpokit:` line
naming the culprit (the folder that is no model, the held-out prompts a run lacks) and what to do,
exit status 2, and no third-party noise among what grpokit says. Each case here was once answered
with a traceback, a wrong hint, or silence."""

import pytest
from support.bad_input import T, run


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
