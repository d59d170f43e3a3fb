"""Data parallelism: which completions each process owns, and the reductions that keep every
statistic a statistic of the whole batch.

Launch with `torchrun --nproc_per_node N -m grpokit train ...` or
`accelerate launch --multi_gpu --num_processes N -m grpokit train ...` (accelerate's name for its
torchrun-based launcher; it works on CPU too). accelerate's `PartialState` reads the launcher's
environment and starts the process group: gloo on CPU, NCCL on GPU. Without a launcher every
function here is that of a single process, and no process group exists.

The promise: the number of processes never changes the update. So the
step's completions are numbered globally (prompt after prompt, G each) exactly as one process
numbers them; optimizer update u consumes global rows [u*U, (u+1)*U) whatever the process count;
process r owns the r-th of W equal slices of each update's rows (`shard_rows`). Rewards are
gathered before advantages are computed, so a group may span processes; gradients are summed
(the loss is already normalized by whole-update counts), never averaged. Every completion samples
from its own seed (drawn for the whole step, the same on every process), so the process count
does not change what is sampled either.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import pickle

import torch
import torch.distributed as dist


def init() -> torch.device:
    """Join the launcher's process group, if any; the device this process computes on."""
    from accelerate import PartialState

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A module imported once the group exists may keep it for good as a default argument
        # (`group=dist.group.WORLD`), and its threads with it: torch's autograd collectives, and
        # DeepSpeed's comm (transformers' save_pretrained imports it on the saving process).
        # Imported before, they keep None. DeepSpeed's accelerator is the CPU where there is no GPU.
        importlib.import_module("torch.distributed.nn")
        if importlib.util.find_spec("deepspeed") is not None:
            if not torch.cuda.is_available():
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            importlib.import_module("deepspeed.comm")
    # cpu=True is what makes accelerate pick gloo when a launcher started several CPU processes.
    return PartialState(cpu=not torch.cuda.is_available()).device


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def rank() -> int:
    return dist.get_rank() if _active() else 0


def is_main() -> bool:
    return rank() == 0


def _comm_device() -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_rows(num_rows: int, rows_per_update: int, world_size: int, rank: int) -> torch.Tensor:
    """Global row numbers (num_rows / world_size,) owned by process `rank`, in update order.

    Update u consumes rows [u*U, (u+1)*U); process r owns the r-th of `world_size` equal
    contiguous slices of each. Contiguous slices keep a process's share of a group together, so
    its prompt is encoded (and its key/value cache computed) once per process.
    """
    if rows_per_update % world_size or num_rows % rows_per_update:
        raise ValueError(
            f"{rows_per_update} completions per update cannot be split over {world_size} processes "
            f"({num_rows} completions per step)"
        )
    share = rows_per_update // world_size
    starts = torch.arange(0, num_rows, rows_per_update) + rank * share  # (num_updates,)
    return (starts[:, None] + torch.arange(share)).reshape(-1)  # (num_rows / world_size,)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Elementwise "sum" or "max" over processes (a new tensor, on t's device)."""
    if not _active():
        return t.clone()
    out = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return out.to(t.device)


def gather_rows(local: torch.Tensor, num_rows: int, rows_per_update: int) -> torch.Tensor:
    """The whole step's values (num_rows, ...) from each process's rows (its `shard_rows`)."""
    W = world_size()
    if W == 1:
        return local.clone()
    parts = [torch.empty_like(local, device=_comm_device()) for _ in range(W)]
    dist.all_gather(parts, local.detach().to(_comm_device()))
    out = local.new_empty((num_rows, *local.shape[1:]))
    for r, part in enumerate(parts):
        out[shard_rows(num_rows, rows_per_update, W, r).to(out.device)] = part.to(out.device)
    return out


def gather_lists(local: list) -> list:
    """Concatenation, in process order, of every process's list of picklable values."""
    if not _active():
        return list(local)
    parts = [None] * world_size()
    dist.all_gather_object(parts, local)
    return [x for part in parts for x in part]


def means(values: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """For each name any process holds (value, weight) pairs of, the weighted mean of all
    processes' values, by name in sorted order (a collective; a process may hold no value of a
    name). Weights are taken relative to the largest, so that equal weights give the plain mean,
    bit for bit."""
    names = sorted({name for held in gather_lists([list(values)]) for name in held})
    if not names:
        return {}
    top = all_reduce(torch.tensor(max((w for held in values.values() for _, w in held), default=1.0),
                                  dtype=torch.float64), "max").item()
    totals = all_reduce(torch.tensor([[math.fsum(v * (w / top) for v, w in values.get(n, ())),
                                       math.fsum(w / top for _, w in values.get(n, ()))] for n in names],
                                     dtype=torch.float64))  # (names, 2)
    return {n: total / count for n, (total, count) in zip(names, totals.tolist()) if count}


def on_main(fn):
    """fn() run on process 0 alone; its result, or the error it raised, on every process.

    An error re-raised everywhere stops every process with the same message, where the others would
    otherwise wait forever at their next collective.
    """
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - handed to every process below
            error = _picklable(e)
    if _active():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error is not None:
        raise error
    return result


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Give every process process 0's weights (a model initialised without a seed would differ)."""
    if not _active():
        return
    for p in module.parameters():
        buffer = p.data.to(_comm_device())
        dist.broadcast(buffer, src=0)
        p.data.copy_(buffer)


def sum_gradients(params: list[torch.nn.Parameter], bucket_elements: int = 1 << 25) -> None:
    """Sum every parameter's .grad over processes, in buckets (fewer, larger messages)."""
    if not _active():
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params + [None]:
        if p is not None:
            bucket.append(p.grad)
            size += p.grad.numel()
        if bucket and (p is None or size >= bucket_elements):
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(_comm_device())  # (size,)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0


_meshes_made = False  # set by meshes_made()


def meshes_made() -> None:
    """Called by what builds a torch DeviceMesh (FSDP2's sharding): finish() then releases its groups."""
    global _meshes_made
    _meshes_made = True


def finish() -> None:
    """Wait for every process (process 0 may still be writing), then leave the group, its threads
    ended here rather than while the interpreter tears down."""
    if _active():
        dist.barrier()
        dist.destroy_process_group()
        if _meshes_made:
            _release_meshes()


def _release_meshes() -> None:
    """torch (2.13) keeps a DeviceMesh's process groups in the mesh's `_pg_registry` after
    destroy_process_group, and an FSDP2 model keeps its mesh: the world group, its gloo threads
    running, would live on until the interpreter's teardown destroyed it midway. (A process ending
    so once aborted at exit: "terminate called without an active exception".) Emptied, the group is
    destroyed now and its threads joined. (A whole collection and a walk over every object: a
    process that made no mesh skips them.)"""
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # a finished run's sharded model, in reference cycles, holds the group too
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(str(error))
