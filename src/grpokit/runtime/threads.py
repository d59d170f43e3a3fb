"""CPU threads: the processes of a run on one machine share its cores instead of each taking all.

torch's CPU operations run on as many threads as the machine has cores. Several processes doing so
on one machine (a launch of several processes on one node, a rollout server beside its trainer)
ask for more threads than there are cores, and OpenMP threads spin-wait for cores that another
process holds: a step can take several times longer than on fewer threads. So each process of a
run takes its share, cores // processes on this machine (at least 1), unless OMP_NUM_THREADS says
otherwise (the user's word wins; torchrun sets it to 1 for several processes). The count is fixed by
the launch and the config, never by the load of the moment: a resumed run computes with the threads
it started with (a matrix product's rounding can follow the thread count).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

import torch

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_cores(processes: int) -> int | None:
    """Give this process its share of the cores among `processes` on this machine; the threads it
    now has, or None where OMP_NUM_THREADS was set (or it has the machine to itself)."""
    if os.environ.get("OMP_NUM_THREADS") or processes <= 1:
        return None
    threads = max(1, cores() // processes)
    torch.set_num_threads(threads)
    return threads


def trainer_processes(server_urls: list[str]) -> int:
    """A training process's neighbours on this machine, itself included: the launch's processes on
    this node (torchrun's LOCAL_WORLD_SIZE) and each rollout server at a local address."""
    local = sum(urlparse(url).hostname in LOCAL_HOSTS for url in server_urls)
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) + local
