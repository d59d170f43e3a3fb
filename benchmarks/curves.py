"""Every learning curve the docs show, run again and printed beside the docs' own figures.

    python benchmarks/curves.py --out runs/curves                  # all of them, one run after another
    python benchmarks/curves.py --out runs/curves --only vision    # some: default, vision, verifiers, ...
    python benchmarks/curves.py --list                             # what each would run; no training

Each curve is a table in the docs (found by its rows' first cells) and the `grpokit train` runs
that made it, one per seed. For every row, the docs' line is printed, then the same cells taken
from the new run's metrics.jsonl. A run folder that already holds final/ is read, not run again,
so an interrupted pass resumes where it stopped. The first line printed says where the new figures
were measured (date, CPU model, threads, torch, transformers, grpokit's commit): the provenance a
table in the docs states.

Two curves' tables are made by benchmark scripts of their own, with their own runs (docs/math.md's
variants: benchmarks/variants.py; docs/distillation.md's student: benchmarks/distill.py): for
those the docs' table is printed, then the table the script prints.

RL curves move with the machine and the libraries (rounding differences grow step by step), so a
curve that differs is not by itself a bug: a run is reproducible bit for bit on the same machine,
thread count and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent

# One cell of a row: (the run's metrics rows, the column's header) -> the figure, or None.
Cell = Callable[[list[dict], str], "float | None"]


def at_step(metric: str) -> Cell:
    """The metric logged at the column's step (an evaluation's, or a training step's)."""
    def cell(rows: list[dict], column: str) -> float | None:
        step = int(column)
        return next((r[metric] for r in rows if r.get("step") == step and metric in r), None)
    return cell


def over_steps(metric: str, how: Callable = statistics.fmean) -> Cell:
    """The mean (or `how`) of a training metric over the column's steps, "a-b"."""
    def cell(rows: list[dict], column: str) -> float | None:
        first, last = (int(s) for s in column.split("-"))
        values = [r[metric] for r in rows if first <= r.get("step", 0) <= last and metric in r and "step_time" in r]
        return how(values) if values else None
    return cell


@dataclass(frozen=True)
class Row:
    label: str  # the row's first cell in the docs, without Markdown emphasis
    run: str  # the run it is read from: a key of RUNS
    cell: Cell
    fmt: str = ".2f"


@dataclass(frozen=True)
class Curve:
    name: str
    doc: str
    rows: tuple[Row, ...]


# Each run's `grpokit train` arguments (its folder under --out is its name); curves share runs.
RUNS = {
    "default-seed0": (),
    "default-seed1": ("train.seed=1",),
    "default-beta0.001": ("algorithm.beta=0.001",),
    "vision-seed0": ("--config", "examples/vision.yaml"),
    "vision-seed1": ("--config", "examples/vision.yaml", "train.seed=1"),
    "verifiers-seed0": ("rollout.environment=verifiers:examples/verifiers_arithmetic.py:load_environment",),
    "reasoning-gym-seed0": ("--config", "examples/reasoning_gym.yaml"),
    "reasoning-gym-seed1": ("--config", "examples/reasoning_gym.yaml", "train.seed=1"),
    "calculator-seed0": ("--config", "examples/calculator.yaml"),
    "thinking-seed0": ("--config", "examples/thinking.yaml"),
    "thinking-seed1": ("--config", "examples/thinking.yaml", "train.seed=1"),
}
EXACT = "eval/rewards/exact_answer/mean"
GRAD_NORM = over_steps("grad_norm", statistics.median)
CURVES = (
    Curve("default", "README.md", (
        Row("exact accuracy (`exact_answer`), seed 0", "default-seed0", at_step(EXACT)),
        Row("exact accuracy (`exact_answer`), seed 1", "default-seed1", at_step(EXACT)),
        Row("mean reply length (tokens), seed 0", "default-seed0", at_step("eval/completions/mean_length"), ".1f"))),
    Curve("vision", "docs/vision.md", (
        Row("seed 0", "vision-seed0", at_step("eval/reward")),
        Row("seed 1", "vision-seed1", at_step("eval/reward")))),
    Curve("grad-norm", "docs/monitoring.md", (
        Row("seed 0, beta 0 (the run above)", "default-seed0", GRAD_NORM, ".3g"),
        Row("seed 1, beta 0", "default-seed1", GRAD_NORM, ".3g"),
        Row("seed 0, `algorithm.beta=0.001`", "default-beta0.001", GRAD_NORM, ".3g"))),
    Curve("verifiers", "docs/agents.md", (
        Row("exact accuracy", "verifiers-seed0", at_step("eval/agent/exact")),)),
    Curve("calculator", "docs/tools-and-environments.md", (
        Row("train reward (accuracy of the samples, T = 1)", "calculator-seed0", at_step("reward"), ".3f"),
        Row("`tools/calls_per_rollout`", "calculator-seed0", at_step("tools/calls_per_rollout")),
        Row("`tools/failures_per_rollout`", "calculator-seed0", at_step("tools/failures_per_rollout")),
        Row("`completions/clipped_ratio`", "calculator-seed0", at_step("completions/clipped_ratio")))),
    Curve("thinking", "docs/thinking.md", (
        Row("exact accuracy (`exact_answer`), seed 0", "thinking-seed0", at_step(EXACT)),
        Row("exact accuracy (`exact_answer`), seed 1", "thinking-seed1", at_step(EXACT)),
        Row("`think_format`, seed 0", "thinking-seed0", at_step("eval/rewards/think_format/mean")),
        Row("`think_format`, seed 1", "thinking-seed1", at_step("eval/rewards/think_format/mean")),
        Row("held-out reply length (tokens), seed 0", "thinking-seed0", at_step("eval/completions/mean_length"), ".1f"),
        Row("samples' `think_format` (T = 1), seed 0", "thinking-seed0", at_step("rewards/think_format/mean")),
        Row("samples cut in their reasoning, seed 0", "thinking-seed0", at_step("completions/reasoning_cut_ratio")),
        Row("samples' length (tokens), seed 0", "thinking-seed0", at_step("completions/mean_length"), ".1f"))),
    Curve("reasoning-gym", "docs/tasks.md", (
        Row("eval/reward (held out, greedy), seed 0", "reasoning-gym-seed0", at_step("eval/reward")),
        Row("eval/reward (held out, greedy), seed 1", "reasoning-gym-seed1", at_step("eval/reward")),
        Row("train reward (samples at T = 1), seed 0", "reasoning-gym-seed0", over_steps("reward")),
        Row("train reward (samples at T = 1), seed 1", "reasoning-gym-seed1", over_steps("reward")))),
)


@dataclass(frozen=True)
class Script:
    """A curve's table that a benchmark script makes: the docs' table, then the script's."""
    name: str
    doc: str
    label: str  # the first cell of one of the docs' table's rows
    command: tuple[str, ...]  # the script and its arguments, "{out}" its folder under --out


SCRIPTS = (
    Script("variants", "docs/math.md", "dapo", ("benchmarks/variants.py", "--out", "{out}")),
    Script("distill", "docs/distillation.md", "default GRPO run, seed 0 (the teacher's own run)",
           ("benchmarks/distill.py", "--out", "{out}", "--seeds", "0", "1")),
    Script("partial-learning", "docs/speed-and-memory.md", "default, seed 0",
           ("benchmarks/partial_learning.py", "--out", "{out}")),
)


# Every other table of measured figures in the docs: (doc, the first cell of one of its rows). Each
# one, like each curve's, states in the text just above it where it was measured (provenance_gaps).
TABLES = (
    ("docs/agents.md", "OpenAI Agents SDK (Responses API) (`openai_agents_sdk.py:agent`)"),
    ("docs/agents.md", "built-in"),
    ("docs/scaling.md", "`rollout.max_staleness=0`"),
    ("docs/speed-and-memory.md", "512"),
    ("docs/speed-and-memory.md", "packed (`train.micro_batch_tokens=1024`)"),
    ("docs/speed-and-memory.md", "default (neither setting)"),
    ("docs/speed-and-memory.md", "step time, 10th-90th percentile (s)"),
    ("docs/speed-and-memory.md", "TRL / grpokit, median step"),
    ("docs/speed-and-memory.md", "dynamic"),
    ("docs/tasks.md", "letter_counting"),
    ("docs/tools-and-environments.md", "after 20 steps"),
    ("docs/models.md", "llama (`LlamaConfig`)"),
)
# What a table's provenance names: the date, the machine (its CPU's threads, or its GPU), the two
# libraries' versions, and the command (a `grpokit ...`, `python benchmarks/...` or `make ...`).
PROVENANCE = {"a date": r"20\d\d-\d\d-\d\d", "the threads or the GPU": r"threads?\b|H100|H200",
              "torch's version": r"torch\s+\d", "transformers' version": r"transformers\s+\d",
              "the command": r"`(grpokit|python benchmarks/|make )|```bash"}


def provenance_gaps(doc: str, label: str, seeded: bool) -> list[str]:
    """What the text above the table holding the row `label` does not state (of PROVENANCE, and the
    seed for a learning curve): its 15 lines above the table, or fewer up to a heading or table;
    tables one after the other, with only blank lines between, share the text above the first."""
    try:
        lines, _, top, _ = located(doc, label)
    except LookupError as e:
        return [str(e)]
    while True:
        start = top
        while start > max(0, top - 15) and not lines[start - 1].startswith(("#", "|")):
            start -= 1
        if not (start > 0 and lines[start - 1].startswith("|") and not "".join(lines[start:top]).strip()):
            break
        top = start - 1  # a table right above, nothing but blank lines between: they share its text
        while top > 0 and lines[top - 1].startswith("|"):
            top -= 1
    text = "\n".join(lines[start:top])
    wanted = dict(PROVENANCE, **({"the seed": r"\bseeds?\b"} if seeded else {}))
    return [name for name, pattern in wanted.items() if not re.search(pattern, text)]


def cells(line: str) -> list[str]:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def located(doc: str, label: str) -> tuple[list[str], int, int, int]:
    """`doc`'s lines and where the table row labelled `label` is: (lines, the row's index, its
    table's first line's, its table's last line's). LookupError unless exactly one row is so labelled."""
    lines = (ROOT / doc).read_text().splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith("|") and cells(line)[0] == label]
    if len(found) != 1:
        raise LookupError(f"{len(found)} table rows labelled {label!r}")
    top = bottom = found[0]
    while top > 0 and lines[top - 1].startswith("|"):
        top -= 1
    while bottom + 1 < len(lines) and lines[bottom + 1].startswith("|"):
        bottom += 1
    return lines, found[0], top, bottom


def disagree(doc: str, error: LookupError) -> SystemExit:
    return SystemExit(f"{doc}: {error}; benchmarks/curves.py and the docs disagree")


def doc_table(curve: Curve) -> dict[str, tuple[list[str], list[str]]]:
    """Each of the curve's rows in the docs: its label -> (its table's column headers, its figures).

    Raises if a row is not found once, or its cells do not line up with its table's header."""
    table = {}
    for row in curve.rows:
        try:
            lines, at, top, _ = located(curve.doc, row.label)
        except LookupError as e:
            raise disagree(curve.doc, e) from None
        header, figures = cells(lines[top])[1:], cells(lines[at])[1:]
        if len(header) != len(figures):
            raise SystemExit(f"{curve.doc}: the row {row.label!r} does not line up with its table's header")
        table[row.label] = header, figures
    return table


def provenance() -> str:
    """Where this pass measures: the fields a documented table states."""
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (f"{datetime.date.today()}, {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, grpokit at {commit or 'an unknown commit'}")


def train(out: Path, arguments: tuple[str, ...]) -> float | None:
    """`grpokit train` into `out`, unless it holds a finished run: the wall minutes, or None if read."""
    if (out / "final").exists():
        return None
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "grpokit", "train", "--no-progress", *arguments, f"train.output_dir={out}"],
                   check=True, cwd=ROOT, stdout=sys.stderr)  # the run's lines apart from the tables
    return (time.monotonic() - start) / 60


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def side_by_side(curve: Curve, out: Path) -> list[str]:
    """The docs' rows and the new ones, one Markdown table per table of the docs."""
    lines, header = [f"## {curve.name} ({curve.doc})"], None
    rows = {run: metrics(out / run) for run in runs_of([curve])}
    for row, (columns, figures) in zip(curve.rows, doc_table(curve).values()):
        if columns != header:
            header = columns
            lines += ["", "| row | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
        new = [row.cell(rows[row.run], column) for column in columns]
        lines.append(f"| docs: {row.label} | " + " | ".join(figures) + " |")
        lines.append(f"| new: {row.label} | " + " | ".join("-" if v is None else f"{v:{row.fmt}}" for v in new) + " |")
    return lines


def docs_lines(doc: str, label: str) -> list[str]:
    """The docs' table holding the row `label`, as its lines."""
    try:
        lines, _, top, bottom = located(doc, label)
    except LookupError as e:
        raise disagree(doc, e) from None
    return lines[top:bottom + 1]


def run_script(script: Script, out: Path) -> list[str]:
    """Run `script` into out/<its name>: the docs' table, then what the script printed."""
    command = [sys.executable, *(a.replace("{out}", str(out / script.name)) for a in script.command)]
    printed = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    return [f"## {script.name} ({script.doc}): the docs' table, then `{' '.join(script.command)}`'s", "",
            *docs_lines(script.doc, script.label), "", printed.rstrip()]


def runs_of(curves: list[Curve]) -> list[str]:
    return list(dict.fromkeys(row.run for curve in curves for row in curve.rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the runs go (one folder per curve and seed)")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in (*CURVES, *SCRIPTS)], help="these curves only")
    parser.add_argument("--list", action="store_true", help="print each curve's docs table and commands; run nothing")
    args = parser.parse_args()
    chosen = [c for c in CURVES if not args.only or c.name in args.only]
    scripts = [s for s in SCRIPTS if not args.only or s.name in args.only]
    if args.list:
        for curve in chosen:
            print(f"{curve.name}: {curve.doc}, rows " + ", ".join(
                f"{label!r} ({len(columns)} columns)" for label, (columns, _) in doc_table(curve).items()))
            for run in runs_of([curve]):
                print(f"  {run}: grpokit train {' '.join(RUNS[run])}".rstrip())
        for script in scripts:
            print(f"{script.name}: {script.doc}, {len(docs_lines(script.doc, script.label)) - 2} rows\n"
                  f"  python {' '.join(script.command)}")
        return
    if args.out is None:
        parser.error("--out is needed to run the curves (or --list)")
    print(f"measured: {provenance()}")
    for curve in chosen:
        doc_table(curve)  # a curve the docs no longer show stops the pass before any training
    for script in scripts:
        docs_lines(script.doc, script.label)
    walls = {run: train(args.out / run, RUNS[run]) for run in runs_of(chosen)}
    for curve in chosen:
        print("\n".join(side_by_side(curve, args.out)) + "\n")
    for script in scripts:  # after the curves: the variants alone take hours
        print("\n".join(run_script(script, args.out)) + "\n")
    for run, wall in walls.items():
        steps = [r["step_time"] for r in metrics(args.out / run) if "step_time" in r]
        print(f"{run}: {'read, not run' if wall is None else f'{wall:.1f} min wall'}, {len(steps)} steps, "
              f"median step {statistics.median(steps):.1f} s")


if __name__ == "__main__":
    main()
