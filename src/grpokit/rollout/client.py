"""`rollout.engine=server`: generation by a `grpokit serve` process, over HTTP, with the trainer's
weights pushed over a torch.distributed group (weights.py) before each generation that follows an
optimizer update.

- Every push is verified: the server answers the checksum of what it now generates with, and it
  must equal the checksum of the trainer's parameters.
- Waiting is bounded. A request gets no answer for `rollout.server_timeout` seconds: an error. The
  server cannot be reached (refused, reset, down): retries with backoff (0.5 s doubling to 8 s)
  for `rollout.server_timeout` seconds in all, then an error naming the URL.
- A server that restarted (a new `boot_id`) or holds other weights answers "stale weights"; the
  client then joins a new weight group, pushes the weights again, and repeats the request. A
  server another trainer has joined since answers that, and the run stops (one server, one trainer).
- Only the trainer's process 0 makes an engine; the trainer hands the other processes their rows.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import urlparse

import torch
from tqdm.auto import tqdm

from grpokit.errors import StartupError
from grpokit.rollout import STALE_WEIGHTS, TAKEN_OVER, RolloutBatch, SamplingParams, from_completions
from grpokit.rollout.weights import (WeightGroup, backend_between, checksum, device_id, fingerprint,
                                    fingerprint_differences, layout, named_weights)


class RolloutServerError(RuntimeError):
    """The rollout server cannot be used: down past the timeout, refusing, or out of sync."""


class ServerEngine:
    remote = True  # the trainer gathers a step's prompts on process 0 and shares the completions
    exact_logprobs: bool  # from the server's /health: the trainer's own sampling code on the same kind of device

    @classmethod
    def from_config(cls, rollout, model, tokenizer, eos_ids, model_name, lockstep) -> ServerEngine:
        return cls(rollout.server_url, model, tokenizer.pad_token_id, rollout.server_timeout)

    def __init__(self, url: str, model: torch.nn.Module, pad_id: int, timeout_s: float):
        self.url = url.rstrip("/")
        self.model, self.pad_id, self.timeout_s = model, pad_id, timeout_s
        self.fingerprint = fingerprint(model)
        self.device = next(model.parameters()).device
        self.group: WeightGroup | None = None
        self.boot_id: str | None = None  # the server run our weights were pushed to
        self.session: str | None = None  # our weight group session on that server
        self.version = 0  # pushes in this session
        self.dirty = True  # the policy changed since the last push (or nothing was pushed yet)
        self.gathered = None  # a sharded policy's whole weights, gathered by the trainer (sharding.py)
        # No proxies: a rollout server is reached directly (http_proxy must not catch 127.0.0.1).
        self.http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        health = self._check_server()
        # The trainer's own sampling code on the same kind of device: log-probs need no correction.
        self.exact_logprobs = health["engine"] == "transformers" and health["device"].split(":")[0] == self.device.type

    # ---------------------------------------------------------------- HTTP with retries

    def _request(self, path: str, body: dict | None = None, retry: bool = True) -> dict:
        """One JSON request; connection failures are retried for `timeout_s` in all (`retry`). An
        HTTP error status raises RolloutServerError with the server's reason (409 stale weights:
        `_Stale`)."""
        deadline, delay, last = time.monotonic() + (self.timeout_s if retry else 0), 0.5, None
        data = None if body is None else json.dumps(body).encode()
        while True:
            request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with self.http.open(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                try:
                    detail = json.loads(e.read()).get("detail", "")
                except (ValueError, AttributeError):
                    detail = e.reason
                if e.code == 409 and detail == STALE_WEIGHTS:
                    raise _Stale() from None
                if e.code == 503 and time.monotonic() < deadline:  # busy or half-restarted: try again
                    last = f"HTTP 503: {detail}"
                else:
                    raise RolloutServerError(f"the rollout server at {self.url} refused {path} (HTTP {e.code}): {detail}") from None
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, socket.timeout, TimeoutError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    raise RolloutServerError(
                        f"the rollout server at {self.url} did not answer {path} within rollout.server_timeout="
                        f"{self.timeout_s:g} s") from None
                last = str(reason)
            if not retry:
                raise RolloutServerError(f"the rollout server at {self.url} failed {path}: {last}")
            if time.monotonic() + delay > deadline:
                raise RolloutServerError(
                    f"the rollout server at {self.url} cannot be reached ({last}); tried for rollout.server_timeout="
                    f"{self.timeout_s:g} s. Start one with: grpokit serve --model <model.name> --port "
                    f"{urlparse(self.url).port or 80}")
            time.sleep(delay)
            delay = min(2 * delay, 8.0)

    def _check_server(self) -> str:
        try:
            health = self._request("/health")
        except RolloutServerError as e:
            raise StartupError(str(e)) from None
        if differences := fingerprint_differences(health["fingerprint"], self.fingerprint):
            raise StartupError(
                f"the rollout server at {self.url} serves {health['model']}, which does not match model.name "
                "(serve the same model and dtype):\n  " + "\n  ".join(d.replace("in the request", "in the trainer")
                                                                       for d in differences))
        return health

    # ---------------------------------------------------------------- weights

    def weights_updated(self) -> None:
        """The trainer changed the policy: push before the next generation."""
        self.dirty = True

    def needs_weights(self) -> bool:
        """A push is due: a sharded trainer gathers the whole weights for it (`use_weights`)."""
        return self.dirty

    def use_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Push these (a sharded policy's gathered weights) rather than the model's own tensors."""
        self.gathered = weights

    def sleep(self) -> None:
        pass  # the server's memory is its own: the trainer's update does not compete for it

    def _push(self) -> None:
        """Join a weight group if the server holds none of ours, send every tensor, and check the
        server's checksum. Raises _PushFailed when the server went away meanwhile (the caller
        tries again), RolloutServerError when another trainer took the server over."""
        health = self._request("/health")  # waits (bounded) for a server that is down
        if self.group is None or health["boot_id"] != self.boot_id or health["session"] is None:
            if self.boot_id is not None:
                tqdm.write(f"grpokit: the rollout server at {self.url} restarted (or lost its weight group): "
                           "joining a new group and pushing the weights again", file=sys.stderr)
            try:
                self._join_group(health["device"])
            except (RolloutServerError, RuntimeError) as e:
                raise _PushFailed(f"joining the weight group failed: {e}") from None
            self.boot_id = health["boot_id"]
        elif health["session"] != self.session:
            raise RolloutServerError(f"the rollout server at {self.url}: {TAKEN_OVER}")
        self.version += 1
        weights = self.gathered if self.gathered is not None else named_weights(self.model)
        try:
            answer, _ = self._while_requesting(
                "/weights/update", {"fingerprint": self.fingerprint, "session": self.session,
                                    "weights_version": self.version, "tensors": layout(weights)},
                lambda: self.group.send(weights))
        except (RolloutServerError, RuntimeError, _Stale) as e:  # the server died mid-transfer, or refused it
            self.close()
            raise _PushFailed(f"pushing the weights failed: {e or 'stale'}") from None
        mine = checksum(weights)
        if answer["checksum"] != mine:
            raise RolloutServerError(
                f"after weight push {self.version} the rollout server at {self.url} reports checksum "
                f"{answer['checksum']}, the trainer's weights have {mine}: it would not generate with the "
                "trainer's policy")
        self.dirty = False  # (gathered weights are kept: a restarted server is sent them again)

    def _join_group(self, server_device: str) -> None:
        self.close()
        host = _address_towards(urlparse(self.url).hostname or "127.0.0.1")
        backend = backend_between(device_id() if self.device.type == "cuda" else "cpu", server_device)
        group = WeightGroup(host, 0, backend, self.timeout_s)  # hosts the store on a port the OS picks
        answer, self.group = self._while_requesting(
            "/weights/group", {"fingerprint": self.fingerprint, "host": host, "port": group.port,
                               "backend": backend, "timeout_s": self.timeout_s}, group.connect)
        self.session, self.version = answer["session"], 0

    def _while_requesting(self, path: str, body: dict, action):
        """POST `path` while `action` (this side of a collective) runs in a thread; (the answer,
        what `action` returned). A POST that fails returns at once: the collective is abandoned
        (the caller drops the group, which aborts it)."""
        done: dict = {}

        def run():
            try:
                done["ok"] = action()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        answer = self._request(path, body, retry=False)  # the caller retries the whole push
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise RolloutServerError(f"the rollout server answered {path} but the transfer did not end within "
                                     f"rollout.server_timeout={self.timeout_s:g} s")
        if "error" in done:
            raise done["error"]
        return answer, done["ok"]

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], n: int | Sequence[int], params: SamplingParams,
                 seeds: Sequence[int] | None = None) -> RolloutBatch:
        counts = [n] * len(prompts) if isinstance(n, int) else [int(k) for k in n]
        body = {"fingerprint": self.fingerprint, "prompts": prompts, "n": counts,
                "sampling": {"max_tokens": params.max_tokens, "temperature": params.temperature,
                             "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p},
                "seeds": None if seeds is None else [int(s) for s in seeds]}
        failures = []
        while len(failures) < 3:  # each wait inside is bounded by timeout_s
            try:
                if self.dirty:
                    self._push()
                answer = self._request("/generate", {**body, "session": self.session, "weights_version": self.version})
            except _Stale:  # restarted, or a push it did not finish: push again and repeat
                failures.append(STALE_WEIGHTS)
                self.dirty = True
                continue
            except _PushFailed as e:
                failures.append(str(e))
                self.dirty = True
                continue
            if len(answer["completions"]) != sum(counts):
                raise RolloutServerError(f"the rollout server at {self.url} was asked for {sum(counts)} completions "
                                         f"and answered {len(answer['completions'])}")
            return from_completions(prompts, counts, answer["completions"], self.pad_id)
        raise RolloutServerError(f"the rollout server at {self.url} could not be given the trainer's weights, 3 tries: "
                                 + "; ".join(failures))

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class _Stale(Exception):
    pass


class _PushFailed(Exception):
    pass


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (where the server can reach our TCPStore)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]
