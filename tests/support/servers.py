"""`grpokit serve` in a process of its own (forked: support/processes.py), and the tiny run the
server tests train."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from support.processes import free_port, grpokit


# The tiny run of the rollout server tests (test_server.py, test_pipeline.py).
SERVER_RUN = ["--no-progress", "model.name=tiny-random", "reward.functions=[length]", "train.prompts_per_step=2",
              "rollout.num_generations=4", "data.eval_size=4", "train.eval_every=2"]


def get_health(url: str) -> dict:
    """A rollout server's /health answer."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


class Server:
    """`grpokit serve` in its own process: `kill()` kills it (SIGKILL), `start()` starts it again on
    the same port. Tests take one from the `server` fixture (conftest.py), which stops it afterwards."""

    def __init__(self, *args: str):
        self.args, self.port = args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self):
        self.process = grpokit("serve", "--model", "tiny-random", "--port", str(self.port), *self.args)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                return get_health(self.url)
            except (urllib.error.URLError, ConnectionError):
                assert self.process.poll() is None, self.process.stdout + self.process.stderr
                time.sleep(0.1)
        raise AssertionError("the server did not start in 120 s")

    def kill(self):
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self):
        if self.process.poll() is None:
            self.kill()
