import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): one core for each worker
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and for the processes the tests start

from support.servers import Server  # noqa: E402 - after the thread count is set


def pytest_collection_modifyitems(config, items):
    """The tests that start other processes first (the longest, from seconds to a minute or two),
    dealt out to the pytest-xdist workers a module at a time (a module's shared runs, its
    module-scoped fixtures, are then made once, not on each worker), the module with the most
    such tests to the worker with the fewest; each worker's in-process tests after them, dealt
    out in turn until its share is as long as the others'. With `--dist worksteal` (make test)
    each worker starts on its own share, long tests first, and a worker that runs out takes short
    tests from the end of another's. So a run ends on a tail of short tests, not with one worker
    idle while the other runs a long one."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    modules: dict[str, list] = {}
    for item in items:
        if item.get_closest_marker("process") is not None:
            modules.setdefault(item.module.__name__, []).append(item)
    long: list[list] = [[] for _ in range(workers)]
    for tests in sorted(modules.values(), key=len, reverse=True):
        min(long, key=len).extend(tests)
    # xdist gives each worker an equal run of the collection (the last ones one more where it does not
    # divide): each worker's share, long and short, is that run.
    n = len(items)
    quota = [n // workers + (w >= workers - n % workers) - len(long[w]) for w in range(workers)]
    short: list[list] = [[] for _ in range(workers)]
    w = 0
    for item in items:
        if item.get_closest_marker("process") is None:
            while len(short[w]) >= quota[w]:
                w = (w + 1) % workers
            short[w].append(item)
            w = (w + 1) % workers
    items[:] = [item for w in range(workers) for item in (*long[w], *short[w])]


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random policy and the real SmolLM2 tokenizer (converted once, then cached)."""
    from grpokit.models.loading import load_model, load_tokenizer

    return load_model("tiny-random"), load_tokenizer("tiny-random")


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished 2-step run of tiny-random trained with data.eval_size=0, which the bad-input tests
    of several layers point commands at (read only); made once a worker."""
    from support.bad_input import T

    from grpokit.cli import main

    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--no-progress", *T, f"train.output_dir={out}"]) == 0
    return out


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
