"""Leaving the process group (runtime/distributed.py `finish`): no thread of it outlives the call.

A gloo group's threads (gloo_tcp_loop, pt_gloo_runloop) end only when the group object is
destroyed. Two things kept it alive past destroy_process_group until the interpreter tore down:
DeepSpeed's comm module imported after the group started (it keeps the group as a default
argument), and an FSDP2 model's DeviceMesh (its `_pg_registry`). Fresh interpreters launched by
torchrun, as in a run: the test processes' own preloads import DeepSpeed first, which hides one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.processes import free_port

pytestmark = pytest.mark.process  # two fresh Python processes

SCRIPT = """
import os
import torch
from grpokit.runtime import distributed



def run():  # a run's sharded model, gone when it returns; torch's caches keep its DeviceMesh
    from types import SimpleNamespace
    from grpokit.training.sharding import FSDP2

    plugin = SimpleNamespace(transformer_cls_names_to_wrap=["Linear"], cpu_offload=None, reshard_after_forward=True)
    model = FSDP2(plugin)._shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    model(torch.ones(2, 4)).sum().backward()
    import deepspeed.comm  # as transformers' save_pretrained imports it on the saving process


distributed.init()
run()
distributed.finish()
names = sorted({open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")})
print("threads", os.environ["RANK"], names, flush=True)
assert not any(n.startswith(("gloo", "pt_gloo")) for n in names), names
"""


def test_no_thread_of_the_group_outlives_finish(tmp_path):
    pytest.importorskip("deepspeed", reason="the DeepSpeed half needs: pip install 'grpokit[deepspeed]'")
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.count("threads") == 2, result.stdout
