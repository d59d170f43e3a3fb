"""A run's learning curve as two Markdown tables, from its metrics.jsonl: the held-out greedy score
(eval/reward) at each evaluation, and the mean train reward and median grad_norm (the statistic of
the grad_norm alert, with --window 20) over each window of steps.

    python benchmarks/curve.py runs/<run> [--window 10]

Also prints the run's median step time, the training time (the sum of step_time), and the median
of each part of a step (time/generate, time/logprobs, time/update, time/optimizer).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def tables(rows: list[dict], window: int) -> str:
    evals = [r for r in rows if "eval/reward" in r]
    steps = [r for r in rows if "reward" in r]
    lines = ["| step | " + " | ".join(str(r["step"]) for r in evals) + " |",
             "|---|" + "---|" * len(evals),
             "| eval/reward (held out, greedy) | " + " | ".join(f"{r['eval/reward']:.2f}" for r in evals) + " |", ""]
    last = max(r["step"] for r in steps)
    windows = [(a + 1, min(a + window, last)) for a in range(0, last, window)]
    means = [statistics.fmean(r["reward"] for r in steps if a <= r["step"] <= b) for a, b in windows]
    norms = [statistics.median(r["grad_norm"] for r in steps if a <= r["step"] <= b) for a, b in windows]
    lines += ["| steps | " + " | ".join(f"{a}-{b}" for a, b in windows) + " |",
              "|---|" + "---|" * len(windows),
              "| train reward (samples at rollout.temperature) | " + " | ".join(f"{m:.2f}" for m in means) + " |",
              "| median grad_norm | " + " | ".join(f"{m:.3g}" for m in norms) + " |", ""]
    times = [r["step_time"] for r in steps]
    lines.append(f"{len(steps)} steps: median step {statistics.median(times):.1f} s, training {sum(times) / 60:.1f} min "
                 "(the sum of step_time; evaluations and checkpoints aside)")
    parts = ("time/generate", "time/logprobs", "time/update", "time/optimizer")
    lines.append("median of each part of a step: " + ", ".join(
        f"{part} {statistics.median(r[part] for r in steps):.2f} s" for part in parts if all(part in r for r in steps)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (or its metrics.jsonl)")
    parser.add_argument("--window", type=int, default=10, help="steps per train-reward mean")
    args = parser.parse_args()
    path = args.run / "metrics.jsonl" if args.run.is_dir() else args.run
    print(tables([json.loads(line) for line in path.read_text().splitlines() if line.strip()], args.window))


if __name__ == "__main__":
    main()
