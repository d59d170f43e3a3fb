"""What the agent path costs: the default run against the same run through a verifiers
SingleTurnEnv of the built-in task (examples/verifiers_arithmetic.py given the built-in task's
prompts in its order), which trains bit for bit as the default run does (tests/rollouts/test_agents.py).
The difference is the agents' own: the endpoint, the openai clients, verifiers' rollout and rubric.

    python benchmarks/agent_overhead.py [--steps 10] [section.field=value ...]

Each run is its own process, one after the other, on the bundled model. Printed, and written to
benchmarks/results/agent_overhead.md: each run's median phase times and step time, and the ratio
of the median step times; and whether the two runs' losses and rewards are equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/generate", "time/update", "time/optimizer", "step_time")

# The verifiers task with the built-in task's prompts, in its order (as the equality test does).
THROUGH_VERIFIERS = """
import sys
from grpokit.cli import main
from grpokit.tasks import verifiers as through_verifiers
from grpokit.tasks.arithmetic import ArithmeticTask

stream = ArithmeticTask(seed=0, eval_size=0)

def in_stream_order(self, index):
    e = stream.train_example(index)
    return through_verifiers.Example(e.prompt, {"answer": str(e.columns["answer"]), "example_id": index,
                                                "verifiers_task": self.name})

through_verifiers.VerifiersTask.train_example = in_stream_order
sys.exit(main(["train", *sys.argv[1:]]))
"""


def run(name: str, out: Path, args: list[str]) -> list[dict]:
    folder = out / name
    if name == "built-in":
        command = [sys.executable, "-m", "grpokit", "train", *args, f"train.output_dir={folder}"]
    else:
        example = ROOT / "examples" / "verifiers_arithmetic.py"
        command = [sys.executable, "-c", THROUGH_VERIFIERS, *args, f"train.output_dir={folder}",
                   f"rollout.environment=verifiers:{example}:load_environment", "data.task_args={train_size: 10}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "agent_overhead")
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    args = ["--no-progress", f"train.max_steps={a.steps}", "data.eval_size=0", "train.save_every=0", *a.overrides]
    for name in ("built-in", "verifiers"):
        (a.out / name / "metrics.jsonl").unlink(missing_ok=True)  # never resume an earlier run
    rows = {name: run(name, a.out, args) for name in ("built-in", "verifiers")}
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in PHASES} for name, rs in rows.items()}
    same = all(x[k] == y[k] for x, y in zip(rows["built-in"], rows["verifiers"]) for k in ("loss", "reward", "grad_norm"))
    lines = [f"`{' '.join(['python benchmarks/agent_overhead.py', f'--steps {a.steps}', *a.overrides])}`",
             "", "| run | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.2f}" for k in PHASES) + " |" for name, m in medians.items()]
    lines += ["", f"median step time, verifiers / built-in: "
                  f"{medians['verifiers']['step_time'] / medians['built-in']['step_time']:.2f}x; "
                  f"losses, rewards and gradient norms equal: {same}"]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "benchmarks" / "results" / "agent_overhead.md").write_text(text)


if __name__ == "__main__":
    main()
