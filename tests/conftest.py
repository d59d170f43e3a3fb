import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): one core for each worker
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and for the processes the tests start

from support.servers import Server  # noqa: E402 - after the thread count is set


def pytest_collection_modifyitems(config, items):
    """The tests that start other processes first (the longest, from seconds to a minute or two),
    dealt out in turn to the pytest-xdist workers, each worker's in-process tests after them: with
    `--dist worksteal` (make test) each worker starts on its own share, long tests first, and a
    worker that runs out takes short tests from the end of another's. So a run ends on a tail of
    short tests, not with one worker idle while the other runs a long one."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    long = [item for item in items if item.get_closest_marker("process") is not None]
    short = [item for item in items if item.get_closest_marker("process") is None]
    items[:] = [item for w in range(workers) for item in (*long[w::workers], *short[w::workers])]


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random policy and the real SmolLM2 tokenizer (converted once, then cached)."""
    from grpokit.models.loading import load_model, load_tokenizer

    return load_model("tiny-random"), load_tokenizer("tiny-random")


@pytest.fixture
def server():
    """`grpokit serve` processes: server(*args) starts one and gives its support.servers.Server; each
    is stopped after the test. (Mark a test that takes this fixture `process`.)"""
    servers = []

    def make(*args):
        servers.append(Server(*args))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()
