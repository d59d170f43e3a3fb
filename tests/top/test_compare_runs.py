"""tools/compare_runs.py: two run folders compared bit for bit, timings aside."""

import contextlib
import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

TOOL = Path(__file__).parents[2] / "tools" / "compare_runs.py"


def make_run(folder: Path, weight: float, loss: float, step_time: float) -> Path:
    (folder / "final").mkdir(parents=True)
    rows = [{"step": 1, "loss": loss, "time/update": step_time, "step_time": step_time}, {"step": 1, "eval/reward": 0.5}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"w": torch.tensor([1.0, weight])}, folder / "final" / "model.safetensors")
    return folder


def compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    """`python tools/compare_runs.py a b` (the script as run, its `__main__` block), in this process:
    its exit status and what it printed."""
    printed, argv, command = io.StringIO(), sys.argv, [str(TOOL), str(a), str(b)]
    sys.argv = command
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(TOOL), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(command, code, printed.getvalue(), "")


def test_the_same_run_with_other_timings_is_the_same(tmp_path):
    result = compare(make_run(tmp_path / "a", 2.0, 0.1, 3.0), make_run(tmp_path / "b", 2.0, 0.1, 4.5))
    assert result.returncode == 0 and "the same run, bit for bit" in result.stdout


def test_one_bit_of_a_weight_or_a_metric_differs(tmp_path):
    a = make_run(tmp_path / "a", 2.0, 0.1, 3.0)
    next_weight = torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()
    result = compare(a, make_run(tmp_path / "b", next_weight, 0.1, 3.0))
    assert result.returncode == 1 and "final/model.safetensors: w differs" in result.stdout
    result = compare(a, make_run(tmp_path / "c", 2.0, 0.1 + 1e-17 * 2**4, 3.0))
    assert result.returncode == 1 and "metrics.jsonl, step 1: loss" in result.stdout


def test_trainer_state_and_files_of_one_run_only_count(tmp_path):
    a, b = make_run(tmp_path / "a", 2.0, 0.1, 3.0), make_run(tmp_path / "b", 2.0, 0.1, 3.0)
    for run, tokens in ((a, 100), (b, 101)):
        (run / "checkpoints" / "step-1").mkdir(parents=True)
        (run / "checkpoints" / "step-1" / "trainer_state.json").write_text(json.dumps({"step": 1, "num_tokens": tokens}))
    torch.save({"seed_stream": torch.tensor([1, 2])}, b / "checkpoints" / "step-1" / "rng.pt")
    result = compare(a, b)
    assert result.returncode == 1
    assert "checkpoints/step-1/trainer_state.json: .num_tokens differs" in result.stdout
    assert f"checkpoints/step-1/rng.pt: only in {b}" in result.stdout
