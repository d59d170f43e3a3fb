"""Weights between the trainer and a rollout engine in another process: their identity, their
checksum, and the torch.distributed group that carries them.

- `fingerprint(model)`: what must match for a server to generate for a trainer: architecture,
  vocabulary size, dtype, quantization, and every parameter's name and shape. A server refuses a request whose
  fingerprint differs from its own, listing the differences.
- `checksum(named_tensors)`: the identity of the values. A CRC-32 of every tensor's bytes (zlib's,
  fast enough to run after every push), combined in name order with names, dtypes and shapes by SHA-256. The
  trainer computes it over its parameters after pushing them and compares it with the one the
  server computed over what it now generates with: equal means the same bits, tensor by tensor.
- `WeightGroup`: a two-process group (trainer rank 0 = rank 0, server = rank 1) built from its
  own TCPStore, separate from any data-parallel group the trainer has: gloo on CPU, NCCL when both
  sides are on GPUs. HTTP only carries the control messages; the tensors go over this group, one
  broadcast per tensor, in the order of `fingerprint`'s names.
"""

from __future__ import annotations

import datetime
import hashlib
import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from grpokit.models.loading import quantization_of


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the model's checkpoint by name: parameters (a tied one once, under its first
    name) and persistent buffers. Works on the meta device (no data pointers to compare). A peft
    model gives its merged weights under the base model's names: W + scale * B @ A, computed
    apart (the base weights are never merged into and unmerged from, which would drift them)."""
    if is_lora(model):
        return _merged_lora_weights(model)
    persistent = model.state_dict(keep_vars=True).keys()
    return [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]


@torch.no_grad()
def _merged_lora_weights(model, merge: bool = True, whole: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """merge=False: the base's own tensors under the same names (their layout; a quantized base's
    cannot be merged into). whole: the peft model's tensors by name, gathered whole (a sharded
    model's own are shards), to merge from instead."""
    base = model.get_base_model()
    modules = dict(base.named_modules())
    prefix = next(name for name, m in model.named_modules() if m is base) + "."  # the base's place in the peft model
    out = []
    for name, tensor in named_weights(base):
        if "lora_" in name:
            continue
        if whole is not None:
            tensor = whole[prefix + name]
        if ".base_layer." in name:
            owner, leaf = name.split(".base_layer.")
            layer = modules[owner]
            if merge and leaf == "weight" and not layer.merged:
                for adapter in layer.active_adapters:  # in the wider dtype (peft keeps adapters in float32), back to W's
                    delta = layer.get_delta_weight(adapter) if whole is None else \
                        _delta_weight(layer, adapter, whole, prefix + owner)
                    wide = torch.promote_types(tensor.dtype, delta.dtype)
                    tensor = (tensor.to(wide) + delta.to(wide)).to(tensor.dtype)
            name = f"{owner}.{leaf}"
        out.append((name, tensor.detach()))
    return out


def _delta_weight(layer, adapter: str, whole: dict, owner: str) -> torch.Tensor:
    """peft's get_delta_weight of a LoRA linear layer (scale * B @ A, transposed for a
    fan-in-fan-out layer), from the gathered tensors `whole` of the layer named `owner`."""
    from peft.tuners.lora.layer import Linear

    if type(layer) is not Linear or layer.use_dora.get(adapter):
        raise NotImplementedError(f"merging {type(layer).__name__} LoRA adapters from gathered tensors is not built "
                                  "(linear layers' are): push the adapters alone, to a `grpokit serve` server")
    product = whole[f"{owner}.lora_B.{adapter}.weight"] @ whole[f"{owner}.lora_A.{adapter}.weight"]
    return (product.T if layer.fan_in_fan_out else product) * layer.scaling[adapter]


def base_weights(model) -> list[tuple[str, torch.Tensor]]:
    """A LoRA model's base weights under the base model's names, without its adapters."""
    return _merged_lora_weights(model, merge=False)


def merged_lora_weights(model, whole: dict) -> list[tuple[str, torch.Tensor]]:
    """named_weights of a LoRA `model` from its tensors gathered whole (by the peft model's names)."""
    return _merged_lora_weights(model, whole=whole)


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A LoRA model's adapter tensors under the peft model's parameter names: what an adapter push
    carries (the base stays where it is)."""
    return [(name, p.detach()) for name, p in model.named_parameters() if "lora_" in name]


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[list]:
    """[name, shape, dtype] of each tensor, in order: what a receiver allocates."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in named_tensors]


def layout_hash(entries: Iterable[list]) -> str:
    return hashlib.sha256(repr([(name, tuple(shape)) for name, shape, *_ in entries]).encode()).hexdigest()[:16]


def fingerprint(model: torch.nn.Module) -> dict:
    """Works on a model on the meta device too (a server whose engine keeps its own tensors); a
    peft model is fingerprinted as its merged base model (what a rollout engine receives)."""
    plain = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = plain.config
    return {
        "architecture": (getattr(config, "architectures", None) or [type(plain).__name__])[0],
        "vocab_size": int(config.get_text_config().vocab_size),  # a vision-language model's is its text model's
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "quantization": quantization_of(plain),  # a quantized base's layers sample otherwise
        "parameters": layout_hash(layout(base_weights(model) if is_lora(model) else named_weights(model))),
    }


def fingerprint_differences(mine: dict, theirs: dict) -> list[str]:
    return [f"{key}: {theirs.get(key)!r} in the request, {mine.get(key)!r} here"
            for key in ("architecture", "vocab_size", "dtype", "quantization", "parameters")
            if mine.get(key) != theirs.get(key)]


class Checksum:
    """Add (name, tensor) pairs in order; `hexdigest()` identifies their names, dtypes, shapes and bytes."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()  # (bytes,)
        self.digest.update(f"{name}:{str(tensor.dtype)}:{tuple(tensor.shape)}:{zlib.crc32(data):08x};".encode())

    def hexdigest(self) -> str:
        return self.digest.hexdigest()[:32]


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    total = Checksum()
    for name, tensor in named_tensors:
        total.add(name, tensor)
    return total.hexdigest()


def device_id() -> str:
    """Where this process keeps its weights: "cpu", or "cuda:<uuid of the GPU>"."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


def backend_between(trainer: str, server: str) -> str:
    """NCCL when trainer and server hold their weights on two different GPUs; else gloo, through CPU
    memory (NCCL cannot connect two processes on one GPU)."""
    return "nccl" if trainer.startswith("cuda:") and server.startswith("cuda:") and trainer != server else "gloo"


class WeightGroup:
    """One side of the trainer-server weight group: rank 0 (the trainer) hosts the TCPStore, on a
    port the OS picks (`port`), rank 1 (the server) connects to it. `connect()` blocks until both
    sides are in, at most `timeout_s`; so does every broadcast."""

    def __init__(self, host: str, rank: int, backend: str, timeout_s: float, port: int = 0):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, 2, rank == 0, timeout=self.timeout, wait_for_workers=False)
        self.port, self.rank, self.backend = self.store.port, rank, backend
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.group = None

    def connect(self) -> WeightGroup:
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout  # a peer that dies mid-transfer: an error after the timeout, not a hang
            self.group = dist.ProcessGroupNCCL(self.store, self.rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(self.store, self.rank, 2, self.timeout)
        return self

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in named_tensors:
            self.group.broadcast(tensor.detach().to(self.device).contiguous(), 0).wait(self.timeout)

    def receive(self, entries: list[list]):
        """Yield (name, tensor) as each of `layout` entries arrives, for the engine to load one at a time."""
        for name, shape, dtype in entries:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.group.broadcast(tensor, 0).wait(self.timeout)
            yield name, tensor

    def close(self) -> None:
        """Abort (not shut down): a transfer in flight with a dead peer must not be waited for."""
        if self.group is not None:
            try:
                self.group.abort()
            except (AttributeError, RuntimeError):
                pass
            self.group = None
