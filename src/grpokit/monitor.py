"""Where a run's numbers go: `metrics.jsonl` (one JSON object per line) and a progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than crash the logger
    return value


class Monitor:
    """Writes and shows a run; `run_dir=None` (a data-parallel process other than 0) stays silent."""

    def __init__(self, run_dir: Path | None, total_steps: int, initial: int = 0, enabled: bool = True):
        self.silent = run_dir is None
        self._file = None if self.silent else (run_dir / "metrics.jsonl").open("a")
        self.bar = tqdm(
            total=total_steps, initial=initial, desc="grpo", unit="step", dynamic_ncols=True, disable=self.silent or not enabled
        )
        self._postfix: dict[str, str] = {}

    def log(self, row: dict) -> None:
        if self.silent:
            return
        self._file.write(json.dumps({k: _plain(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def step(self, metrics: dict) -> None:
        self.log(metrics)
        self._postfix.update(reward=f"{metrics['reward']:.3f}", step_time=f"{metrics['step_time']:.1f}s")
        self.bar.set_postfix(self._postfix, refresh=False)
        self.bar.update(1)

    def eval(self, step: int, metrics: dict) -> None:
        self.log({"step": step, **metrics})
        self._postfix["eval"] = f"{metrics['eval/reward']:.3f}"
        self.bar.set_postfix(self._postfix)
        parts = [f"{k.removeprefix('eval/rewards/').removesuffix('/mean')} {v:.3f}"
                 for k, v in metrics.items() if k.startswith("eval/rewards/")]
        self.write(f"step {step}: eval/reward {metrics['eval/reward']:.3f} (" + ", ".join(parts) + ")")

    def write(self, text: str) -> None:
        if not self.silent:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
