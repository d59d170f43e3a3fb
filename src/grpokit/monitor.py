"""Where a run's numbers go, and what watches them.

- `metrics.jsonl`: one JSON object per step (and per evaluation), always.
- TensorBoard event files under `tensorboard/` (monitor.tensorboard=true).
- `completions.jsonl`: every monitor.log_completions steps, the step's prompts, completions and
  rewards.
- Live stability alerts (diagnose.py): each kind printed once, with the step and the evidence, and
  recorded in `alerts.jsonl`.
- A progress bar.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm

from grpokit.config import StartupError
from grpokit.diagnose import RunFacts, Watch


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than crash the logger
    return value


class Monitor:
    """Writes and shows a run; `run_dir=None` (a data-parallel process other than 0) stays silent.

    `history`: the metrics rows a resumed run kept; they prime the alert windows (alerts they
    already raised are not raised again) and TensorBoard drops what it had logged after them.
    """

    def __init__(self, run_dir: Path | None, total_steps: int, facts: RunFacts, tensorboard: bool = False,
                 history: list[dict] = (), initial: int = 0, enabled: bool = True):
        self.silent = run_dir is None
        self.run_dir = run_dir
        self.watch = Watch(facts)
        for row in history:
            self.watch.add(row)
        self._file = None if self.silent else (run_dir / "metrics.jsonl").open("a")
        self.tensorboard = None
        if tensorboard and not self.silent:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise StartupError("monitor.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
            # purge_step: a resumed run's TensorBoard forgets the steps after its checkpoint.
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=initial + 1 if initial else None)
        self.bar = tqdm(
            total=total_steps, initial=initial, desc="grpo", unit="step", dynamic_ncols=True,
            disable=self.silent or not enabled,
        )
        self._postfix: dict[str, str] = {}

    def log(self, row: dict) -> None:
        if self.silent:
            return
        self._file.write(json.dumps({k: _plain(v) for k, v in row.items()}) + "\n")
        self._file.flush()
        if self.tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(_plain(value), (int, float)):
                    self.tensorboard.add_scalar(key, _plain(value), row["step"])
        for finding in self.watch.add(row):
            self.write(f"ALERT {finding.text()}")
            with (self.run_dir / "alerts.jsonl").open("a") as f:
                f.write(finding.to_json() + "\n")

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

    def completions(self, step: int, records: list[dict]) -> None:
        """The step's sampled completions, one JSON object each, to completions.jsonl."""
        if self.silent:
            return
        with (self.run_dir / "completions.jsonl").open("a") as f:
            for record in records:
                f.write(json.dumps({"step": step, **{k: _plain(v) for k, v in record.items()}}) + "\n")

    def write(self, text: str) -> None:
        if not self.silent:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
