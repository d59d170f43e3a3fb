"""Atomic checkpoints, and the state they restore exactly.

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
the run resumes (rundir.py). Older checkpoints are deleted only after the new one is complete.

The run folder around the checkpoints (its lock, its logs, resuming into it) is rundir.py's.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from grpokit.config import Config, save_config

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"  # written last into a checkpoint
_STEP = re.compile(r"step-(\d+)")


# ---------------------------------------------------------------- checkpoints


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About what a checkpoint takes: the weights, and AdamW's two moments per trained weight."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    return sum(p.numel() * p.element_size() * (3 if p.requires_grad else 1) for p in params) + (1 << 20)


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
