"""`rollout.engine=server`: generation by one or more `grpokit serve` processes over HTTP
(server.py), with the trainer's weights pushed to each over a torch.distributed group (weights.py)
before each generation that follows an optimizer update.

- Several servers (`rollout.server_url` a list): a generation's prompts are split among them by
  whole prompt groups, balanced by expected tokens (`split_generation`), the requests go out
  concurrently (one thread per server, each pushing its own weights first), and the answers are
  put back in the prompts' order. Every completion samples from its own seed, so how the prompts
  are split never changes what is sampled.
- Every push is verified: the server answers the checksum of what it now generates with, and it
  must equal the checksum of the trainer's parameters.
- A LoRA policy pushes its adapters alone (megabytes, not the model) to servers that take them
  (`/health`'s `adapters`: the transformers engine), which put the same adapters on their own copy
  of the base; to others, the merged weights (a quantized base cannot be merged into: refused).
- Waiting is bounded. A request gets no answer for `rollout.server_timeout` seconds: an error. The
  server cannot be reached (refused, reset, down): retries with backoff (0.5 s doubling to 8 s)
  for `rollout.server_timeout` seconds in all, then an error naming the URL.
- A server that restarted (a new `boot_id`) or holds other weights answers "stale weights"; the
  client then joins a new weight group, pushes the weights again, and repeats the request. A
  server another trainer has joined since answers that (one server, one trainer).
- A server that fails for good (any of the errors above) is left out for the rest of the run: its
  share moves to the others and the console says so. When the last one fails, the run stops
  with that server's error.
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from urllib.parse import urlparse

import torch
from tqdm.auto import tqdm

from grpokit.engines.balance import join_generation, split_generation
from grpokit.engines.batch import RolloutBatch, SamplingParams, group_counts
from grpokit.engines.weights import (WeightGroup, adapter_tensors, backend_between, base_weights, checksum, device_id,
                                     fingerprint, fingerprint_differences, is_lora, layout, named_weights)
from grpokit.engines.wire import BASE_DIFFERS, STALE_WEIGHTS, TAKEN_OVER
from grpokit.engines.wire import to_png
from grpokit.models.loading import adapter_settings, is_quantized
from grpokit.runtime.errors import RunStopped, StartupError
from grpokit.settings.schema import RolloutConfig


class RolloutServerError(RunStopped, RuntimeError):
    """The rollout server cannot be used: down past the timeout, refusing, or out of sync."""


class RolloutServer:
    """One rollout server: its HTTP requests, and the trainer's weights pushed to it."""

    def __init__(self, url: str, model: torch.nn.Module, timeout_s: float, expected_checksum=checksum):
        """expected_checksum(weights): the checksum a push of `weights` must be answered with."""
        self.url = url.rstrip("/")
        self.model, self.timeout_s, self.expected_checksum = model, timeout_s, expected_checksum
        self.fingerprint = fingerprint(model)
        self.device = next(model.parameters()).device
        self.group: WeightGroup | None = None
        self.boot_id: str | None = None  # the server run our weights were pushed to
        self.session: str | None = None  # our weight group session on that server
        self.version = 0  # pushes in this session
        self.dirty = True  # the policy changed since the last push (or nothing was pushed yet)
        self.gathered = None  # weights to push instead of the model's own (ServerEngine.use_weights)
        self.weights_step: int | None = None  # the trainer step those weights are from, when known
        self.adapters: dict | None = None  # a LoRA policy's adapter settings, when its adapters alone are pushed
        self.base: str | None = None  # then the checksum of the base they are trained on
        self.pushed = (0, 0)  # (bytes, pushes) since the start
        # No proxies: a rollout server is reached directly (http_proxy must not catch 127.0.0.1).
        self.http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        health = self._check_server()
        # The trainer's own sampling code on the same kind of device: log-probs need no correction.
        self.exact_logprobs = health["engine"] == "transformers" and health["device"].split(":")[0] == self.device.type
        self.measures_entropies = health["engine"] == "transformers"
        self.takes_adapters = bool(health.get("adapters"))
        self.base_checksum = health.get("base_checksum")  # of the base it puts adapters on
        self.in_flight = bool(health.get("in_flight"))  # it takes pushes during a generation (engines/in_flight.py)
        self.pushing = threading.Lock()  # one push at a time, and none while a request reads the version
        self.push_error: RolloutServerError | None = None  # a push in flight the server got wrong

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
        if self.gathered is not None:
            weights = self.gathered
        else:
            weights = adapter_tensors(self.model) if self.adapters is not None else named_weights(self.model)
        try:
            answer, _ = self._while_requesting(
                "/weights/update", {"fingerprint": self.fingerprint, "session": self.session,
                                    "weights_version": self.version, "weights_step": self.weights_step,
                                    "tensors": layout(weights), "adapters": self.adapters, "base_checksum": self.base},
                lambda: self.group.send(weights))
        except (RolloutServerError, RuntimeError, _Stale) as e:  # the server died mid-transfer, or refused it
            self.close()
            raise _PushFailed(f"pushing the weights failed: {e or 'stale'}") from None
        mine = self.expected_checksum(weights)
        if answer["checksum"] != mine:
            raise RolloutServerError(
                f"after weight push {self.version} the rollout server at {self.url} reports checksum "
                f"{answer['checksum']}, the trainer's weights have {mine}: it would not generate with the "
                "trainer's policy")
        self.dirty = False  # (gathered weights are kept: a restarted server is sent them again)
        # (one tuple, assigned at once: a step reads it from another thread when generating ahead)
        self.pushed = (self.pushed[0] + sum(t.numel() * t.element_size() for _, t in weights), self.pushed[1] + 1)

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

    def with_weights(self, path: str, body: dict) -> dict:
        """POST `path` `body` (a generation) expecting the trainer's weights, pushing them first
        when due, and again when the server holds others."""
        failures = []
        while len(failures) < 3:  # each wait inside is bounded by timeout_s
            try:
                with self.pushing:  # (not held while the request runs: an in-flight push goes meanwhile)
                    if self.dirty:
                        self._push()
                    expected = {"session": self.session, "weights_version": self.version}
                return self._request(path, {"fingerprint": self.fingerprint, **body, **expected})
            except _Stale:  # restarted, or a push it did not finish: push again and repeat
                failures.append(STALE_WEIGHTS)
                self.dirty = True
            except _PushFailed as e:
                failures.append(str(e))
                self.dirty = True
        raise RolloutServerError(f"the rollout server at {self.url} could not be given the trainer's weights, 3 tries: "
                                 + "; ".join(failures))

    def push_now(self) -> None:
        """Push the weights `gathered` now, into a generation in flight. One that does not reach the
        server is made again before the next request (dirty still: with_weights, with its retries);
        one the server got wrong (its checksum) fails the request in flight too (`completions`)."""
        with self.pushing:
            if not self.dirty:
                return
            try:
                self._push()
            except (_PushFailed, _Stale):
                pass
            except RolloutServerError as e:
                self.push_error = e
                raise

    def completions(self, body: dict) -> tuple[list[dict], int | None]:
        """POST /generate `body` (prompts, counts, sampling, seeds) with the trainer's weights:
        each completion's dict, in order, and the trainer step of the weights they were sampled
        with (None: not labelled; in flight, those it began with)."""
        answer = self.with_weights("/generate", body)
        if self.push_error is not None:  # a push in flight failed: what followed it was sampled by unverified weights
            raise self.push_error
        if len(answer["completions"]) != sum(body["n"]):
            raise RolloutServerError(f"the rollout server at {self.url} was asked for {sum(body['n'])} completions "
                                     f"and answered {len(answer['completions'])}")
        return answer["completions"], answer.get("weights_step")

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class ServerEngine:
    """The rollout engine over one or more rollout servers (`rollout.server_url`): a RolloutEngine,
    and the PipelineEngine that generates ahead of training (rollout.max_staleness)."""

    remote = True  # the trainer gathers a step's prompts on process 0 and shares the completions
    exact_logprobs: bool  # every server runs the trainer's own sampling code on the same kind of device
    measures_entropies: bool  # every server's engine measures them (vLLM's does not)
    weights_step: int | None  # the trainer step of the weights the last generation used (PipelineEngine)

    @classmethod
    def from_config(cls, rollout: RolloutConfig, model, tokenizer, eos_ids, model_name, lockstep, vision=None) -> ServerEngine:
        made = cls(rollout.server_url, model, tokenizer.pad_token_id, rollout.server_timeout)
        if rollout.in_flight_updates:
            if cannot := [s.url for s in made.servers if not s.in_flight]:
                raise StartupError(f"rollout.in_flight_updates: the rollout server(s) at {', '.join(cannot)} take no "
                                   "weight push during a generation (vLLM's, or an older grpokit serve); serve with "
                                   "--engine transformers, or turn rollout.in_flight_updates off")
            made.in_flight = True
        return made

    def __init__(self, urls: str | list[str], model: torch.nn.Module, pad_id: int, timeout_s: float):
        urls = [urls] if isinstance(urls, str) else list(urls)
        # The weights' checksum, computed once for every server a version is pushed to: (version, checksum).
        self.pushed_version, self.summed, self.summing = 0, None, threading.Lock()
        self.servers = [RolloutServer(url, model, timeout_s, self._checksum) for url in urls]  # each checked at once
        self.pad_id = pad_id
        self.down: list[RolloutServer] = []  # failed for good: left out for the rest of the run
        self.last_error: RolloutServerError | None = None  # why the last of them was left out
        self.exact_logprobs = all(s.exact_logprobs for s in self.servers)
        self.measures_entropies = all(s.measures_entropies for s in self.servers)
        self.weights_step: int | None = None  # the trainer step of the weights the last generation used (began with)
        self.in_flight = False  # generations take pushes in flight (`push`), each token tagged (rollout.in_flight_updates)
        self.agents: list[tuple[RolloutServer, int, list[int]]] = []  # an agents' generation: (server, its id, rollouts)
        # A LoRA policy pushes its adapters alone when every server takes them (each holds the base);
        # else the merged weights, which a quantized base cannot give.
        self.adapter_only = is_lora(model) and all(s.takes_adapters for s in self.servers)
        if is_quantized(model) and not self.adapter_only:
            whole = [s.url for s in self.servers if not s.takes_adapters]
            raise StartupError(f"model.quantization with rollout servers that take whole weights only ({', '.join(whole)}"
                               "): a quantized base's adapters cannot be merged into it; serve it with `grpokit serve "
                               "--engine transformers --quantization <model.quantization>`")
        if self.adapter_only:  # (the policy is whole here, before any sharding: training/trainer.py)
            base = checksum(base_weights(model))
            if differ := [s.url for s in self.servers if s.base_checksum != base]:
                raise StartupError(f"the rollout server(s) at {', '.join(differ)}: {BASE_DIFFERS}")
            for server in self.servers:
                server.adapters, server.base = adapter_settings(model), base

    @property
    def up(self) -> list[RolloutServer]:
        return [s for s in self.servers if s not in self.down]

    # ---------------------------------------------------------------- weights

    def weights_updated(self) -> None:
        """The trainer changed the policy: push before the next generation."""
        self.pushed_version += 1
        for server in self.servers:
            server.dirty = True

    def needs_weights(self) -> bool:
        """A push is due: a sharded trainer gathers the whole weights for it (`use_weights`)."""
        return any(s.dirty for s in self.up)

    def use_weights(self, weights: list[tuple[str, torch.Tensor]], step: int | None = None) -> None:
        """Push these (a sharded policy's gathered weights, or a copy taken after step `step`)
        rather than the model's own tensors, from the next generation on."""
        self.pushed_version += 1
        for server in self.servers:
            server.gathered, server.weights_step = weights, step
            server.dirty = True

    def push(self, weights: list[tuple[str, torch.Tensor]], step: int) -> None:
        """Push these (a copy taken after step `step`) to every server now, into the generations in
        flight (rollout.in_flight_updates)."""
        up = self.up
        with ExitStack() as held:  # no server pushes older weights under the new version's checksum meanwhile
            for server in up:
                held.enter_context(server.pushing)
            self.pushed_version += 1
            for server in up:
                server.gathered, server.weights_step, server.dirty = weights, step, True
        _concurrently(lambda server, _: server.push_now(), {server: None for server in up})

    @property
    def pushed(self) -> tuple[int, int]:
        """(bytes, pushes) sent to the servers since the start."""
        each = [s.pushed for s in self.servers]
        return sum(b for b, _ in each), sum(n for _, n in each)

    def _checksum(self, weights: list[tuple[str, torch.Tensor]]) -> str:
        """The checksum of the weights pushed now (those of `pushed_version`), computed by the
        first server's thread to push them and reused by the others."""
        with self.summing:
            if self.summed is None or self.summed[0] != self.pushed_version:
                self.summed = (self.pushed_version, checksum(weights))
            return self.summed[1]

    def sleep(self) -> None:
        pass  # the servers' memory is their own: the trainer's update does not compete for it

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], n: int | Sequence[int], params: SamplingParams,
                 seeds: Sequence[int] | None = None, images: list[tuple] | None = None) -> RolloutBatch:
        counts = group_counts(prompts, n)
        pngs = None if images is None else [[to_png(i) for i in row] for row in images]  # each prompt's, once
        sampling = _sampling(params)
        answered: list[tuple[list[int], list[dict]]] = []  # (prompt indices, their completions)
        steps = set()
        todo = list(range(len(prompts)))
        while todo:
            up = self.up
            if not up:  # (a generation after the last one failed)
                raise RolloutServerError(f"every rollout server is down: {self.last_error}")
            shares = split_generation(prompts, counts, seeds, params.max_tokens, len(up), among=todo)
            jobs = {server: share for server, share in zip(up, shares) if share[0]}

            def ask(server: RolloutServer, share):
                group, share_prompts, share_counts, share_seeds = share
                request = {"prompts": share_prompts, "n": share_counts, "sampling": sampling, "seeds": share_seeds,
                           **({"in_flight": True} if self.in_flight else {})}
                if pngs is not None:
                    request["images"] = [pngs[i] for i in group]
                return server.completions(request)

            results = _concurrently(ask, jobs)
            todo = []
            for server, (group, *_) in jobs.items():
                result = results[server]
                if isinstance(result, BaseException):
                    self._leave_out(server, result)
                    todo += group
                    continue
                completions, step = result
                steps.add(step)
                answered.append((group, completions))
            todo.sort()
        if len(steps) > 1 and not self.in_flight:  # (in flight, a push may reach one server's generation first)
            raise RolloutServerError(f"the rollout servers sampled one generation with the weights of different "
                                     f"steps {sorted(steps, key=str)}: their weights are out of step")
        self.weights_step = min(steps, key=lambda s: -1 if s is None else s) if steps else None
        return join_generation(prompts, counts, answered, self.pad_id, images)

    # ---------------------------------------------------------------- agents (rollouts/agents.py)

    def open_agents(self, counts: list[int], params: SamplingParams, seeds: Sequence[int] | None,
                    chat_template: str | None, reading: tuple[str, str] = ("auto", "auto")) -> list[str]:
        """An agents' generation on the servers' OpenAI routes (server.py): counts[i] rollouts of
        prompt i, whole groups split among the servers in order. Each rollout's base URL."""
        up = self.up
        if not up:
            raise RolloutServerError(f"every rollout server is down: {self.last_error}")
        sampling = _sampling(params)
        starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
        shares = [range(starts[len(counts) * k // len(up)], starts[len(counts) * (k + 1) // len(up)])
                  for k in range(len(up))]
        jobs = {server: list(share) for server, share in zip(up, shares) if len(share)}

        def open_on(server: RolloutServer, rollouts: list[int]) -> dict:
            return server.with_weights("/agents/open", {
                "rollouts": len(rollouts), "sampling": sampling, "chat_template": chat_template,
                "tool_call_format": reading[0], "reasoning_parser": reading[1],
                "seeds": None if seeds is None else [int(seeds[r]) for r in rollouts]})

        answers = _concurrently(open_on, jobs)
        for answer in answers.values():
            if isinstance(answer, BaseException):  # no moving an agents' generation to another server
                raise answer
        if len({a["weights_step"] for a in answers.values()}) > 1:
            raise RolloutServerError("the rollout servers opened one agents' generation with the weights of different "
                                     "steps: their weights are out of step")
        self.weights_step = next(iter(answers.values()))["weights_step"]
        self.agents = [(server, answers[server]["generation"], rollouts) for server, rollouts in jobs.items()]
        return [f"{server.url}/r/{generation}-{local}/v1" for server, generation, rollouts in self.agents
                for local in range(len(rollouts))]

    def agents_finished(self, rollouts: list[int]) -> None:
        """These rollouts' agents have returned: the servers' rounds stop waiting for them."""
        for server, generation, owned in self.agents:
            mine = [local for local, r in enumerate(owned) if r in rollouts]
            if mine:
                server._request("/agents/finished", {"generation": generation, "rollouts": mine}, retry=False)

    def close_agents(self) -> list[dict]:
        """What each rollout's agent sent and got (transcript.Transcript.record), in rollout order."""
        return [t for server, generation, _ in self.agents
                for t in server._request("/agents/close", {"generation": generation}, retry=False)["transcripts"]]

    def _leave_out(self, server: RolloutServer, error: BaseException) -> None:
        """`server` failed for good: its share moves to the others, or, if it was the last, the run stops."""
        if not isinstance(error, RolloutServerError):
            raise error
        server.close()
        self.down.append(server)
        self.last_error = error
        if not self.up:
            if len(self.servers) > 1:
                raise RolloutServerError(f"{error} (all {len(self.servers)} rollout servers are down)") from None
            raise error
        tqdm.write(f"grpokit: {error}\ngrpokit: leaving the rollout server at {server.url} out for the rest of the "
                   f"run: its share moves to the other {len(self.up)} server(s)", file=sys.stderr)

    def close(self) -> None:
        for server in self.servers:
            server.close()


def _sampling(params: SamplingParams) -> dict:
    """server.Sampling's fields; top_logprobs only when asked, so a server from before it takes the rest."""
    return {k: v for k, v in asdict(params).items() if not (k == "top_logprobs" and v == 0)}


def _concurrently(fn, jobs: dict) -> dict:
    """fn(key, value) for every item of `jobs`, one thread each (the caller's thread alone for a
    single one); key -> its result, or the exception it raised."""
    def run(key, value):
        try:
            return fn(key, value)
        except Exception as e:  # noqa: BLE001 - returned to the caller, who decides
            return e

    if len(jobs) == 1:
        (key, value), = jobs.items()
        return {key: run(key, value)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(run, key, value) for key, value in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


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
