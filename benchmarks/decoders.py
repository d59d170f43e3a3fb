"""The transformers engine's two decoders (rollout.decoder) on the default run, side by side.

    python benchmarks/decoders.py [--steps 10] [section.field=value ...]

dynamic grows the key/value cache token by token; static sizes it once and decodes at a fixed shape
(on a GPU its step is replayed as a CUDA graph: benchmarks/profile_generate.py measures that). Each
run is its own process, one after the other, on the bundled model. Printed, and written to
benchmarks/results/decoders.md: each run's median time/generate and step time, their ratio, and
whether the two runs sampled the same completions (their rewards and completion lengths equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/generate", "step_time")
SAME = ("reward", "completions/mean_length", "completions/max_length")


def run(decoder: str, out: Path, args: list[str]) -> list[dict]:
    folder = out / decoder
    (folder / "metrics.jsonl").unlink(missing_ok=True)  # never resume an earlier run
    result = subprocess.run([sys.executable, "-m", "grpokit", "train", *args, f"rollout.decoder={decoder}",
                             f"train.output_dir={folder}"], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{decoder} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "decoders")
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    args = ["--no-progress", f"train.max_steps={a.steps}", "data.eval_size=0", "train.save_every=0", *a.overrides]
    rows = {decoder: run(decoder, a.out, args) for decoder in ("dynamic", "static")}
    medians = {d: {k: statistics.median(r[k] for r in rs) for k in PHASES} for d, rs in rows.items()}
    same = all(x[k] == y[k] for x, y in zip(rows["dynamic"], rows["static"]) for k in SAME)
    lines = [f"`{' '.join(['python benchmarks/decoders.py', f'--steps {a.steps}', *a.overrides])}`", "",
             "| rollout.decoder | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    lines += [f"| {d} | " + " | ".join(f"{m[k]:.3f}" for k in PHASES) + " |" for d, m in medians.items()]
    lines += ["", f"median time/generate, static / dynamic: "
                  f"{medians['static']['time/generate'] / medians['dynamic']['time/generate']:.2f}x; "
                  f"the same completions (rewards and lengths equal at every step): {same}"]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "benchmarks" / "results" / "decoders.md").write_text(text)


if __name__ == "__main__":
    main()
