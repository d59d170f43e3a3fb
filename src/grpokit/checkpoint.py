"""The run directory, atomic checkpoints, and resuming exactly where a run stopped.

A checkpoint is the folder `<run_dir>/checkpoints/step-N/`:

    config.json, model.safetensors, tokenizer files   the policy, a Hugging Face model folder
                                                      (`from_pretrained` and `grpokit eval` load it)
    optimizer.pt        AdamW state (full, keyed by parameter name: the same sharded or not) and learning-rate schedule
    rng.pt              every process's RNG states (python, numpy, torch, CUDA) and the stream
                        the per-completion sampling seeds are drawn from
    config.yaml         the run's config, checked against the config of a resumed run
    trainer_state.json  step, data stream position, token count, skipped-step counters

Atomicity: a checkpoint is written into `checkpoints/.step-N.tmp/`, flushed to disk, then renamed
to `step-N` in one `os.replace`. A crash at any moment leaves either the whole new checkpoint or
none, and the older ones untouched; a leftover `.tmp` folder is never read, and is removed when
the run resumes. Older checkpoints are deleted only after the new one is complete.

Resuming restores all of the above, and truncates `metrics.jsonl` to the checkpoint's step: the
resumed run then logs exactly the rows the uninterrupted run would have logged (DESIGN.md).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from grpokit.config import Config, ConfigError, StartupError, flatten, save_config

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"  # written last into a checkpoint
_STEP = re.compile(r"step-(\d+)")
# Settings a resumed run may change: they change neither the trajectory nor the update
# (micro_batch_size is a memory knob only, DESIGN.md), only its length and its bookkeeping.
RESUMABLE_CHANGES = frozenset({
    "train.max_steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.resume",
    "train.micro_batch_size", "train.max_skipped_steps", "train.output_dir", "monitor.tensorboard",
    "monitor.log_completions", "monitor.wandb", "monitor.wandb_project", "rollout.server_url", "rollout.server_timeout",
    "train.logprob_chunk_size", "model.gradient_checkpointing",  # memory knobs: the same math
})
# The run's logs, one JSON object per line, each with its step: truncated together on resume.
LOGS = ("metrics.jsonl", "alerts.jsonl", "completions.jsonl")


# ---------------------------------------------------------------- the run directory


def open_run_dir(config: Config) -> tuple[Path, Path | None]:
    """The run directory, checked writable, and the checkpoint to resume from (None: a fresh run).

    Writes nothing but an empty folder: every refusal leaves an existing run as it was.
    """
    t = config.train
    if t.output_dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = Path(config.data.path).stem if config.data.path else config.data.task
        t.output_dir = f"runs/{name}-{stamp}"
    run_dir = Path(t.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise StartupError(f"train.output_dir={run_dir} is not a writable folder: {e.strerror or e}") from None
    _lock(run_dir)
    latest = latest_checkpoint(run_dir)
    if t.resume == "never" and (latest is not None or (run_dir / "metrics.jsonl").exists() or (run_dir / "final").exists()):
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
    return run_dir, latest


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
    _write_atomic(run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
    if resume_from is None:
        lost = sum("loss" in row for row in read_metrics(run_dir / "metrics.jsonl"))
        for name in LOGS:
            (run_dir / name).unlink(missing_ok=True)
        return [], (f"no checkpoint in {run_dir}: training from step 0 (the {lost} steps logged there were never "
                    "saved)" if lost else None)
    for stale in (run_dir / CHECKPOINTS).glob(".*.tmp"):  # a save that a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    step = checkpoint_step(resume_from)
    kept = {}
    for name in LOGS:
        kept[name] = [row for row in read_metrics(run_dir / name) if row.get("step", step + 1) <= step]
        if (run_dir / name).exists():
            _write_atomic(run_dir / name, "".join(json.dumps(row) + "\n" for row in kept[name]))
    return kept["metrics.jsonl"], f"resuming from {resume_from} (logs truncated to step {step})"


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
    return yaml.safe_load((run_dir / "config.yaml").read_text()), read_metrics(run_dir / "metrics.jsonl")


def check_resumable(saved_config: Path, config: Config) -> None:
    """Raise ConfigError listing every setting that differs from the run's (`saved_config`, a
    config.yaml) and would change the run (see RESUMABLE_CHANGES for those that may)."""
    saved = flatten(yaml.safe_load(saved_config.read_text()))
    now = flatten(config.to_dict())
    differ = [k for k in sorted(saved.keys() | now.keys()) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k)]
    if differ:
        lines = "\n".join(f"  - {k}: {saved.get(k)!r} in the run, {now.get(k)!r} now" for k in differ)
        raise ConfigError(
            f"train.output_dir={config.train.output_dir} holds a run with a different config; resuming it "
            f"would not continue that run:\n{lines}\n"
            f"Resume it with its own config (grpokit train --config {Path(config.train.output_dir) / 'config.yaml'}), "
            "or choose another train.output_dir"
        )


def check_disk_space(run_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(run_dir).free
    if free < needed:
        raise StartupError(
            f"train.output_dir={run_dir} has {free / 2**30:.2f} GiB free, but one checkpoint of this model "
            f"(weights and optimizer state) needs about {needed / 2**30:.2f} GiB: free some space or choose "
            "another train.output_dir"
        )


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About what a checkpoint takes: the weights, and AdamW's two moments per trained weight."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    return sum(p.numel() * p.element_size() * (3 if p.requires_grad else 1) for p in params) + (1 << 20)


# ---------------------------------------------------------------- checkpoints


def checkpoint_step(folder: Path) -> int:
    return int(_STEP.fullmatch(folder.name).group(1))


def checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [d for d in root.glob("step-*") if _STEP.fullmatch(d.name) and (d / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def write_checkpoint(run_dir: Path, step: int, write_files, keep: int | None) -> Path:
    """Create checkpoints/step-`step` atomically: `write_files(folder)` fills a temporary folder,
    which is flushed and renamed; then all but the newest `keep` checkpoints are deleted."""
    target = Path(run_dir) / CHECKPOINTS / f"step-{step}"
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_files(tmp)
        # Test hook: hold the checkpoint half-written, so a test can kill the process right here.
        time.sleep(float(os.environ.get("GRPOKIT_TEST_CHECKPOINT_DELAY", 0)))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    return target


def write_state_files(folder: Path, config: Config, optimizer_state: dict, scheduler, rng: dict, state: dict) -> None:
    """The non-weight files of a checkpoint (trainer_state.json last). `optimizer_state`: the full
    AdamW state keyed by parameter name (sharding.py), whichever way the run was sharded."""
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict()}, folder / "optimizer.pt")
    torch.save(rng, folder / "rng.pt")
    save_config(config, folder / "config.yaml")
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load a model folder's safetensors weights into `model` in place (tied weights are stored once);
    a LoRA checkpoint's adapter weights into a peft model."""
    from safetensors.torch import load_file

    if (Path(folder) / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(Path(folder) / "adapter_model.safetensors"))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"checkpoint {folder} does not fit the model's adapters: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")
        return

    state = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = dict(model.named_parameters())  # a tied weight appears once, under the name that is saved
    missing = [k for k in missing if k in own]
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_state(folder: Path, scheduler) -> tuple[dict, dict, dict]:
    """Restore the scheduler in place; return (the optimizer state, as write_state_files got it,
    rng, trainer state)."""
    # mmap: every process reads the file; pages of moments a process does not keep are never copied.
    saved = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True)
    scheduler.load_state_dict(saved["scheduler"])
    rng = torch.load(folder / "rng.pt", map_location="cpu", weights_only=True)
    return saved["optimizer"], rng, json.loads((folder / STATE_FILE).read_text())


# ---------------------------------------------------------------- random number generators


def rng_state() -> dict:
    """Every global RNG state of this process, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- files


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_model_files(checkpoint: Path, folder: Path) -> None:
    """`folder` := the model files of `checkpoint`, as hard links: no second copy of the weights on
    disk (so a tool that rewrote a file of `folder` in place would change the checkpoint's too;
    save_pretrained writes new files). The old `folder` is removed just before the rename."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state_files = {"optimizer.pt", "rng.pt", "config.yaml", STATE_FILE}
    for f in checkpoint.iterdir():
        if f.name not in state_files:
            try:
                os.link(f, tmp / f.name)
            except OSError:  # a filesystem without hard links
                shutil.copy2(f, tmp / f.name)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
