"""Learning with and without partial rollouts: held-out accuracy against training time and samples.

The task: the built-in arithmetic task with the bundled SmolLM2-135M-Instruct, as `grpokit train`
runs it, but with room to ramble (rollout.max_completion_length=--max-length): at the start the
model explains at length in some completions and answers in a few tokens in others, so lengths are
ragged, and the reward (`exact_answer`: the bare number, ended) asks for a short reply, so length
is what the run learns. Two runs per seed, started side by side, one CPU thread each:
- default: `grpokit train` with these settings;
- partial: the same with rollout.partial=true, rollout.partial_tokens=--partial-tokens.

    python benchmarks/partial_learning.py --out runs/partial-learning
    python benchmarks/partial_learning.py --out runs/partial-learning --seeds 0 --steps 20   # shorter

A run folder that already holds final/ is read, not run again. Held-out accuracy is the greedy
`exact_answer` on data.eval_size held-out prompts, every --eval-every steps. Training time is the
sum of the steps' step_time up to that evaluation (evaluations excluded: they are the same work in
both runs); samples are the completions trained up to it (both runs train train.prompts_per_step
groups a step). Printed: one table per seed, then for each seed the training time the partial run
took to first reach the default run's final accuracy, over the default run's whole time (the
issue's target: at most 0.6x), and both runs' accuracy at equal samples. Written to --table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from curves import EXACT, ROOT, metrics, provenance  # noqa: E402 - the benchmarks folder is not a package
from vs_trl import write_table  # noqa: E402


def start(out: Path, arguments: list[str], threads: int) -> subprocess.Popen | None:
    """`grpokit train` into `out` in the background, unless it holds a finished run."""
    if (out / "final").exists():
        return None
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen([sys.executable, "-m", "grpokit", "train", "--no-progress", *arguments,
                             f"train.output_dir={out}"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def curve(rows: list[dict], per_step: int) -> list[tuple[int, float, int, float]]:
    """(step, training seconds so far, samples so far, accuracy) at every evaluation."""
    seconds, points = {}, []
    total = 0.0
    for r in rows:
        if "step_time" in r:
            total += r["step_time"]
            seconds[r["step"]] = total
    for r in rows:
        if EXACT in r:
            points.append((r["step"], seconds.get(r["step"], 0.0), r["step"] * per_step, r[EXACT]))
    return points


def per_step(run: Path) -> int:
    """Completions a step trains, from the run's config.yaml."""
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    return config["train"]["prompts_per_step"] * config["rollout"]["num_generations"]


def seed_table(seed: int, curves: dict[str, list]) -> list[str]:
    steps = [p[0] for p in curves["default"]]
    lines = [f"Seed {seed}:", "", "| run | " + " | ".join(str(s) for s in steps) + " |",
             "|---|" + "---|" * len(steps)]
    for name, points in curves.items():
        lines.append(f"| {name}: accuracy | " + " | ".join(f"{p[3]:.2f}" for p in points) + " |")
        lines.append(f"| {name}: training time (s) | " + " | ".join(f"{p[1]:.0f}" for p in points) + " |")
    return lines + [""]


def verdict(seed: int, curves: dict[str, list]) -> str:
    """The partial run's time to the default run's final accuracy, over the default run's time."""
    final_accuracy, default_time = curves["default"][-1][3], curves["default"][-1][1]
    reached = next((p for p in curves["partial"] if p[3] >= final_accuracy), None)
    equal = " ".join(f"{d[3]:.2f}/{p[3]:.2f}" for d, p in zip(curves["default"], curves["partial"]))
    if reached is None:
        when = f"the partial run never reached it (its best: {max(p[3] for p in curves['partial']):.2f})"
    else:
        when = (f"the partial run first reached it at step {reached[0]}, after {reached[1]:.0f} s of training: "
                f"{reached[1] / default_time:.2f}x the default run's {default_time:.0f} s")
    return (f"- seed {seed}: the default run's final accuracy {final_accuracy:.2f}; {when}. Accuracy at equal "
            f"samples, default/partial: {equal}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the runs go (one folder per run)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-length", type=int, default=64, help="rollout.max_completion_length")
    parser.add_argument("--partial-tokens", type=int, default=16, help="the partial run's rollout.partial_tokens")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--table", default=str(Path(__file__).parent / "results" / "partial_learning.md"))
    args = parser.parse_args()
    from grpokit.models.bundled import bundled_model_path

    bundled_model_path()  # converted once here, not inside a timed run
    common = [f"rollout.max_completion_length={args.max_length}", f"train.max_steps={args.steps}",
              f"train.eval_every={args.eval_every}", f"train.save_every={args.steps}"]
    runs = {"default": [], "partial": ["rollout.partial=true", f"rollout.partial_tokens={args.partial_tokens}"]}
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"Measured: {provenance()} ({args.threads} thread(s) per run, the two runs of a seed side by side); "
             f"{args.steps} steps of 8 prompts x 8 completions of at most {args.max_length} tokens; partial: "
             f"rollout.partial_tokens={args.partial_tokens}.", ""]
    verdicts = []
    for seed in args.seeds:
        folders = {name: args.out / f"{name}-seed{seed}" for name in runs}
        children = [start(folders[name], [*common, f"train.seed={seed}", *extra], args.threads)
                    for name, extra in runs.items()]
        for child in filter(None, children):
            if child.wait():
                sys.exit(f"a run failed (exit {child.returncode}); its log: {child.args[-1].split('=', 1)[1]}.log")
        curves = {name: curve(metrics(folder), per_step(folder)) for name, folder in folders.items()}
        lines += seed_table(seed, curves)
        verdicts.append(verdict(seed, curves))
    write_table(lines + verdicts, args.table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
