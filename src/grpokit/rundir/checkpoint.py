"""Atomic checkpoints, and the state they restore exactly.

A checkpoint is the folder `<run_dir>/checkpoints/step-N/`:

    config.json, model.safetensors, tokenizer files   the policy, a Hugging Face model folder
                                                      (`from_pretrained` and `grpokit eval` load it)
    optimizer.pt        AdamW state (full, keyed by parameter name: the same sharded or not) and learning-rate schedule
    reference.pt        with algorithm.sync_ref_model, the reference model's weights (they drift)
    rng.pt              every process's RNG states (python, numpy, torch, CUDA) and the stream
                        the per-completion sampling seeds are drawn from
    config.yaml         the run's config, checked against the config of a resumed run
    trainer_state.json  step, data stream position, token count, skipped-step counters
    manifest.json       every other file's size and CRC-32: a resume checks them and goes back to
                        the newest whole checkpoint past a damaged one (moved to step-N.damaged)

Atomicity: a checkpoint is written into `checkpoints/.step-N.tmp/`, flushed to disk, then renamed
to `step-N` in one `os.replace`. A crash at any moment leaves either the whole new checkpoint or
none, and the older ones untouched; a leftover `.tmp` folder is never read, and is removed when
the run resumes (folder.py). Older checkpoints are deleted only after the new one is complete.

The run folder around the checkpoints (its lock, its logs, resuming into it) is folder.py's.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from grpokit.config.loading import save_config
from grpokit.runtime.errors import RunStopped
from grpokit.settings.schema import Config

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"  # written last into a checkpoint
MANIFEST = "manifest.json"  # every other file's size and CRC-32, checked before a resume
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


def _digest(path: Path) -> dict:
    """Size and CRC-32 of a file (zlib's CRC: fast enough to run over every checkpoint)."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def damage(folder: Path) -> list[str]:
    """What is wrong with a checkpoint's files against its manifest: missing, another size, another
    checksum. [] for a whole checkpoint (and for one written before checkpoints had manifests)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return []
    try:
        listed = json.loads(manifest.read_text())
    except ValueError:
        return [f"{MANIFEST} unreadable"]
    problems = []
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, {expected['size']} were written")
        elif _digest(path)["crc32"] != expected["crc32"]:
            problems.append(f"{name} does not have the checksum it was written with")
    return problems


def newest_whole_checkpoint(run_dir: Path) -> tuple[Path | None, dict[Path, list[str]]]:
    """The newest checkpoint whose files match its manifest, and the damage of each newer one."""
    damaged = {}
    for folder in reversed(checkpoints(run_dir)):
        problems = damage(folder)
        if not problems:
            return folder, damaged
        damaged[folder] = problems
    return None, damaged


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint to step-N.damaged: kept for a look, never read, and out of the
    way of the step-N the resumed run writes again."""
    aside = folder.with_name(folder.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    return aside


class CheckpointError(RunStopped, OSError):
    """A checkpoint could not be written (a full disk): which, where, and that the previous one is whole."""


def write_checkpoint(run_dir: Path, step: int, write_files, keep: int | None, size: int | None = None) -> Path:
    """Create checkpoints/step-`step` atomically: `write_files(folder)` fills a temporary folder,
    which is flushed and renamed; then all but the newest `keep` checkpoints are deleted. `size`:
    about what it takes, to say so when the disk is too full for it."""
    target = Path(run_dir) / CHECKPOINTS / f"step-{step}"
    free = shutil.disk_usage(run_dir).free
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_files(tmp)
        manifest = {f.name: _digest(f) for f in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        # Test hook: hold the checkpoint half-written, so a test can kill the process right here.
        time.sleep(float(os.environ.get("GRPOKIT_TEST_CHECKPOINT_DELAY", 0)))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, Exception) and (_no_space(error) or (size is not None and free < size)):
            previous = latest_checkpoint(run_dir)
            raise CheckpointError(
                f"saving checkpoint step-{step} in {target.parent} failed: the disk is full ({free / 2**30:.2f} GiB "
                f"were free{f', the checkpoint needs about {size / 2**30:.2f} GiB' if size else ''}; {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}). "
                + (f"The previous checkpoint, {previous}, is whole." if previous else "There is no earlier checkpoint.")
            ) from error
        raise
    if keep is not None:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    return target


def _no_space(error: BaseException) -> bool:
    """Whether `error`, or what caused it, is the operating system's "No space left on device"."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        error = error.__cause__ or error.__context__
    return False


def write_state_files(folder: Path, config: Config, optimizer_state: dict, scheduler, rng: dict, state: dict) -> None:
    """The non-weight files of a checkpoint (trainer_state.json last). `optimizer_state`: the full
    AdamW state keyed by parameter name (training/sharding.py), whichever way the run was sharded."""
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
    own = dict(model.named_parameters())  # a tied weight appears once, under the name that is saved
    if not state.keys() <= model.state_dict().keys() and hasattr(type(model), "from_pretrained"):
        # Saved in the checkpoint format transformers writes (save_pretrained's original format: a
        # mixture of experts' fused weights one expert at a time); its loading converts them back.
        try:
            loaded, info = type(model).from_pretrained(folder, dtype=next(iter(own.values())).dtype,
                                                       output_loading_info=True)
        except (RuntimeError, OSError, ValueError) as e:
            raise ValueError(f"checkpoint {folder} does not fit the model: {str(e).splitlines()[0]}") from None
        unread = [*info["missing_keys"], *info["unexpected_keys"], *info["mismatched_keys"]]
        if unread:  # (from_pretrained draws what it cannot read at random, and only warns)
            raise ValueError(f"checkpoint {folder} does not fit the model: {sorted(map(str, unread))[:5]}")
        state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
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
    state_files = {"optimizer.pt", "rng.pt", "reference.pt", "config.yaml", STATE_FILE, MANIFEST}
    for f in checkpoint.iterdir():
        if f.name not in state_files:
            try:
                os.link(f, tmp / f.name)
            except OSError:  # a filesystem without hard links
                shutil.copy2(f, tmp / f.name)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
