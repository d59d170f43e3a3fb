"""Held-out accuracy against training time for the GRPO variants, on the default arithmetic task.

    python benchmarks/variants.py                                  # every configuration, seeds 0 and 1
    python benchmarks/variants.py --configs default dynamic --seeds 0

Each run is `grpokit train` with the defaults plus its configuration's overrides, evaluated every
--eval-every steps on the 100 held-out problems (greedy). A run stops (SIGTERM, after its step)
once its exact accuracy reaches --target, or once its training time passes its cap: --cap-minutes
for the default (which runs first), and for the others --cap-fraction (0.6) times the default's
mean time to the target (a default seed that never reached it counts with its whole training
time): a configuration that has not reached the target by then misses the 60% goal anyway, and
the table gives the accuracy it had reached.

Training time is the sum of the run's `step_time`s (metrics.jsonl): generation, rewards and the
update; evaluations and checkpoint writes are left out, since every configuration evaluates the
same way and a user evaluates as often as they like. The two seeds of a configuration run side by
side, one thread each (on 2 cores); configurations run one after the other. Absolute times on a
shared machine vary from run to run: compare configurations within one invocation.

Writes benchmarks/results/variants.md (the table) and benchmarks/results/variants.png (the curves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "default": [],
    "dynamic": ["rollout.dynamic_sampling=true"],
    "dapo": ["algorithm.loss_type=dapo"],
    "dr_grpo": ["algorithm.loss_type=dr_grpo"],
    "gspo": ["algorithm.importance_sampling_level=sequence"],
}
ACCURACY = "eval/rewards/exact_answer/mean"
RESULTS = Path(__file__).parent / "results"


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, accuracy) at each evaluation."""
    elapsed, seconds, points = {0: 0.0}, 0.0, []
    for r in rows:
        if "step_time" in r:
            seconds += r["step_time"]
            elapsed[r["step"]] = seconds
        if ACCURACY in r:
            points.append((r["step"], elapsed.get(r["step"], seconds), r[ACCURACY]))
    return points


def run_pair(name: str, overrides: list[str], seeds: list[int], args, workdir: Path, cap: float) -> dict[int, list]:
    """The runs of one configuration, one per seed, side by side, each stopped at the target or
    after `cap` seconds of training; their curves."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    processes = {}
    for seed in seeds:
        out = workdir / f"{name}-{seed}"
        log = (workdir / f"{name}-{seed}.log").open("w")
        processes[seed] = (out, subprocess.Popen(
            [sys.executable, "-m", "grpokit", "train", "--no-progress", f"train.seed={seed}",
             f"train.eval_every={args.eval_every}", "train.save_every=0", "train.keep_checkpoints=1",
             f"train.max_steps={args.max_steps}", f"train.output_dir={out}", *overrides],
            stdout=log, stderr=subprocess.STDOUT, env=env))
    stopped = set()
    while any(p.poll() is None for _, p in processes.values()):
        for seed, (out, process) in processes.items():
            if seed in stopped or process.poll() is not None:
                continue
            points = curve(read_rows(out / "metrics.jsonl"))
            trained = sum(r.get("step_time", 0.0) for r in read_rows(out / "metrics.jsonl"))
            if (points and points[-1][2] >= args.target) or trained > cap:
                process.send_signal(signal.SIGTERM)
                stopped.add(seed)
        time.sleep(1.0)
    curves = {}
    for seed, (out, process) in processes.items():
        if process.returncode not in (0, 128 + signal.SIGTERM):
            sys.exit(f"{name} seed {seed} failed ({process.returncode}): see {workdir / f'{name}-{seed}.log'}")
        rows = read_rows(out / "metrics.jsonl")
        curves[seed] = {"points": curve(rows), "rows": [r for r in rows if "step_time" in r]}
        args.out.mkdir(parents=True, exist_ok=True)  # each run's metrics, beside the table
        shutil.copy(out / "metrics.jsonl", args.out / f"variants-{name}-{seed}.metrics.jsonl")
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # 1.6 GB each
        shutil.rmtree(out / "final", ignore_errors=True)
    return curves


def reused(path: Path) -> dict:
    rows = read_rows(path)
    return {"points": curve(rows), "rows": [r for r in rows if "step_time" in r]}


def time_to(points, target: float) -> tuple[int, float] | None:
    for step, seconds, accuracy in points:
        if accuracy >= target:
            return step, seconds
    return None


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def accuracy_at(points, seconds: float) -> float:
    """The accuracy of the last evaluation at or before `seconds` of training."""
    return max(((s, a) for _, s, a in points if s <= seconds), default=(0.0, math.nan))[1]


def table(results: dict, args, cap: float) -> str:
    lines = [f"Training time (and step) at which greedy exact accuracy on the 100 held-out problems first "
             f"reached {args.target:.2f}, evaluated every {args.eval_every} steps; '>' a run stopped (at its cap) "
             f"before reaching it. 'At {minutes(cap)}': the accuracy of each seed's last evaluation by that much "
             "training time (the others' cap). Ratio: the mean time over the default's mean time.", "",
             "| configuration | overrides | " + " | ".join(f"seed {s}" for s in args.seeds) +
             f" | mean | ratio to default | at {minutes(cap)} | best accuracy |",
             "|---|---|" + "---|" * len(args.seeds) + "---|---|---|---|"]
    base = None
    for name, curves in results.items():
        cells, times, best = [], [], 0.0
        for seed in args.seeds:
            points = curves[seed]["points"]
            best = max([best, *(a for _, _, a in points)])
            hit = time_to(points, args.target)
            if hit is None:
                trained = sum(r["step_time"] for r in curves[seed]["rows"])
                cells.append(f"> {minutes(trained)}")
                times.append(math.inf)
            else:
                cells.append(f"{minutes(hit[1])} (step {hit[0]})")
                times.append(hit[1])
        mean = sum(times) / len(times)
        base = mean if name == "default" else base
        ratio = f"{mean / base:.2f}" if base and math.isfinite(mean) else "-"
        overrides = " ".join(f"`{o}`" for o in CONFIGS.get(name, [])) or "(none)"
        at = " / ".join(f"{accuracy_at(curves[seed]['points'], cap):.2f}" for seed in args.seeds)
        lines.append(f"| {name} | {overrides} | " + " | ".join(cells) +
                     f" | {minutes(mean) if math.isfinite(mean) else '-'} | {ratio} | {at} | {best:.2f} |")
    return "\n".join(lines)


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, curves) in enumerate(results.items()):
        for j, seed in enumerate(args.seeds):
            points = curves[seed]["points"]
            ax.plot([s / 60 for _, s, _ in points], [a for _, _, a in points], marker="o", markersize=3,
                    color=f"C{i}", linestyle="-" if j == 0 else "--", label=f"{name} (seed {seed})")
    ax.axhline(args.target, color="grey", linewidth=0.8)
    ax.set_xlabel("training time (min): the sum of step times, evaluations left out")
    ax.set_ylabel("held-out greedy exact accuracy")
    ax.set_title("arithmetic task, bundled SmolLM2-135M-Instruct, 2-core CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"of {list(CONFIGS)}, or NAME=override,...")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--target", type=float, default=0.80)
    parser.add_argument("--cap-minutes", type=float, default=12.0, help="training time after which the default is stopped")
    parser.add_argument("--cap-fraction", type=float, default=0.6,
                        help="the others are stopped after this share of the default's mean time to the target")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=140)
    parser.add_argument("--threads", type=int, default=1, help="threads per run (the seeds run side by side)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reuse", nargs="*", default=[],
                        help="configurations not run again: their curves are read from --out's metrics files")
    args = parser.parse_args()
    results = {}
    start = time.monotonic()
    cap = args.cap_minutes * 60
    with tempfile.TemporaryDirectory(prefix="grpokit-variants-") as tmp:
        for spec in args.configs:
            name, _, extra = spec.partition("=")
            if extra:
                CONFIGS[name] = extra.split(",")
            overrides = CONFIGS[name]
            t0 = time.monotonic()
            if name in args.reuse:  # measured by an earlier invocation: its metrics files in --out
                results[name] = {seed: reused(args.out / f"variants-{name}-{seed}.metrics.jsonl") for seed in args.seeds}
            else:
                results[name] = run_pair(name, overrides, args.seeds, args, Path(tmp), cap)
            if name == "default":
                # A seed that never reached the target counts with its whole training time (a lower bound).
                times = [hit[1] if hit else sum(r["step_time"] for r in results[name][seed]["rows"])
                         for seed in args.seeds for hit in [time_to(results[name][seed]["points"], args.target)]]
                cap = args.cap_fraction * sum(times) / len(times)
                print(f"the others are stopped after {minutes(cap)} of training time", flush=True)
            print(f"{name}: {minutes(time.monotonic() - t0)} wall", flush=True)
            for seed in args.seeds:
                print(f"  seed {seed}: " + ", ".join(f"step {s} {m / 60:.1f} min {a:.2f}"
                                                      for s, m, a in results[name][seed]["points"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results, args, cap)
    command = "python benchmarks/variants.py " + " ".join(sys.argv[1:])
    ran = [name for name in results if name not in args.reuse]
    how = (f"{minutes(time.monotonic() - start)} wall in all" if ran else "the table of earlier runs' metrics files")
    (args.out / "variants.md").write_text(f"`{command.strip()}` ({how})\n\n{text}\n")
    (args.out / "variants.json").write_text(json.dumps(
        {name: {str(seed): c["points"] for seed, c in curves.items()} for name, curves in results.items()}, indent=1))
    plot(results, args, args.out / "variants.png")
    print(text)


if __name__ == "__main__":
    main()
