"""Where a run's numbers go, and what watches them.

- `metrics.jsonl`: one JSON object per step (and per evaluation), always.
- TensorBoard event files under `tensorboard/` (monitor.tensorboard=true).
- Weights & Biases (monitor.wandb=true), files under `wandb/`: online when W&B's server can be
  reached and this machine is logged in (WANDB_API_KEY, or `wandb login`'s netrc entry), else
  offline, to upload later with `wandb sync <run>/wandb/offline-run-*`. WANDB_MODE, when set,
  decides instead. Each `grpokit train` makes one W&B run, grouped by run folder: a resumed run
  is a second W&B run starting at its checkpoint's step (W&B cannot rewrite steps it was sent).
- Trackio (monitor.trackio=true), Hugging Face's local-first tracker: every metric, in Trackio's
  local database (TRACKIO_DIR); one Trackio run per `grpokit train`, named and grouped as for W&B.
- `images/`: a vision-language model's prompt images of the completions logged, one PNG each,
  which completions.jsonl names (its `images`).
- `completions.jsonl`: every monitor.log_completions steps, the step's prompts, completions and
  rewards.
- `failures.jsonl`: at every step, whatever monitor.log_completions is, the records (as
  completions.jsonl's) of the completions with a failure: a rollout that failed (its agent's
  `agent_error`), a reward function's call that gave no score (the judge's `error`), a tool call
  that failed. Written before the step's update, so that a run that stops there has them.
- Live stability alerts (diagnose.py): each kind printed once, with the step and the evidence, and
  recorded in `alerts.jsonl`.
- A progress bar.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from tqdm.auto import tqdm

from grpokit.rundir.diagnose import RunFacts, Watch
from grpokit.runtime.errors import StartupError

# The run folder's images of logged prompts (a vision-language model's).
IMAGES = "images"


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than crash the logger
    return value


def wandb_mode() -> tuple[str, str]:
    """("online" | "offline" | WANDB_MODE's value, why)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE is set"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host = url.hostname or "api.wandb.ai"
    try:
        socket.create_connection((host, url.port or (80 if url.scheme == "http" else 443)), timeout=3).close()
    except OSError:
        return "offline", f"{host} cannot be reached"
    try:
        logged_in = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    if not (os.environ.get("WANDB_API_KEY") or logged_in):
        return "offline", f"this machine is not logged in to {host} (wandb login, or WANDB_API_KEY)"
    return "online", f"logged in to {host}"


def _run_name(run_dir: Path, initial: int) -> str:
    """A tracker's run name: the folder's, and a resumed run's is a second run from its step."""
    return run_dir.name if not initial else f"{run_dir.name}-from-step-{initial}"


def _start_wandb(run_dir: Path, config: dict, project: str, initial: int):
    try:
        import wandb
    except ImportError:
        raise StartupError("monitor.wandb=true needs the wandb package: pip install wandb") from None
    mode, why = wandb_mode()
    name = _run_name(run_dir, initial)
    run = wandb.init(project=project, name=name, group=run_dir.name, dir=str(run_dir), config=config, mode=mode)
    return run, f"W&B: {mode} ({why}); files in {run_dir / 'wandb'}" + (
        f"; upload with: wandb sync {run_dir / 'wandb'}/offline-run-*" if mode == "offline" else "")


def _start_trackio(run_dir: Path, config: dict, project: str, initial: int):
    try:
        import trackio
    except ImportError:
        raise StartupError("monitor.trackio=true needs the trackio package: pip install trackio") from None
    name = _run_name(run_dir, initial)
    run = trackio.init(project=project, name=name, group=run_dir.name, config=config, embed=False,
                       auto_log_gpu=False, auto_log_cpu=False)
    from trackio.utils import TRACKIO_DIR

    # Trackio sends to a Space or a server named in the environment, where one is.
    remote = next((f" (and {v}, from {k})" for k in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL") if (v := os.environ.get(k))), "")
    return run, (f"Trackio: project {project!r}, run {name!r}, in {TRACKIO_DIR}{remote}; view with: trackio show "
                 f"--project {project}")


class Monitor:
    """Writes and shows a run; `run_dir=None` (a data-parallel process other than 0) stays silent.

    `history`: the metrics rows a resumed run kept; they prime the alert windows (alerts they
    already raised are not raised again) and TensorBoard drops what it had logged after them.
    """

    def __init__(self, run_dir: Path | None, total_steps: int, facts: RunFacts, tensorboard: bool = False,
                 history: list[dict] = (), initial: int = 0, enabled: bool = True, wandb: dict | None = None,
                 trackio: dict | None = None):
        """`wandb`, `trackio`: None, or {"config": the run's config as a dict, "project": the tracker's project}."""
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
        self.wandb, wandb_note = _start_wandb(run_dir, **wandb, initial=initial) if wandb and not self.silent else (None, "")
        self.trackio, trackio_note = (_start_trackio(run_dir, **trackio, initial=initial) if trackio and not self.silent
                                      else (None, ""))
        self.bar = tqdm(
            total=total_steps, initial=initial, desc="grpo", unit="step", dynamic_ncols=True,
            disable=self.silent or not enabled,
        )
        self._postfix: dict[str, str] = {}
        for note in (wandb_note, trackio_note):
            if note:
                self.write(note)

    def log(self, row: dict) -> None:
        if self.silent:
            return
        plain = {k: _plain(v) for k, v in row.items()}
        self._file.write(json.dumps(plain) + "\n")
        self._file.flush()
        # The numbers (non-finite ones are strings in `plain`), for the trackers that take scalars.
        scalars = {k: v for k, v in plain.items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, row["step"])
        if self.wandb is not None:
            self.wandb.log({k: v.item() if hasattr(v, "item") else v for k, v in row.items() if k != "step"},
                           step=row["step"])
        if self.trackio is not None:
            self.trackio.log(scalars, step=row["step"])
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

    def completions(self, step: int, records: list[dict], log: str = "completions.jsonl") -> None:
        """The step's completions `records`, one JSON object each, to completions.jsonl (or to
        `log`: failures.jsonl's, module docstring)."""
        if self.silent or not records:
            return
        with (self.run_dir / log).open("a") as f:
            for record in records:  # a tool's result or a logged column JSON cannot hold is written as its str()
                if "images" in record:  # a vision-language model's prompt images, by the files that hold them
                    record = {**record, "images": [self._image_file(image) for image in record["images"]]}
                f.write(json.dumps({"step": step, **{k: _plain(v) for k, v in record.items()}}, default=str) + "\n")

    def _image_file(self, image) -> str:
        """The run folder's PNG of a PIL image (images/<hash of its pixels>.png, written once), relative to it."""
        import hashlib

        name = hashlib.sha1(image.tobytes() + repr(image.size).encode()).hexdigest()[:16]
        path = self.run_dir / IMAGES / f"{name}.png"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            image.save(path)
        return f"{IMAGES}/{name}.png"

    def write(self, text: str) -> None:
        if not self.silent:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.trackio is not None:
            self.trackio.finish()
