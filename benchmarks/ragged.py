"""Long, ragged completions: how much of the compute is kept, and step times side by side.

The workload: the bundled SmolLM2-135M-Instruct in float32 on CPU on the built-in arithmetic task,
with room to ramble: rollout.max_completion_length=256, temperature 1. The model answers most
questions in a sentence and talks on in a few, so lengths are ragged (at step 0, seed 0: the mean
is under a third of the longest; the table prints the distribution). 4 prompts x 8 completions
per step, loss_type dapo, beta 0.04 (every completion goes through every pass), as
benchmarks/vs_trl.py sets up both trainers (its workers run here).

Runs (--runs), each in its own process, taking turns a step at a time (A B C ...), each alone on the
cores:
- packed: this checkout, train.micro_batch_tokens=--budget (packed passes), decoding that drops a
  completion from the batch when it ends (the transformers engine's dynamic decoder);
- padded: this checkout, train.micro_batch_size=--micro-batch (padded passes), the same decoding;
- default: this checkout with neither micro-batch setting, where each step picks by its lengths
  (packed in rows of 1024 tokens where one padded pass would compute more than twice the
  positions it needs, one padded pass otherwise; models/packing.py);
- baseline: another checkout's src/ folder (--baseline), with train.micro_batch_size=--micro-batch
  too: say, a worktree of 997ce89, whose decoder ran every completion until the longest ended
  (`git worktree add /tmp/grpokit-997ce89 997ce89`, then --baseline /tmp/grpokit-997ce89/src);
- partial: this checkout with neither micro-batch setting, and partial rollouts (rollout.partial=true,
  rollout.partial_tokens=--partial-tokens, rollout.partial_spare=--partial-spare): a step trains the groups that ended first and carries
  the others on (sampling/partial.py); its kept tokens per second is the figure to compare, its
  lengths being those of rounds, not completions;
- TRL: TRL's GRPOTrainer (pip install 'grpokit[bench]'), in micro-batches of --micro-batch.
Every process holds its model, reference and optimizer (about 4 GB here), so on a 24 GB machine
run three at a time at most, and TRL beside one other:

    python benchmarks/ragged.py                                         # packed and padded, 3 steps
    python benchmarks/ragged.py --runs packed padded baseline --baseline /tmp/grpokit-997ce89/src
    python benchmarks/ragged.py --runs packed TRL --out benchmarks/results/ragged-trl.md
    python benchmarks/ragged.py --runs default padded --steps 2 --out benchmarks/results/ragged-default.md
    python benchmarks/ragged.py --runs partial default --steps 6 --threads 1 --out benchmarks/results/ragged-partial.md
    python benchmarks/ragged.py --runs partial TRL --steps 3 --threads 1 --out benchmarks/results/ragged-partial-trl.md

Printed per run: step time (median over the steps after the first), and for grpokit the waste
(metrics.jsonl's waste/decode and waste/passes: token positions computed / tokens kept), where the
baseline's decoding waste is computed from its lengths (every completion ran to the longest:
completions x longest / tokens). The ideal speed-up is the longest completion over the mean.
Written to benchmarks/results/ragged.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import grpokit_worker, take_turns, trl_worker, write_table  # noqa: E402 - the benchmarks folder is not a package


def percentiles(lengths: list[int]) -> dict:
    q = statistics.quantiles(lengths, n=10, method="inclusive")
    return {"p10": q[0], "p50": statistics.median(lengths), "p90": q[-1], "max": max(lengths),
            "mean": statistics.mean(lengths)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024, help="the packed run's train.micro_batch_tokens")
    parser.add_argument("--micro-batch", type=int, default=8, help="the padded run's train.micro_batch_size")
    parser.add_argument("--partial-tokens", type=int, default=64, help="the partial run's rollout.partial_tokens")
    parser.add_argument("--partial-spare", type=int, help="the partial run's rollout.partial_spare (default: null)")
    parser.add_argument("--runs", nargs="+", default=["packed", "padded"],
                        choices=("packed", "padded", "default", "partial", "baseline", "TRL"))
    parser.add_argument("--baseline", help="src/ folder of another grpokit checkout (the baseline run)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ragged.md"))
    args = parser.parse_args()
    # What vs_trl's workers read.
    args.beta, args.device, args.dtype, args.model, args.decoder = 0.04, "cpu", "float32", "smollm2-135m-instruct", "auto"
    args.logprob_chunk_size, args.trl_micro_batch = None, args.micro_batch
    if "baseline" in args.runs and not args.baseline:
        parser.error("the baseline run needs --baseline SRC")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from grpokit.models.bundled import bundled_model_path

    bundled_model_path()  # converted once here, not inside a timed process
    padded = (f"train.micro_batch_size={args.micro_batch}",)
    every = {"packed": (grpokit_worker, (None, (f"train.micro_batch_tokens={args.budget}",))),
             "padded": (grpokit_worker, (None, padded)), "default": (grpokit_worker, (None, ())),
             "partial": (grpokit_worker, (None, ("rollout.partial=true", f"rollout.partial_tokens={args.partial_tokens}",
                                                 f"rollout.partial_spare={args.partial_spare or 'null'}"))),
             "baseline": (grpokit_worker, (args.baseline, padded)),
             "TRL": (trl_worker, ())}
    runs = {name: every[name] for name in args.runs}
    steps, _ = take_turns(runs, args)  # (peak memory: benchmarks/packed_memory.py measures the pass's)

    # (partial's generations are rounds, and TRL's lengths are not recorded)
    recorded = [rows for n, rows in steps.items() if n != "partial" and "lengths" in rows[0]]
    spread = "Completion lengths not recorded (no run of whole generations)."
    if recorded:
        first = percentiles(recorded[0][0]["lengths"])
        spread = (f"Completion lengths at step 1 (seed 0): p10 {first['p10']:.0f}, p50 {first['p50']:.0f}, p90 "
                   f"{first['p90']:.0f}, max {first['max']}, mean {first['mean']:.1f}: the longest is "
                   f"{first['max'] / first['mean']:.2f}x the mean (the most dropping the waste can give).")
    median = {n: statistics.median(s["wall"] for s in rows[1:] or rows) for n, rows in steps.items()}
    reference = args.runs[-1]  # the speed-ups are over the last run named
    lines = [
        f"{args.steps} steps each, alternated; {args.prompts} x {args.generations} completions of at most "
        f"{args.max_completion_length} tokens per step, temperature 1, on {args.threads} CPU threads. {spread}",
        "",
        f"| run | step time, median (s) | kept tokens / s | waste/decode | waste/passes | ideal (longest / mean) | "
        f"{reference} / run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in steps.items():
        lengths = [n for r in rows for n in r.get("lengths", ())] if name != "partial" else []
        kept = sum(r["generated"] for r in rows[1:] or rows) / sum(r["wall"] for r in rows[1:] or rows)
        ideal = f"{max(lengths) / statistics.mean(lengths):.2f}" if lengths else ""
        waste = [statistics.mean(r["waste"][k] for r in rows) if rows[0].get("waste", {}).get(k) else None
                 for k in ("waste/decode", "waste/passes")]
        if name == "baseline":  # its dynamic decoder ran every completion of a generation to the longest
            waste[0] = statistics.mean(len(r["lengths"]) * max(r["lengths"]) / sum(r["lengths"]) for r in rows)
        cells = ["" if w is None else f"{w:.2f}" for w in waste]
        lines.append(f"| {name} | {median[name]:.1f} | {kept:.1f} | {cells[0]} | {cells[1]} | {ideal} | "
                     f"{median[reference] / median[name]:.2f}x |")
    import torch
    import transformers

    lines += ["", f"torch {torch.__version__}, transformers {transformers.__version__}; "
              f"packed: train.micro_batch_tokens={args.budget}; padded and baseline: train.micro_batch_size="
              f"{args.micro_batch}; default: neither; partial: neither, rollout.partial_tokens={args.partial_tokens}, "
              f"rollout.partial_spare={args.partial_spare or 'null'}; "
              f"TRL: micro-batches of {args.micro_batch}. Kept tokens / s: the completion tokens the steps after the "
              "first trained, over their time."]
    write_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
