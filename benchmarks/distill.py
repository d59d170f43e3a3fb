"""On-policy distillation against the default GRPO run, on the built-in task: the steps and the
training time each takes to reach a held-out exact accuracy (greedy, the 100 held-out problems).

    python benchmarks/distill.py --out runs/distill [--seeds 0 1] [--target 0.7]

Runs, one after the other (each `grpokit train`, evaluated every 5 steps):
- the teacher: the default run (seed 0), unless --teacher names a model folder already made;
- for each seed, the default run (140 steps; seed 0's is the teacher's run itself) and
  examples/distill.yaml with that teacher.
A run folder that holds a final/ already is read, not run again.
Prints a Markdown table: per run, the first evaluated step at or above --target, the training time
to it (the sum of step_time up to it; evaluations aside) and the run's wall time; and each
distilled run's ratios to its seed's default run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCURACY = "eval/rewards/exact_answer/mean"


def train(out: Path, *overrides: str) -> float:
    """`grpokit train` into `out` (an existing run folder is reused as it is): its wall seconds."""
    if (out / "final").exists():
        return float("nan")
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "grpokit", "train", "--no-progress", *overrides, "train.eval_every=5",
                    f"train.output_dir={out}"], check=True, cwd=ROOT)
    return time.monotonic() - start


def reached(run: Path, target: float) -> tuple[int | None, float | None, float]:
    """The first evaluated step at or above `target`, the training minutes to it, the last accuracy."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if ACCURACY in r]
    first = next((r["step"] for r in evals if r[ACCURACY] >= target), None)
    minutes = None if first is None else sum(r["step_time"] for r in rows if "step_time" in r and r["step"] <= first) / 60
    return first, minutes, evals[-1][ACCURACY]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--teacher", type=Path, help="a model folder to distill from (default: a default run's final/)")
    args = parser.parse_args()
    teacher = args.teacher or args.out / "teacher" / "final"
    walls = {}
    if args.teacher is None:
        walls["teacher"] = train(args.out / "teacher")
    for seed in args.seeds:
        if seed == 0 and args.teacher is None:  # the same command as the teacher's run
            (args.out / "grpo-0").exists() or (args.out / "grpo-0").symlink_to("teacher")
            walls["grpo-0"] = walls["teacher"]
        walls[f"grpo-{seed}"] = walls.get(f"grpo-{seed}") or train(args.out / f"grpo-{seed}", f"train.seed={seed}")
        walls[f"distill-{seed}"] = train(args.out / f"distill-{seed}", "--config", str(ROOT / "examples" / "distill.yaml"),
                                         f"distill.teacher={teacher}", f"train.seed={seed}")
    print(f"| run | first step at >= {args.target} | training min to it | wall min (whole run) | last accuracy |")
    print("|---|---|---|---|---|")
    found = {}
    for name, wall in walls.items():
        step, minutes, last = found[name] = reached(args.out / name, args.target)
        print(f"| {name} | {step if step is not None else 'not reached'} | "
              f"{'-' if minutes is None else f'{minutes:.1f}'} | {'-' if wall != wall else f'{wall / 60:.1f}'} | "
              f"{last:.2f} |")  # (a run read, not run: no wall time)
    for seed in args.seeds:
        (gs, gm, _), (ds, dm, _) = found[f"grpo-{seed}"], found[f"distill-{seed}"]
        if None not in (gs, ds):
            print(f"seed {seed}: distillation took {ds / gs:.2f} of the steps and {dm / gm:.2f} of the training time")


if __name__ == "__main__":
    main()
