"""The run folder: choosing it, locking it, its logs, and resuming into it.

    <run_dir>/config.yaml      the run's config (a resumed run must match it, but for RESUMABLE_CHANGES)
              metrics.jsonl    one row per step and per evaluation (monitor.py)
              alerts.jsonl     the alerts raised while training (monitor.py, diagnose.py)
              completions.jsonl  samples of prompts, completions and rewards (monitor.log_completions)
              failures.jsonl     every completion with a failure: a rollout, a judge call, a tool call
              checkpoints/step-N/  checkpoint.py
              final/           the last checkpoint's model files
              stop.json        why and where the run last stopped (`record_stop`; gone while it runs)

Process 0 holds an exclusive lock on the folder while it trains in it, so two runs started with
one output_dir cannot write over each other. Resuming from checkpoint step N truncates every log
to step N: the resumed run then logs exactly the rows the uninterrupted run would have logged.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from grpokit.config.loading import flatten
from grpokit.config.variants import VARIANT_SETTINGS
from grpokit.rundir.checkpoint import CHECKPOINTS, checkpoint_step, checkpoints, newest_whole_checkpoint, set_aside
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.settings.schema import Config

# Settings a resumed run may change: they change neither the trajectory nor the update
# (micro_batch_size is a memory knob only), only its length and its bookkeeping.
RESUMABLE_CHANGES = frozenset({
    "train.max_steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.resume",
    "train.micro_batch_size", "train.max_skipped_steps", "train.output_dir", "monitor.tensorboard",
    "monitor.log_completions", "monitor.wandb", "monitor.wandb_project", "monitor.trackio", "monitor.trackio_project",
    "rollout.server_url", "rollout.server_timeout", "distill.timeout",
    # a judge that moved, or answers more slowly: the same scores asked elsewhere
    "reward.judge_url", "reward.judge_timeout", "reward.judge_retries", "reward.judge_concurrency",
    "train.logprob_chunk_size", "model.gradient_checkpointing",  # memory knobs: the same math
    "reward.timeout",  # set to end a hang: a call that returns in time returns the same
})
# The run's logs, one JSON object per line, each with its step: truncated together on resume.
LOGS = ("metrics.jsonl", "alerts.jsonl", "completions.jsonl", "failures.jsonl")
# Why and where the run last stopped, for `grpokit doctor`.
STOP_FILE = "stop.json"


def default_output_dir(config: Config, name: str | None = None) -> str:
    """runs/<name>-<date>-<time>, named after the data unless `name` is given: one folder, the
    name's characters other than letters, digits, '.', '_' and '-' made '-' (a task's ':' and '/')."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = name or (Path(config.data.path).stem if config.data.path else config.data.task)
    return f"runs/{re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('-.') or 'run'}-{stamp}"


def open_run_dir(config: Config) -> tuple[Path, Path | None, list[str]]:
    """The run directory, checked writable; the checkpoint to resume from (None: a fresh run), the
    newest whole one; and a line for each newer one found damaged (set aside).

    Writes nothing but an empty folder before its checks pass: every refusal leaves an existing
    run as it was.
    """
    t = config.train
    if t.output_dir is None:
        t.output_dir = default_output_dir(config)
    run_dir = Path(t.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise StartupError(f"train.output_dir={run_dir} is not a writable folder: {e.strerror or e}") from None
    _lock(run_dir)
    latest, damaged = newest_whole_checkpoint(run_dir)
    if t.resume == "never" and (latest is not None or damaged or (run_dir / "metrics.jsonl").exists() or (run_dir / "final").exists()):
        raise StartupError(
            f"train.output_dir={run_dir} holds a run and train.resume=never: resume it with train.resume=auto, "
            "or choose another train.output_dir"
        )
    if latest is not None:
        check_resumable(latest / "config.yaml", config)
        step = checkpoint_step(latest)
        if step > t.max_steps:
            raise ConfigError(
                f"train.max_steps={t.max_steps}, but the run in {run_dir} is already at step {step}: "
                f"raise train.max_steps to continue it, or choose another train.output_dir"
            )
    elif (run_dir / "final").exists():
        raise StartupError(
            f"train.output_dir={run_dir} holds a trained model (final/) but no checkpoint to resume from: "
            "move that run away or choose another train.output_dir"
        )
    elif (run_dir / "config.yaml").exists() and any("loss" in row for row in read_metrics(run_dir / "metrics.jsonl")):
        # A run that died before its first checkpoint: its weights died with it, and the same
        # config trains them again exactly, so it starts afresh; another config is another run.
        check_resumable(run_dir / "config.yaml", config)
    notes = [f"checkpoint {folder} is damaged ({'; '.join(problems)}): set aside as {set_aside(folder).name}; "
             f"resuming from {latest.name if latest else 'the start'}" for folder, problems in damaged.items()]
    return run_dir, latest, notes


# Process 0's lock on each run directory it trains in, held until the process ends (or the
# run releases it), so that two runs started with one output_dir cannot write over each other.
_LOCKS: dict[str, int] = {}


def _flock(run_dir: Path) -> int | None:
    """A descriptor holding an exclusive lock on the folder itself (no file to leave behind);
    None when another process holds it."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # a filesystem without flock: as if unlocked
        pass
    return fd


def _lock(run_dir: Path) -> None:
    key = str(run_dir.resolve())
    if key in _LOCKS:  # this process already holds it (an earlier run in the same process)
        return
    fd = _flock(run_dir)
    if fd is None:
        raise StartupError(
            f"train.output_dir={run_dir} is in use by another grpokit run that is still running: wait for it, "
            "stop it, or choose another train.output_dir"
        )
    _LOCKS[key] = fd


def run_dir_in_use(run_dir: Path) -> bool:
    """Whether another process (a live run) holds the folder's lock."""
    fd = _flock(run_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


def release_run_dir(run_dir: Path) -> None:
    fd = _LOCKS.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the lock


def start_run_dir(run_dir: Path, config: Config, resume_from: Path | None) -> tuple[list[dict], str | None]:
    """Write the run's config.yaml and set its logs up; the metrics rows kept and a note for the user.

    On resume, the logs (LOGS) are truncated to the checkpoint's step, and interrupted saves are
    removed; on a fresh start they begin empty.
    """
    saved = run_dir / "config.yaml"
    before = config_changes(saved, config) if resume_from is None and saved.is_file() else []
    _write_atomic(run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
    if resume_from is None:
        lost = sum("loss" in row for row in read_metrics(run_dir / "metrics.jsonl"))
        for name in LOGS:
            (run_dir / name).unlink(missing_ok=True)
        if lost:
            return [], (f"no checkpoint in {run_dir}: training from step 0 (the {lost} steps logged there were never "
                        "saved)")
        if before:  # a run that stopped before its first step, started again with another config
            return [], (f"{run_dir} held a run that stopped before its first step, with another config "
                        f"({'; '.join(f'{k}: {was!r} then, {now!r} now' for k, was, now in before[:5])}"
                        f"{f' and {len(before) - 5} more' if len(before) > 5 else ''}): starting afresh with this one")
        return [], None
    for stale in (run_dir / CHECKPOINTS).glob(".*.tmp"):  # a save that a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    step = checkpoint_step(resume_from)
    for name in LOGS:
        if (run_dir / name).exists():  # the kept lines as they were written (NaN stays "nan")
            lines = (run_dir / name).read_text().splitlines(keepends=True)
            _write_atomic(run_dir / name, "".join(line for line in lines if _step_of(line, step + 1) <= step))
    return read_metrics(run_dir / "metrics.jsonl"), f"resuming from {resume_from} (logs truncated to step {step})"


def _step_of(line: str, otherwise: int) -> int:
    """The step of a log line; `otherwise` for a line without one (or cut off by a crash)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return otherwise
    return row.get("step", otherwise) if isinstance(row, dict) else otherwise


def record_stop(run_dir: Path, step: int, saved: int | None, error: BaseException | None) -> None:
    """Write STOP_FILE: the last completed step, the newest checkpoint's step (None: none), and why
    the run stopped: it finished (`error` None), a signal stopped it, or an error did."""
    try:  # in the failure path: nothing here may hide the error that stopped the run
        signum = getattr(error, "signum", None)
        if error is None:
            why = {"reason": "finished"}
        elif signum in set(signal.Signals):  # trainer.Interrupted, signals.StoppedWhileWaiting
            why = {"reason": "signal", "signal": signal.Signals(signum).name, "message": str(error)}
        else:
            why = {"reason": "error", "message": f"{type(error).__name__}: {error}"}
        _write_atomic(run_dir / STOP_FILE, json.dumps({"step": step, "checkpoint": saved, **why}) + "\n")
    except Exception:  # noqa: BLE001 - a full disk, an error that cannot be printed: doctor guesses, as for a killed run
        pass


def clear_stop(run_dir: Path) -> None:
    """The run trains again: the record of its last stop is past (doctor reads the lock meanwhile)."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)


def read_stop(run_dir: Path) -> dict | None:
    """STOP_FILE's record, None when there is none (a run killed outright writes none)."""
    try:
        record = json.loads((run_dir / STOP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "reason" in record else None


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a line cut off by a crash is left out. Non-finite values,
    written as the strings "nan" / "inf" / "-inf" (monitor.py), come back as floats."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append({k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in row.items()})
    return rows


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A run folder's config (as saved) and metrics rows, for tools that read a run without its
    model (`grpokit doctor`, `grpokit report`)."""
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise StartupError(f"{run_dir} is not a grpokit run directory (it needs config.yaml and metrics.jsonl)")
    try:  # a partial or hand-written config is read for what it holds
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except yaml.YAMLError:
        config = None
    return config if isinstance(config, dict) else {}, read_metrics(run_dir / "metrics.jsonl")


def config_changes(saved_config: Path, config: Config) -> list[tuple[str, object, object]]:
    """(key, in the run, now) of every setting that differs from a run's saved config.yaml and
    would change the run (see RESUMABLE_CHANGES for those that may)."""
    saved = flatten(yaml.safe_load(saved_config.read_text()) or {})
    now = flatten(config.to_dict())
    # A setting added since the run started is absent from its config.yaml: it ran with the default.
    defaults = flatten(Config().to_dict())
    was = {k: saved.get(k, defaults.get(k)) for k in saved.keys() | now.keys()}
    # With a decaying learning rate, the number of steps sets every update's rate.
    resumable = RESUMABLE_CHANGES - ({"train.max_steps"} if now.get("train.lr_scheduler") != "constant" else set())
    # A setting of a variant that is off now is read by nothing (config.VARIANT_SETTINGS): a run
    # that set one for nothing, refused since, resumes without it.
    unread = {k for k, variant in VARIANT_SETTINGS.items() if not variant.on(config)}
    return [(k, was[k], now.get(k)) for k in sorted(was)
            if k not in resumable | unread and was[k] != now.get(k)]


def check_resumable(saved_config: Path, config: Config) -> None:
    """Raise ConfigError listing every setting that differs from the run's (`saved_config`, a
    config.yaml) and would change the run."""
    differ = config_changes(saved_config, config)
    if differ:
        lines = "\n".join(f"  - {k}: {was!r} in the run, {now!r} now" for k, was, now in differ)
        raise ConfigError(
            f"train.output_dir={config.train.output_dir} holds a run with a different config; resuming it "
            f"would not continue that run:\n{lines}\n"
            f"Resume it with its own config (grpokit train --config {Path(config.train.output_dir) / 'config.yaml'}), "
            "or choose another train.output_dir"
        )


def check_disk_space(run_dir: Path, config: Config, checkpoint_size: int) -> None:
    """Room for what the run will hold at once: train.keep_checkpoints checkpoints and the one being
    written (all of them with keep_checkpoints null), less those already there."""
    t = config.train
    saves = t.max_steps // t.save_every + 1 if t.save_every else 1  # and one at the end
    held = min(saves, t.keep_checkpoints + 1) if t.keep_checkpoints is not None else saves
    count = max(1, held - len(checkpoints(run_dir)))
    free, needed = shutil.disk_usage(run_dir).free, count * checkpoint_size
    if free < needed:
        raise StartupError(
            f"train.output_dir={run_dir} has {free / 2**30:.2f} GiB free, but this run holds {held} checkpoint(s) "
            f"at once (train.keep_checkpoints={t.keep_checkpoints}, and the one being written), {count} more than "
            f"there are now; one checkpoint of this model (weights and optimizer state) needs about "
            f"{checkpoint_size / 2**30:.2f} GiB, so {needed / 2**30:.2f} GiB in all: free some space, lower "
            "train.keep_checkpoints, or choose another train.output_dir"
        )



def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class TrainResult:
    """What a run leaves: its folder, its evaluations, and the trained model (loaded from final/ on
    first use, on the CPU; a LoRA run's comes with its adapters merged in)."""

    run_dir: Path
    eval_history: list[dict]  # one row per evaluation: {"step": ..., "eval/reward": ...}
    dtype: str = "float32"
    _loaded: dict = field(default_factory=dict, repr=False)

    @property
    def model(self):
        if "model" not in self._loaded:
            from grpokit.models.loading import load_model

            self._loaded["model"] = load_model(str(self.run_dir / "final"), self.dtype).eval()
        return self._loaded["model"]

    @property
    def tokenizer(self):
        if "tokenizer" not in self._loaded:
            from grpokit.models.loading import load_tokenizer

            self._loaded["tokenizer"] = load_tokenizer(str(self.run_dir / "final"))
        return self._loaded["tokenizer"]
