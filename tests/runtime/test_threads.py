"""The processes of a run on one machine share its cores (runtime/threads.py)."""

import torch

from grpokit.runtime import threads


def test_a_process_takes_its_share_of_the_cores_unless_told(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "cores", lambda: 8)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert threads.share_cores(1) is None and torch.get_num_threads() == before  # alone: every core
        assert threads.share_cores(3) == 2 and torch.get_num_threads() == 2
        assert threads.share_cores(16) == 1
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's word wins
        assert threads.share_cores(4) is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_trainer_counts_the_processes_beside_it(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.trainer_processes([]) == 1
    assert threads.trainer_processes(["http://127.0.0.1:8000", "http://localhost:8001", "http://10.0.0.7:8000"]) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's: two training processes on this node
    assert threads.trainer_processes(["http://127.0.0.1:8000"]) == 3
