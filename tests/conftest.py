import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): one core for each worker
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and for the processes the tests start

from support.servers import Server  # noqa: E402 - after the thread count is set


def pytest_collection_modifyitems(config, items):
    """Each pytest-xdist worker's share of the tests, dealt a module at a time (a module's shared
    runs, its module-scoped fixtures, are then made once, not on each worker). The tests that start
    other processes come first (the longest, from seconds to a minute or two), the module with the
    most such tests to the worker with the fewest; then the in-process tests, a module to the
    worker that has its other tests if it has room, else to the one with the most room, so that the
    shares are of equal length: xdist gives each worker an equal run of the collection. With
    `--dist worksteal` (make test) each worker starts on its own share, long tests first, and a
    worker that runs out takes short tests from the end of another's: a run ends on a tail of short
    tests, not with one worker idle while the other runs a long one."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)

    def by_module(process: bool) -> list[tuple[str, list]]:
        modules: dict[str, list] = {}
        for item in items:
            if (item.get_closest_marker("process") is not None) == process:
                modules.setdefault(item.module.__name__, []).append(item)
        return sorted(modules.items(), key=lambda m: len(m[1]), reverse=True)

    long: list[list] = [[] for _ in range(workers)]
    home: dict[str, int] = {}
    for module, tests in by_module(process=True):
        home[module] = min(range(workers), key=lambda w: len(long[w]))
        long[home[module]].extend(tests)
    # The last workers' runs are one longer where the collection does not divide.
    n = len(items)
    room = [n // workers + (w >= workers - n % workers) - len(long[w]) for w in range(workers)]
    short: list[list] = [[] for _ in range(workers)]
    for module, tests in sorted(by_module(process=False), key=lambda m: m[0] not in home):  # those with a home first
        while tests:
            w = home.get(module, -1)
            if w < 0 or room[w] <= 0:
                w = max(range(workers), key=room.__getitem__)
            taken = tests[: room[w]]
            short[w].extend(taken)
            tests, room[w] = tests[len(taken):], room[w] - len(taken)
    items[:] = [item for w in range(workers) for item in (*long[w], *short[w])]


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
