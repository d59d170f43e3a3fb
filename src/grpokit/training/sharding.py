"""Sharded training: weights, gradients and AdamW state split over processes (FSDP2, DeepSpeed ZeRO).

Chosen by the accelerate config a run is launched with (runtime/launch.py reads it; the settings
grpokit cannot run are refused with every other rule by config/checks.py):

    accelerate launch --config_file examples/accelerate/fsdp2-1-node-8-gpus.yaml -m grpokit train ...

grpokit shards with the engines themselves, torch's
`fully_shard` and `deepspeed.initialize`, rather than through `Accelerator.prepare`: accelerate's
FSDP path runs on GPUs only, and its optimizer wrapper steps DeepSpeed at every micro-batch. So the
code the CPU tests run (gloo) is the code GPUs run.

What sharding changes, and what it must not:
- The update is still the sum over processes of each process's share (runtime/distributed.py): FSDP2's
  reduce-scatter is told to divide by 1, and DeepSpeed's average is multiplied back by the process
  count.
- Every forward gathers weights from every process, so all processes make the same calls
  (`lockstep`): generation runs until every process's completions have finished, every row goes
  through forward and backward (none skipped for a zero advantage: it adds exactly 0 anyway), and
  evaluation slices are of equal size.
- Checkpoints hold the full weights and the full AdamW state, gathered to process 0, in the files an
  unsharded run writes (FQN-keyed, torch.distributed.checkpoint's full format): a run resumes on
  another process count or engine, and `final/` is a plain Hugging Face folder.
- A rollout server receives full weights, gathered by every process, sent by process 0.
- LoRA: the frozen base is sharded as every weight is (ZeRO-2: only the adapters' gradients and
  AdamW state), and the adapters with their layers; checkpoints hold the adapters, gathered whole,
  and a rollout server gets the adapters alone, or the merged weights computed from the gathered
  tensors.
"""

from __future__ import annotations

import math

import torch

from grpokit.engines.weights import adapter_tensors, is_lora, merged_lora_weights, named_weights
from grpokit.runtime import distributed
from grpokit.runtime.errors import StartupError
from grpokit.runtime.launch import Launch


def from_launch(config, launch: Launch) -> Strategy:
    """The strategy the launcher's accelerate config asks for (runtime/launch.py; config/checks.py
    refused what grpokit cannot run): Replicated, FSDP2 or DeepSpeed."""
    if launch.sharding is None:
        return Replicated()
    return FSDP2(launch.plugin) if launch.sharding == "FSDP" else DeepSpeed(config, launch.deepspeed_config,
                                                                            launch.world_size)


class Strategy:
    """What every way of holding the model does, unless it says otherwise: the model as it is, the
    optimizer built as asked, a plain backward, and an update that clips, applies if finite and
    drops the gradients. Replicated, FSDP2 and DeepSpeed each override what they do differently."""

    name: str
    lockstep = False  # whether every process must make every forward call (weights are sharded)
    fused_adamw = True  # torch's one-kernel AdamW (trainer.py)

    def wrap(self, model, reference):
        """The policy and reference model (or None) as this strategy holds them."""
        return model, reference

    def describe(self, model) -> str | None:
        """A start-up line: how the weights are spread over processes (None when not sharded)."""
        return None

    def make_optimizer(self, model, params, make):
        """The optimizer over `params`, built by `make(params)`."""
        return make(params)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Back-propagate one micro-batch's loss; `last`: the update's last micro-batch."""
        loss.backward()

    def step(self, optimizer, params, max_norm: float, loss_finite: bool) -> tuple[float, bool]:
        """Clip the (reduced) gradients, apply the update if finite, drop the gradients:
        (gradient norm before clipping, the same on every process; applied)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # a DTensor when sharded
        applied = loss_finite and math.isfinite(grad_norm)
        if applied:
            optimizer.step()
        # None rather than zeros kept in place: the next backward then writes each gradient
        # instead of adding it to zeros (a fill and an add over every weight, per update).
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def full_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the whole model under the checkpoint's names (a LoRA model's merged); a
        collective when sharded (the tensors are complete on process 0 only)."""
        return named_weights(model)

    def adapter_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        """LoRA's adapters under the peft model's parameter names, on process 0 (a collective when
        sharded)."""
        return adapter_tensors(model) if distributed.is_main() else []

    def checkpoint_weights(self, model) -> list[tuple[str, torch.Tensor]] | None:
        """What a checkpoint writes when the model does not hold it whole itself (None: it does):
        the full weights, or a LoRA model's adapters."""
        return None

    def optimizer_state(self, model, optimizer) -> dict:
        """The full AdamW state keyed by parameter name (torch.distributed.checkpoint's full format;
        a collective when sharded): {"state": {name: {"step", "exp_avg", "exp_avg_sq"}},
        "param_groups": [{..., "params": [name, ...]}]}."""
        names = _names_in_optimizer_order(model, optimizer)
        saved = optimizer.state_dict()
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]
        return {"state": {names[i]: v for i, v in saved["state"].items()}, "param_groups": groups}

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        """optimizer_state's `state` into `optimizer`, which keeps running as it was built."""
        self._load_optimizer_state(model, optimizer, _as_built(optimizer, state))

    def _load_optimizer_state(self, model, optimizer, state: dict) -> None:
        if any(isinstance(k, int) for k in state["state"]):  # written by a grpokit before the name-keyed format
            optimizer.load_state_dict(state)
            return
        index = {name: i for i, name in enumerate(_names_in_optimizer_order(model, optimizer))}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
        optimizer.load_state_dict({"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups})


class Replicated(Strategy):
    """Every process holds the whole model and optimizer; gradients are summed (runtime/distributed.py)."""

    name = "replicated"

    def step(self, optimizer, params, max_norm: float, loss_finite: bool) -> tuple[float, bool]:
        for p in params:
            # A weight no backward reached (no row of this process was active) has a zero gradient,
            # not none: AdamW must step it (moments decay, weight decay applies), and the sum needs it.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        distributed.sum_gradients(params)
        return super().step(optimizer, params, max_norm, loss_finite)


def _as_built(optimizer, state: dict) -> dict:
    """`state` with its param groups' implementation settings (fused, foreach) replaced by this
    optimizer's: how AdamW runs is this run's choice (FSDP2 cannot run the fused one), not the
    checkpoint's, and torch's load_state_dict would otherwise take the saved ones."""
    groups = [{**saved, **{k: group[k] for k in ("fused", "foreach") if k in group}}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    return {**state, "param_groups": groups}


def _restore_hyperparameters(optimizer, state: dict) -> None:
    """The saved param groups' settings (lr, betas, ...) into the optimizer's groups."""
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _names_in_optimizer_order(model, optimizer) -> list[str]:
    """Each optimized parameter's name (a tied one under its first), in the optimizer's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


class FSDP2(Strategy):
    """torch's `fully_shard` on each decoder layer and on the whole model, as accelerate's plugin says:
    `fsdp_reshard_after_forward` (true: ZeRO-3-like, false: ZeRO-2-like) and `fsdp_offload_params`
    (parameters, gradients and AdamW state on CPU). Gradients are reduce-scattered in the backward
    pass (every row runs forward, so every weight has one), and clipped by their DTensor norm."""

    lockstep = True
    fused_adamw = False  # torch's fused AdamW fails on sharded (DTensor) weights on CPU (torch 2.13)
    name = "FSDP2"

    def __init__(self, plugin):
        """plugin: accelerate's FullyShardedDataParallelPlugin, as it read the accelerate config."""
        self.plugin = plugin

    def wrap(self, model, reference):
        return self._shard(model), None if reference is None else self._shard(reference)

    def _shard(self, model):
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        base = model.get_base_model() if is_lora(model) else model
        names = set(self.plugin.transformer_cls_names_to_wrap or getattr(base, "_no_split_modules", None) or ())
        if not names:
            raise StartupError(f"FSDP2: no decoder layer class to shard {type(base).__name__} by: set "
                               "fsdp_transformer_layer_cls_to_wrap in the accelerate config")
        offload = self.plugin.cpu_offload
        if isinstance(offload, CPUOffloadPolicy) and not torch.cuda.is_available():
            offload = CPUOffloadPolicy(pin_memory=False)  # pinned memory needs a GPU (tests run this on CPU)
        options = {"reshard_after_forward": self.plugin.reshard_after_forward, "offload_policy": offload}
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if not layers:
            raise StartupError(f"FSDP2: {type(base).__name__} has no module of class {sorted(names)}")
        distributed.meshes_made()  # fully_shard makes the world's DeviceMesh
        for layer in layers:
            fully_shard(layer, **options)
        # What is left (embeddings, final norm, output layer) stays gathered from the whole model's
        # forward to its backward: the chunked output layer (models/logprobs.py) is applied outside it.
        fully_shard(model, **{**options, "reshard_after_forward": False})
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # The loss is already each process's share of the whole update: sum, never average.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        return model

    def describe(self, model) -> str:
        local = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        offload = "on" if type(self.plugin.cpu_offload).__name__ == "CPUOffloadPolicy" else "off"
        return (f"FSDP2 over {distributed.world_size()} processes: process 0 holds {local / total:.1%} of the "
                f"{total:,} weights (reshard_after_forward={self.plugin.reshard_after_forward}, CPU offload {offload})")

    def optimizer_state(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if not optimizer.state:  # before the first update: torch's helper would run a fake step to create it
            return super().optimizer_state(model, optimizer)
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))

    def _load_optimizer_state(self, model, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not state["state"]:  # saved before the first update: hyperparameters only (no fake step)
            _restore_hyperparameters(optimizer, state)
            return
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def full_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not distributed.is_main():  # only process 0 receives tensors
            return []
        if is_lora(model):  # merged from the gathered tensors (peft's own merge reads the layers' shards)
            return merged_lora_weights(model, state)
        return [(name, state[name]) for name, _ in named_weights(model)]  # named_weights' order (tied weights once)

    def adapter_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        # One gather per adapter tensor, every process in the same order; process 0 keeps them.
        out = [(name, _whole(p).detach().cpu()) for name, p in model.named_parameters() if "lora_" in name]
        return out if distributed.is_main() else []

    def checkpoint_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        return self.adapter_weights(model) if is_lora(model) else self.full_weights(model)


def _whole(p) -> torch.Tensor:
    """A sharded parameter (DTensor) gathered whole; shards offloaded to the CPU are gathered on the
    GPU, where NCCL (accelerate's process group there) can."""
    from torch.distributed.tensor import DTensor

    local = p.to_local()
    if local.device.type == "cpu" and torch.cuda.is_available():
        p = DTensor.from_local(local.cuda(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return p.full_tensor()


def _deepspeed():
    """deepspeed, ready for `deepspeed.initialize`. On CPU its comm builds, as it starts, a
    shared-memory all-reduce kernel (a C++ extension compiled with the machine's compiler, again
    for each new Python environment) that only its inference engine calls: training reduces through
    the process group (gloo). Marked unavailable, it is not built."""
    import deepspeed

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the dict DeepSpeed reads it from
    return deepspeed


class DeepSpeed(Strategy):
    """`deepspeed.initialize` with the accelerate config's ZeRO stage and offload devices, around
    grpokit's own AdamW (the same update as every other strategy; DeepSpeed's CPU Adam is not used)."""

    name = "DeepSpeed"

    def __init__(self, config, ds: dict, world_size: int):
        """ds: the DeepSpeed config the accelerate config names (runtime/launch.py)."""
        zero = ds.get("zero_optimization", {})
        self.stage = int(zero.get("stage", 0))
        # One micro-batch per DeepSpeed step of bookkeeping; grpokit marks the update's last
        # micro-batch as the accumulation boundary itself (backward()).
        micro = config.micro_batch_size(world_size)
        self.config = {
            **ds, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "train_batch_size": micro * world_size, "gradient_clipping": config.train.max_grad_norm or 0.0,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**62,
        }
        self.world_size = world_size
        self.engine = None
        # ZeRO-3 gathers weights in every forward, and ZeRO-2 reduces gradients in every backward:
        # either way every process must make every call.
        self.lockstep = True

    def wrap(self, model, reference):
        if reference is not None and self.stage == 3:  # a sharded, frozen reference: no optimizer
            deepspeed = _deepspeed()
            frozen = {k: v for k, v in self.config.items() if k not in ("zero_optimization",)}
            frozen["zero_optimization"] = {k: v for k, v in self.config["zero_optimization"].items()
                                           if k != "offload_optimizer"}
            deepspeed.initialize(model=reference, config=frozen)
        return model, reference

    def describe(self, model) -> str:
        zero = self.config.get("zero_optimization", {})
        offload = ", ".join(f"{what} offloaded to {zero[key]['device']}"
                            for key, what in (("offload_optimizer", "AdamW state"), ("offload_param", "weights"))
                            if zero.get(key, {}).get("device", "none") not in (None, "none")) or "no offload"
        params = list(model.parameters())
        if self.stage == 3:
            local, total = sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)
            held = f"process 0 holds {local / total:.1%} of the {total:,} weights"
        else:
            held = "every process holds the whole weights; gradients and AdamW state are sharded"
        return f"DeepSpeed ZeRO-{self.stage} over {self.world_size} processes: {held} ({offload})"

    def make_optimizer(self, model, params, make):
        deepspeed = _deepspeed()
        optimizer = make(params)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config)
        self.inner = optimizer  # the AdamW inside DeepSpeed's ZeRO optimizer: its param groups hold the lr
        return optimizer

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        # The engine's own forward would do this: without it ZeRO-3 overwrites, rather than adds
        # to, the previous micro-batch's gradients (grpokit calls the module itself).
        self.engine.optimizer.clear_backward_seen_flag()
        self.engine.set_gradient_accumulation_boundary(last)  # reduce (and step) at the update's end only
        # DeepSpeed averages gradients over processes; the loss is a share of a sum. A non-finite
        # loss makes the gradient NaN, so that DeepSpeed skips the update, as grpokit does elsewhere.
        scale = torch.where(torch.isfinite(loss.detach()), float(self.world_size), math.nan)
        self.engine.backward(loss * scale, scale_wrt_gas=False)

    def step(self, optimizer, params, max_norm: float, loss_finite: bool) -> tuple[float, bool]:
        # DeepSpeed clips (to gradient_clipping = train.max_grad_norm), and skips an update whose
        # gradient norm is not finite, inside step().
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        grad_norm = math.nan if norm is None else float(norm)
        return grad_norm, bool(self.engine.was_step_applied())

    def full_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        if is_lora(model):  # merged from the gathered tensors (peft's own merge reads the layers' partitions)
            whole = dict(self._gathered(model.state_dict(keep_vars=True).items()))
            return merged_lora_weights(model, whole) if distributed.is_main() else []
        return self._gathered(named_weights(model))

    def _gathered(self, named) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) whole on process 0, in host memory (ZeRO-3: gathered one at a time, a collective)."""
        import deepspeed

        out = []
        for name, tensor in named:
            if hasattr(tensor, "ds_id"):
                with deepspeed.zero.GatheredParameters([tensor]):
                    tensor = tensor.detach().to("cpu", copy=True)
            if distributed.is_main():
                out.append((name, tensor.detach().cpu()))
        return out

    def adapter_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        return self._gathered((name, p) for name, p in model.named_parameters() if "lora_" in name)

    def checkpoint_weights(self, model) -> list[tuple[str, torch.Tensor]]:
        return self.adapter_weights(model) if is_lora(model) else self.full_weights(model)

    def optimizer_state(self, model, optimizer) -> dict:
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = [s["step"] for s in self.inner.state.values() if "step" in s]
        state = {}
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name, p in model.named_parameters():
            if p.requires_grad and steps:
                moments = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}  # a collective
                if distributed.is_main():  # the one that writes; the others drop theirs at once
                    state[name] = {"step": steps[0].detach().cpu().clone(), **{k: v.cpu() for k, v in moments.items()}}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names} for g in self.inner.param_groups]
        return {"state": state, "param_groups": groups}

    def _load_optimizer_state(self, model, optimizer, state: dict) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        _restore_hyperparameters(self.inner, state)
        if not state["state"]:
            return
        step = next(iter(state["state"].values()))["step"]
        # AdamW's state as its first step would create it, for each flat fp32 partition ZeRO steps it on.
        zero = self.engine.optimizer
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        for flat in flats:
            # Where AdamW keeps its step count: beside the weights when fused, on the CPU otherwise.
            device = flat.device if self.inner.defaults.get("fused") else "cpu"
            self.inner.state[flat] = {"step": step.to(device, torch.float32, copy=True), "exp_avg": torch.zeros_like(flat),
                                      "exp_avg_sq": torch.zeros_like(flat)}
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link it after the first step
            zero._lazy_init_hp_params_optimizer_state()
        for name, p in model.named_parameters():
            if p.requires_grad:
                for key in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(p, state["state"][name][key].to(p.device), key)
