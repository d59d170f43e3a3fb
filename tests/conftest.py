import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): one core for each worker
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and for the processes the tests start

from helpers import Server  # noqa: E402 - after the thread count is set


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random policy and the real SmolLM2 tokenizer (converted once, then cached)."""
    from grpokit.models import load_model, load_tokenizer

    return load_model("tiny-random"), load_tokenizer("tiny-random")


@pytest.fixture
def server():
    """`grpokit serve` processes: server(*args) starts one and gives its helpers.Server; each is
    stopped after the test. (Mark a test that takes this fixture `process`.)"""
    servers = []

    def make(*args):
        servers.append(Server(*args))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()
