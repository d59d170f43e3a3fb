"""Whether two runs are the same run, bit for bit: for a change that must not change behaviour.

    python tools/compare_runs.py RUN_A RUN_B

compares the metrics.jsonl rows (the timing keys aside: `time/*` and `step_time`; and `waste/*`, counts
of the compute spent, which a change of how the work is done may move), and the state
files (STATE) under the two run folders, final/ and every checkpoint: weights and tensors with
torch.equal, everything else with ==. A state file that only one run has is a difference too. It prints what differs and exits 1, or exits 0 when nothing does.
docs/architecture.md has the runs to make before and after a change.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def metric_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not (k.startswith(("time/", "waste/")) or k == "step_time")} for row in rows]


def leaves(value, prefix: str = ""):
    """(path, leaf) of a nested structure of dicts, lists and tensors, as torch.save wrote it."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, f"{prefix}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, value


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y


# What a run folder holds that must be the same: weights, optimizer, RNG and trainer state. (Its
# config.yaml files name the run's own folder, and tokenizer files do not depend on the run.)
STATE = ("*.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json")


def load(path: Path) -> dict:
    """A state file as {entry: value}."""
    if path.suffix == ".safetensors":
        return load_file(path)
    if path.suffix == ".json":
        return dict(leaves(json.loads(path.read_text())))
    return dict(leaves(torch.load(path, weights_only=True)))


def differences(a: Path, b: Path) -> list[str]:
    found = []
    rows_a, rows_b = metric_rows(a), metric_rows(b)
    if len(rows_a) != len(rows_b):
        found.append(f"metrics.jsonl: {len(rows_a)} rows against {len(rows_b)}")
    for x, y in zip(rows_a, rows_b):
        if x != y:
            keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
            found.append(f"metrics.jsonl, step {x.get('step')}: " + ", ".join(f"{k} {x.get(k)!r} / {y.get(k)!r}" for k in keys))
    files = [{p.relative_to(run) for pattern in STATE for p in run.rglob(pattern)} for run in (a, b)]
    found += [f"{f}: only in {run}" for f, run in [*((f, a) for f in files[0] - files[1]), *((f, b) for f in files[1] - files[0])]]
    for f in sorted(files[0] & files[1]):
        x, y = load(a / f), load(b / f)
        if x.keys() != y.keys():
            found.append(f"{f}: entries differ")
        found += [f"{f}: {k} differs" for k in sorted(x.keys() & y.keys()) if not same(x[k], y[k])]
    return found


def main(a: str, b: str) -> int:
    found = differences(Path(a), Path(b))
    for line in found:
        print(line)
    print(f"{a} and {b}: " + ("the same run, bit for bit" if not found else f"{len(found)} differences"))
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
