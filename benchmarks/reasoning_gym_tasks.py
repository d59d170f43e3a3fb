"""Which reasoning-gym task suits the bundled 135M model: its held-out accuracy on several, before
any training, measured as `grpokit eval` measures it (greedy, 50 held-out prompts, reasoning-gym's
score_answer on what the <answer> tags hold).

    python benchmarks/reasoning_gym_tasks.py

A task to train on needs some signal at the start (some right answers among a group's samples)
and room to grow. Prints a Markdown table and writes it to benchmarks/results/reasoning_gym_tasks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (dataset name, generator arguments): small instances of tasks a 135M model could plausibly learn.
TASKS = [
    ("chain_sum", "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"),
    ("basic_arithmetic", "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"),
    ("letter_counting", "{min_words: 3, max_words: 5}"),
    ("spell_backward", "{}"),
    ("leg_counting", "{}"),
    ("gcd", "{}"),
    ("number_sorting", "{min_numbers: 3, max_numbers: 3}"),
    ("word_sorting", "{}"),
]
SETTINGS = ["data.eval_size=50", "rollout.max_completion_length=16"]


def main() -> None:
    rows = ["| task | data.task_args | held-out accuracy | completions with <answer> tags |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, arguments in TASKS:
            output = Path(tmp) / f"{name}.jsonl"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "grpokit", "eval", "--model", "smollm2-135m-instruct", "--task",
                            f"reasoning_gym:{name}", f"data.task_args={arguments}", *SETTINGS, "--output", str(output)],
                           check=True, capture_output=True)
            records = [json.loads(line) for line in output.read_text().splitlines()]
            accuracy = sum(r["reward"] for r in records) / len(records)
            tagged = sum("<answer>" in r["completion"] for r in records)
            rows.append(f"| {name} | `{arguments}` | {accuracy:.2f} | {tagged}/{len(records)} |")
            print(rows[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    table = "\n".join(rows)
    print(table)
    out = Path(__file__).parent / "results" / "reasoning_gym_tasks.md"
    out.write_text(f"`python benchmarks/reasoning_gym_tasks.py` (grpokit eval: {' '.join(SETTINGS)})\n\n{table}\n")


if __name__ == "__main__":
    main()
