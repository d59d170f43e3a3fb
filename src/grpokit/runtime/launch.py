"""How this process was launched: how many processes take part, and how the accelerate config the
run was launched with asks to hold the model (every process the whole model, FSDP, or DeepSpeed).

    accelerate launch --config_file examples/accelerate/fsdp2-1-node-8-gpus.yaml -m grpokit train ...

accelerate's launcher puts the file in the environment; its plugins (`FullyShardedDataParallelPlugin`,
`DeepSpeedPlugin`) read it back here. What grpokit can run so is decided by config/checks.py (with
every other rule), and training/sharding.py builds what this says.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Launch:
    """The launcher's say: processes, and the sharding asked for with the settings grpokit reads."""

    world_size: int = 1
    sharding: str | None = None  # "FSDP" or "DeepSpeed"; None: every process holds the whole model
    mixed_precision: str = "no"  # the accelerate config's mixed_precision
    fsdp_version: str | None = None  # the accelerate config's fsdp_version (FSDP)
    plugin: Any = None  # accelerate's plugin as it read the settings: FullyShardedDataParallelPlugin or DeepSpeedPlugin
    unreadable: str | None = None  # why accelerate could not read the sharding settings
    deepspeed_installed: bool = True
    zero3_init: bool = False  # the accelerate config's zero3_init_flag (DeepSpeed)

    @property
    def lockstep(self) -> bool:
        """Weights are sharded: every process must make every forward call (each gathers weights
        from every other) and every backward (ZeRO-2 reduces gradients in it)."""
        return self.sharding is not None

    @property
    def deepspeed_config(self) -> dict:
        """The DeepSpeed config the accelerate config names (DeepSpeed launches only)."""
        return dict(self.plugin.deepspeed_config) if self.sharding == "DeepSpeed" and self.plugin is not None else {}


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def read_launch(world_size: int) -> Launch:
    """This process's launch, of `world_size` processes, as the environment says."""
    if not (_flag("ACCELERATE_USE_FSDP") or _flag("ACCELERATE_USE_DEEPSPEED")):
        return Launch(world_size)
    sharding = "FSDP" if _flag("ACCELERATE_USE_FSDP") else "DeepSpeed"
    common = dict(world_size=world_size, sharding=sharding,
                  mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    if sharding == "FSDP":
        version = os.environ.get("FSDP_VERSION", "1")  # accelerate's default is FSDP1
        if version != "2":  # not read: accelerate's FSDP1 plugin asks for a GPU
            return Launch(**common, fsdp_version=version)
        from accelerate.utils import FullyShardedDataParallelPlugin as Plugin
    else:
        if importlib.util.find_spec("deepspeed") is None:
            return Launch(**common, deepspeed_installed=False)
        from accelerate.utils import DeepSpeedPlugin as Plugin
    zero3_init = _flag("ACCELERATE_DEEPSPEED_ZERO3_INIT")
    try:
        plugin = Plugin()
    except (ValueError, RuntimeError) as e:
        return Launch(**common, fsdp_version="2" if sharding == "FSDP" else None, unreadable=str(e), zero3_init=zero3_init)
    return Launch(**common, fsdp_version="2" if sharding == "FSDP" else None, plugin=plugin, zero3_init=zero3_init)
