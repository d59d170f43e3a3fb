"""`grpokit serve`: a rollout server. A trainer with `rollout.engine=server` sends it prompts and
pushes it weights; it generates with any engine (transformers, or vLLM on a GPU).

HTTP (FastAPI) carries control; tensors go over a torch.distributed group (weights.py).

- `GET /health`: engine, model, device, fingerprint, `boot_id` (new at every start: a trainer sees
  a restart), `session` (the trainer whose weights it holds), `weights_version` (the version that
  trainer last pushed; 0 = as loaded), `weights_step` (the trainer step those weights are from,
  when the trainer labels its pushes; null otherwise) and the weights' checksum.
- `POST /generate`: prompts as token ids, a completion count per prompt, sampling parameters, one
  seed per completion, the trainer's fingerprint and the `session` / `weights_version` it expects;
  for a vision-language model, each prompt's images (PNG files, base64: lossless, so the server
  sees the trainer's pixels).
  Returns each completion's token ids, sampling log-probs, entropies (or null when the engine does
  not measure them) and finish reason, and the `weights_version` and `weights_step` sampled with.
  With `in_flight`, weight pushes land during the generation, between two decode steps
  (engines/in_flight.py): it begins with the weights expected or newer ones of the same trainer,
  and each completion says the `weights_steps` of its tokens (`/health`'s `in_flight`: the
  transformers engine, text models). Answers 409 when the fingerprint differs (the body lists
  what differs), when the weights are not the expected ones (`"stale weights"`: the trainer
  pushes them again), or when another trainer has joined since (one server serves one trainer);
  422 for a malformed request.
- `POST /weights/group`: join the trainer's weight group (its TCPStore at host:port) and start a
  session; a server restarted or taken over by another trainer knows the old session no more.
- `POST /weights/update`: receive every tensor over the group, load them, and answer the new
  version and checksum. Generation waits while weights change. A LoRA trainer sends its adapters
  alone, with their settings (`adapters`): the transformers engine puts the same adapters on its
  own base (quantized or not, as `grpokit serve --quantization` loaded it) and samples with base +
  adapters, as the trainer's forward computes; `/health` says whether the engine takes them
  (`adapters`; vLLM's here does not, and gets the merged weights).
- Agents (`rollout.agent` with `rollout.engine=server`, rollouts/agents.py): the OpenAI-compatible
  routes of rollouts/endpoint.py, `/r/<generation>-<rollout>/v1/chat/completions`, `/completions`,
  `/responses` and `/models`, so that the agents' requests reach the server itself. `POST /agents/open` starts
  a generation of that many rollouts (sampling parameters, one seed per rollout, the weights it
  expects, as /generate): the server generates their requests in rounds, as the trainer's own
  endpoint does; `POST /agents/finished` says which rollouts' agents have returned (a round waits
  for the others only); `POST /agents/close` answers what each rollout sent and got (its
  transcript: prompt ids, sampled ids, sampling log-probs). A text model's server only.
- `POST /v1/chat/completions` (and `GET /v1/models`), outside a training's agents: the served
  model's plain OpenAI chat completion, rendered with its own chat template and sampled at the
  request's temperature (0: greedy) from the request's seed (or a fresh one), so that a server can
  be a judge (rewards/judge.py) for another run. A text model's server only.
- `POST /logprobs`: the served model's log-probs of given token ids (each completion's after its
  prompt, at a temperature), so that a server can be another run's teacher
  (`distill.teacher=http://...`, models/teacher.py); `/health` says its tokenizer's `vocabulary`
  (a digest) for that run to check. The transformers engine of a text model only.

A request whose client goes away (a trainer's or a judge's timeout, an agent that gave up) is
abandoned on /generate, /logprobs, /v1/chat/completions and the agents' routes
(runtime/abandoned.py): one still waiting for the engine is dropped, and the transformers engine
stops the one in hand at its next token (vLLM's finishes it).
"""

from __future__ import annotations

import copy
import threading
import uuid
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from grpokit.engines.batch import SamplingParams, alternatives
from grpokit.engines.in_flight import Pushes
from grpokit.engines.protocols import ServedEngine
from grpokit.engines.weights import WeightGroup, device_id, fingerprint_differences, layout_hash
from grpokit.engines.wire import BASE_DIFFERS, STALE_WEIGHTS, TAKEN_OVER
from grpokit.engines.wire import from_png
from grpokit.models.teacher import vocabulary_digest
from grpokit.rollouts.endpoint import KEEP_ALIVE_S, Endpoint
from grpokit.rollouts.tool_formats import Replies
from grpokit.runtime.abandoned import Abandoned, holding, in_thread
from grpokit.runtime.errors import StartupError


class Sampling(BaseModel):
    # A parameter this server does not know is refused (422), never ignored: a newer trainer's
    # sampling would otherwise silently not be what it asked for.
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    top_k: int = Field(ge=0)
    min_p: float = Field(default=0.0, ge=0, lt=1)  # a default: trainers from before min-p do not send it
    top_logprobs: int = Field(default=0, ge=0, le=20)  # alternatives per token (an agent's request's)


class GenerateRequest(BaseModel):
    fingerprint: dict
    session: str | None  # the weight group session whose weights the request expects
    weights_version: int
    prompts: list[list[int]] = Field(min_length=1)
    n: list[int]
    sampling: Sampling
    seeds: list[int] | None = None
    images: list[list[str]] | None = None  # a vision-language model's: each prompt's images, PNG in base64
    # Weight pushes may land during it, between two decode steps (engines/in_flight.py): it begins
    # with the weights expected or newer ones, and each token is tagged with its weights' step.
    in_flight: bool = False


class GroupRequest(BaseModel):
    fingerprint: dict
    host: str
    port: int
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(gt=0)


class UpdateRequest(BaseModel):
    fingerprint: dict
    session: str
    weights_version: int = Field(ge=1)
    weights_step: int | None = None  # the trainer step the weights are from, when it says
    tensors: list[list]  # weights.layout(): [name, shape, dtype] in the order they are sent
    # A LoRA trainer's adapter settings (models/loading.py adapter_settings): the tensors are its
    # adapters alone, put on this server's base, whose checksum must be `base_checksum`; None:
    # the tensors are the whole weights.
    adapters: dict | None = None
    base_checksum: str | None = None


class AgentsRequest(BaseModel):
    fingerprint: dict
    session: str | None
    weights_version: int
    rollouts: int = Field(ge=1)
    sampling: Sampling
    seeds: list[int] | None = None  # one per rollout
    chat_template: str | None = None  # the trainer's, which renders the agents' messages (None: the model's own)
    tool_call_format: str = "auto"  # the trainer's rollout.tool_call_format and model.reasoning_parser, which
    reasoning_parser: str = "auto"  # read the replies


class FinishedRequest(BaseModel):
    generation: int
    rollouts: list[int]


class CloseRequest(BaseModel):
    generation: int


LOGPROB_ROWS = 8  # rows of a /logprobs request run through the model at once


class LogprobsRequest(BaseModel):
    """A teacher's question (distill.teacher=<this server>): the log-probs of each completion's tokens after its prompt."""
    model_config = ConfigDict(extra="forbid")

    prompts: list[list[int]] = Field(min_length=1)
    completions: list[list[int]]
    temperature: float = Field(default=1.0, gt=0)


class RolloutService:
    """The server's state: one engine (a ServedEngine), its weights' version and checksum, the
    weight group, and the agents' endpoint (a text model's)."""

    def __init__(self, engine: ServedEngine, engine_name: str, model_name: str, fingerprint: dict, vocab_size: int,
                 tokenizer=None, eos_ids: list[int] | None = None):
        self.engine, self.engine_name, self.model_name = engine, engine_name, model_name
        self.fingerprint, self.vocab_size = fingerprint, vocab_size
        text = tokenizer is not None and getattr(engine, "vision", None) is None
        # Its own tokenizer object: each generation renders with the chat template its trainer sends.
        self.endpoint = Endpoint(copy.copy(tokenizer), eos_ids, listen=False) if text else None
        self.chat_template = getattr(tokenizer, "chat_template", None)  # the model's own
        self.vocabulary = None if tokenizer is None else vocabulary_digest(tokenizer)  # a teacher's client checks it
        self.agents: _Agents | None = None  # the agents' generation open now
        self.boot_id = uuid.uuid4().hex
        self.device = device_id() if engine.device.type == "cuda" else "cpu"
        # The trainer whose weights it holds: a weight group session (one trainer per server), and
        # the version of that trainer's weights it last received (0: those it loaded itself).
        self.session: str | None = None
        self.version = 0
        self.weights_step: int | None = None
        self.checksum = engine.weights_checksum()
        # Of the base an adapter push is put on: the weights as loaded, or the last whole ones pushed.
        self.base_checksum = self.checksum
        self.group: WeightGroup | None = None
        self.lock = threading.Lock()  # generation and a weight update never overlap
        self.pushes = Pushes()  # those waiting: a generation in flight lets them in between two tokens

    def health(self) -> dict:
        return {"status": "ok", "engine": self.engine_name, "model": self.model_name, "device": self.device,
                "fingerprint": self.fingerprint, "boot_id": self.boot_id, "session": self.session,
                "weights_version": self.version, "weights_step": self.weights_step, "checksum": self.checksum,
                "vocabulary": self.vocabulary, "adapters": self.engine.takes_adapters,
                "base_checksum": self.base_checksum, "in_flight": self.engine.stops_between_tokens}

    def logprobs(self, request: LogprobsRequest, abandoned: threading.Event | None = None) -> dict:
        """POST /logprobs: the served model's log-probs of each completion's tokens (a teacher's,
        models/teacher.py); `abandoned` (runtime/abandoned.py) stops it between two passes."""
        from grpokit.models.logprobs import completion_logprobs

        model = getattr(self.engine, "model", None)
        if model is None or self.endpoint is None:
            raise Refused(400, "log-probs of given tokens are served by the transformers engine of a text model")
        if len(request.completions) != len(request.prompts) or not all(request.prompts):
            raise Refused(422, "one non-empty prompt per completion")
        bad = [t for row in (*request.prompts, *request.completions) for t in row if not 0 <= t < self.vocab_size]
        if bad:
            raise Refused(422, f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        device, B = self.engine.device, len(request.prompts)
        Lp, T = max(map(len, request.prompts)), max(1, max(map(len, request.completions)))
        prompt_ids = torch.zeros((B, Lp), dtype=torch.long)
        prompt_mask = torch.zeros((B, Lp), dtype=torch.long)
        completion_ids = torch.zeros((B, T), dtype=torch.long)
        for i, (p, c) in enumerate(zip(request.prompts, request.completions)):
            prompt_ids[i, Lp - len(p):], prompt_mask[i, Lp - len(p):] = torch.tensor(p), 1
            completion_ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        values = []
        with holding(self.lock, abandoned), torch.no_grad():
            was_training = model.training
            model.eval()
            try:  # a few rows at a time: their logits (rows x T x vocabulary) are the pass's memory
                for rows in torch.arange(B).split(LOGPROB_ROWS):
                    if abandoned is not None and abandoned.is_set():
                        raise Abandoned
                    values += completion_logprobs(model, prompt_ids[rows].to(device), prompt_mask[rows].to(device),
                                                  completion_ids[rows].to(device),
                                                  temperature=request.temperature).float().tolist()
            finally:
                model.train(was_training)
        return {"logprobs": [row[:len(c)] for row, c in zip(values, request.completions)]}

    def _forget_weights(self) -> None:
        """After a failed transfer: no group, no session, weights of unknown version."""
        if self.group is not None:
            self.group.close()
        self.group, self.session, self.version, self.weights_step = None, None, -1, None

    def check_fingerprint(self, theirs: dict) -> None:
        if differences := fingerprint_differences(self.fingerprint, theirs):
            raise Refused(409, f"this server generates with model {self.model_name} ({self.engine_name}), which "
                               "does not match the trainer's:\n  " + "\n  ".join(differences))

    def _check_weights(self, session: str | None, version: int, newer: bool = False) -> None:
        """Under the lock: the request expects the weights this server holds (`newer`: or newer ones
        its trainer pushed since)."""
        if self.session is not None and session != self.session:
            raise Refused(409, TAKEN_OVER)
        if self.session is None or version != self.version and not (newer and version < self.version):
            raise Refused(409, STALE_WEIGHTS)

    def generate(self, request: GenerateRequest, abandoned: threading.Event | None = None) -> dict:
        """POST /generate (module docstring); `abandoned` (runtime/abandoned.py): the client has
        gone, and the generation stops (before it starts, or at its next token where the engine
        stops between tokens)."""
        self.check_fingerprint(request.fingerprint)
        if len(request.n) != len(request.prompts) or any(k < 1 for k in request.n):
            raise Refused(422, f"n must hold one count >= 1 per prompt ({len(request.prompts)}), got {request.n}")
        bad = [t for p in request.prompts for t in p if not 0 <= t < self.vocab_size]
        if bad or not all(request.prompts):
            raise Refused(422, f"prompt token ids must be non-empty lists of ids in [0, {self.vocab_size}); got {bad[:5]}")
        params = SamplingParams(**request.sampling.model_dump())
        if params.temperature > 0 and (request.seeds is None or len(request.seeds) != sum(request.n)):
            raise Refused(422, f"sampling needs one seed per completion ({sum(request.n)})")
        images = self._images(request)
        if request.in_flight:
            return self._in_flight(request, params, images, abandoned)
        with holding(self.lock, abandoned):
            self._check_weights(request.session, request.weights_version)
            batch = self.engine.generate(request.prompts, request.n, params, request.seeds, **images,
                                         **self.abandoning(abandoned))
            version, step = self.version, self.weights_step
        lengths = batch.completion_mask.sum(-1).tolist()
        entropies = None if batch.entropies is None else batch.entropies.tolist()
        completions = [
            {"token_ids": ids[:k], "logprobs": lps[:k], "entropies": None if entropies is None else entropies[i][:k],
             "finish_reason": reason}
            for i, (ids, lps, k, reason) in enumerate(zip(batch.completion_ids.tolist(), batch.sampling_logps.tolist(),
                                                          lengths, batch.finish_reasons))
        ]
        if batch.top_logps is not None:
            for c, logps, ids, k in zip(completions, batch.top_logps.tolist(), batch.top_ids.tolist(), lengths):
                c["top_logprobs"] = alternatives(ids[:k], logps[:k])
        return {"weights_version": version, "weights_step": step, "completions": completions}

    def abandoning(self, abandoned: threading.Event | None) -> dict:
        """The engine's generate arguments that stop it between two tokens once `abandoned` is set
        (none for an engine that finishes what it started: vLLM's here)."""
        return {"abandoned": abandoned} if abandoned is not None and self.engine.stops_between_tokens else {}

    def _in_flight(self, request: GenerateRequest, params: SamplingParams, images: dict,
                   abandoned: threading.Event | None) -> dict:
        """/generate letting weight pushes in between two decode steps (engines/in_flight.py)."""
        if not self.engine.stops_between_tokens or images or params.top_logprobs:
            raise Refused(422, f"in_flight: the {self.engine_name} engine of a text model takes weight pushes during a "
                               "generation, without alternatives per token (top_logprobs); this one cannot")
        start = {}

        def weights() -> int | None:  # (under the lock)
            if not start:
                self._check_weights(request.session, request.weights_version, newer=True)
                start.update(session=self.session, version=self.version, step=self.weights_step)
            elif self.session != start["session"] or self.version < 0:  # a new group, or a failed push
                raise Refused(409, STALE_WEIGHTS)  # (the client's push finds out whether another trainer took over)
            return self.weights_step

        completions = self.pushes.generate(self.engine, self.lock, request.prompts, request.n, params, request.seeds,
                                           weights, abandoned)
        return {"weights_version": start["version"], "weights_step": start["step"], "completions": completions}

    def _images(self, request: GenerateRequest) -> dict:
        """The engine's `images` argument from the request's (none for a text model)."""
        vision = getattr(self.engine, "vision", None)
        if request.images is None:
            if vision is not None:
                raise Refused(422, f"{self.model_name} is a vision-language model: a request must carry each prompt's "
                                   "images (an empty list for none)")
            return {}
        if vision is None:
            raise Refused(422, f"{self.model_name} is a text model: it takes no images")
        if len(request.images) != len(request.prompts):
            raise Refused(422, f"images must hold one list per prompt ({len(request.prompts)}), got {len(request.images)}")
        try:
            return {"images": [tuple(from_png(i) for i in row) for row in request.images]}
        except ValueError as e:
            raise Refused(422, str(e)) from None

    def join_group(self, request: GroupRequest) -> dict:
        self.check_fingerprint(request.fingerprint)
        # A new trainer (or the same one after a failure) takes the server over; a generation in
        # flight stops at its next token for it (and is answered "stale weights").
        with self.pushes.arriving(), self.lock:
            self._forget_weights()
            try:
                # The client chooses the timeout; the server holds its lock at most 10 minutes for it.
                self.group = WeightGroup(request.host, 1, request.backend, min(request.timeout_s, 600.0),
                                         port=request.port).connect()
            except Exception as e:  # noqa: BLE001 - reported to the trainer, which owns the error
                self._forget_weights()
                raise Refused(503, f"could not join the weight group at {request.host}:{request.port}: {e}") from None
            self.session, self.version, self.weights_step = uuid.uuid4().hex, 0, None
            return {"session": self.session}

    def update(self, request: UpdateRequest) -> dict:
        self.check_fingerprint(request.fingerprint)
        with self.pushes.arriving(), self.lock:  # (a generation in flight stops at its next token for it)
            if self.session is not None and request.session != self.session:
                raise Refused(409, TAKEN_OVER)
            if self.group is None:
                raise Refused(409, STALE_WEIGHTS)  # no group (restarted, or a failed transfer): join again
            try:
                load = self._loader(request)
            except Refused:
                self._forget_weights()  # (making the adapters may have changed them): a new push is needed
                raise
            try:
                checksum = load(self.group.receive(request.tensors))
            except Exception as e:  # noqa: BLE001
                self._forget_weights()  # what it holds is unknown: every generation is refused until a new push
                raise Refused(503, f"receiving weights failed: {e}") from None
            if request.adapters is None:
                self.base_checksum = checksum
            self.version, self.weights_step, self.checksum = request.weights_version, request.weights_step, checksum
            return {"weights_version": self.version, "weights_step": self.weights_step, "checksum": self.checksum}


    def _loader(self, request: UpdateRequest):
        """The engine's call that loads the push `request` announces: whole weights, or adapters."""
        if request.adapters is None:
            if layout_hash(request.tensors) != self.fingerprint["parameters"]:
                raise Refused(422, "the tensors announced do not match this model's parameters")
            return self.engine.load_weights
        if not self.engine.takes_adapters:
            raise Refused(422, f"the {self.engine_name} engine takes whole weights, not LoRA adapters")
        if request.base_checksum != self.base_checksum:
            raise Refused(422, f"this server: {BASE_DIFFERS}")
        try:
            expected = self.engine.adapter_layout(request.adapters)
        except Exception as e:  # noqa: BLE001 - settings this peft or this base cannot make
            raise Refused(422, f"LoRA adapters of these settings cannot be put on {self.model_name}: {e}") from None
        if request.tensors != expected:
            raise Refused(422, "the adapter tensors announced do not match the adapters their settings make here")
        return self.engine.load_adapters

    # ---------------------------------------------------------------- agents

    def open_agents(self, request: AgentsRequest) -> dict:
        self.check_fingerprint(request.fingerprint)
        if self.endpoint is None:
            raise Refused(422, f"{self.model_name} is served without a chat tokenizer or as a vision-language model: "
                               "the agents' OpenAI routes take text messages only")
        params = SamplingParams(**request.sampling.model_dump())
        if params.temperature > 0 and (request.seeds is None or len(request.seeds) != request.rollouts):
            raise Refused(422, f"sampling needs one seed per rollout ({request.rollouts})")
        with self.lock:
            self._check_weights(request.session, request.weights_version)
            self.endpoint.open(request.rollouts, params)  # an earlier generation's requests are refused from now
            self.endpoint.tokenizer.chat_template = request.chat_template or self.chat_template
            try:
                self.endpoint.replies = Replies.of(self.endpoint.tokenizer, request.tool_call_format,
                                                   request.reasoning_parser)
            except ValueError as e:
                raise Refused(422, str(e)) from None
            self.agents = _Agents(self, request.rollouts, params, request.seeds)
            return {"generation": self.agents.generation, "weights_step": self.weights_step}

    def agents_finished(self, request: FinishedRequest) -> dict:
        self._open(request.generation).finish(request.rollouts)
        return {}

    def close_agents(self, request: CloseRequest) -> dict:
        agents = self._open(request.generation)
        agents.finish(range(agents.rollouts))  # the trainer closes once its agents have returned
        agents.thread.join()
        if agents.error is not None:
            raise Refused(500, f"generating the agents' requests failed: {type(agents.error).__name__}: {agents.error}")
        return {"transcripts": [self.endpoint.transcripts[r].record() for r in range(agents.rollouts)]}

    def _open(self, generation: int) -> _Agents:
        if self.agents is None or self.agents.generation != generation:
            raise Refused(409, f"agents' generation {generation} is not open on this server (restarted, or another "
                               "generation opened since)")
        return self.agents


class _Agents:
    """An agents' generation on a rollout server: its requests generated in rounds (Endpoint.
    generate_rounds) in a thread of its own, each round's engine call under the service's lock."""

    def __init__(self, service: RolloutService, rollouts: int, params: SamplingParams, seeds: list[int] | None):
        self.service, self.rollouts, self.error = service, rollouts, None
        self.generation = service.endpoint.session
        self.finished: set[int] = set()
        self.thread = threading.Thread(target=self._run, args=(params, seeds), daemon=True, name="grpokit-agents")
        self.thread.start()

    def finish(self, rollouts) -> None:
        with self.service.endpoint.changed:
            self.finished.update(rollouts)
            self.service.endpoint.changed.notify_all()

    def running(self) -> set[int]:
        if self.service.endpoint.session != self.generation:  # another generation opened since
            return set()
        return set(range(self.rollouts)) - self.finished

    def generate(self, *args, **kwargs):
        with self.service.lock:
            return self.service.engine.generate(*args, **kwargs)

    def _run(self, params: SamplingParams, seeds: list[int] | None) -> None:
        try:
            self.service.endpoint.generate_rounds(self, params, seeds, self.running)
        except Exception as e:  # noqa: BLE001 - answered to the trainer's close
            self.error = e
            with self.service.lock:  # the requests waiting fail, and later ones are refused (no rollout runs)
                if self.service.endpoint.session == self.generation:
                    self.service.endpoint.open(0)


PLAIN_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n",
                "stream", "user", "metadata"}


def plain_chat(service: RolloutService, body: dict, abandoned: threading.Event | None = None) -> dict:
    """POST /v1/chat/completions (module docstring): Refused(400) names what it cannot take;
    `abandoned` (runtime/abandoned.py) stops it, as /generate."""
    import random
    import time

    if service.endpoint is None:
        raise Refused(400, "plain chat completions are served for a text model only")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise Refused(400, "messages must be a non-empty list of chat messages")
    unknown = sorted(set(body) - PLAIN_FIELDS)
    if unknown or body.get("stream") or body.get("n", 1) != 1:
        raise Refused(400, f"not supported here: {', '.join(unknown) or 'stream or n > 1'} (fields taken: "
                           f"{', '.join(sorted(PLAIN_FIELDS - {'stream', 'n'}))})")
    try:
        params = SamplingParams(int(body.get("max_tokens") or body.get("max_completion_tokens") or 512),
                                float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)))
        if params.max_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"max_tokens {params.max_tokens} (>= 1), temperature {params.temperature} (>= 0) or "
                             f"top_p {params.top_p} (in (0, 1]) out of range")
        tokenizer = service.endpoint.tokenizer
        ids = tokenizer.apply_chat_template(body["messages"], chat_template=service.chat_template,
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise Refused(400, f"the request cannot be generated: {type(e).__name__}: {e}") from None
    seed = int(body["seed"]) if body.get("seed") is not None else random.randrange(2**31)
    with holding(service.lock, abandoned):  # not during a weight update or a training's generation
        batch = service.engine.generate([list(ids)], 1, params, None if params.temperature == 0 else [seed],
                                        **service.abandoning(abandoned))
    n = int(batch.completion_mask[0].sum())
    text = tokenizer.decode(batch.completion_ids[0, :n].tolist(), skip_special_tokens=True)
    return {"id": f"grpokit-plain-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": service.model_name, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "finish_reason": batch.finish_reasons[0], "logprobs": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}}


class Refused(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def make_app(service: RolloutService):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="grpokit rollout server")

    @app.exception_handler(Refused)
    async def refused(_: Request, error: Refused):
        return JSONResponse(status_code=error.status, content={"detail": error.detail})

    @app.exception_handler(Abandoned)
    async def abandoned(_: Request, error: Abandoned):  # (read by nobody: the client has gone)
        return JSONResponse(status_code=499, content={"detail": "the client closed the request"})

    def watched(method, body_model):
        """A route of `method`, run in a worker thread and abandoned when its client goes away."""
        async def route(body, request):
            return await in_thread(request, method, body)

        route.__annotations__ = {"body": body_model, "request": Request}  # classes: this module's are strings
        return route

    # Plain `def` endpoints run in FastAPI's thread pool, and those that generate in that pool's
    # threads too (`watched`): a long generation does not block /health.
    app.get("/health")(service.health)
    app.post("/generate")(watched(service.generate, GenerateRequest))
    app.post("/weights/group")(service.join_group)
    app.post("/weights/update")(service.update)
    app.post("/agents/open")(service.open_agents)
    app.post("/agents/finished")(service.agents_finished)
    app.post("/agents/close")(service.close_agents)
    app.post("/logprobs")(watched(service.logprobs, LogprobsRequest))
    if service.endpoint is not None:
        service.endpoint.add_routes(app)

    async def chat(request):
        try:
            body = await request.json()
        except ValueError:
            raise Refused(400, "the request body is not JSON") from None
        return await in_thread(request, plain_chat, service, body)

    chat.__annotations__ = {"request": Request}  # the class itself: this module's annotations are strings
    app.post("/v1/chat/completions")(chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "grpokit"}]}

    return app


def serve(model_name: str, engine_name: str, host: str, port: int, dtype: str, tensor_parallel_size: int = 1,
          data_parallel_size: int = 1, decode_slots: int | None = None, quantization: str = "none") -> None:
    """Load the model, build the engine (vLLM: on tensor_parallel_size x data_parallel_size GPUs;
    transformers: decoding at most decode_slots completions at once), and serve until interrupted."""
    import socket

    import uvicorn

    with socket.socket() as probe:  # before the model loads (which takes a while): is the port free?
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise StartupError(f"grpokit serve cannot listen on {host}:{port}: {e.strerror or e} (choose another "
                               "--port, or stop what uses it)") from None

    from grpokit.settings.schema import Config, ModelConfig, RolloutConfig
    from grpokit.training import setup

    config = Config(model=ModelConfig(name=model_name, dtype=dtype, quantization=quantization),
                    rollout=RolloutConfig(engine=engine_name, decode_slots=decode_slots))
    parts = setup.build(config, "serve", tensor_parallel_size=tensor_parallel_size,
                        data_parallel_size=data_parallel_size)
    engine, fp = parts.engine, parts.fingerprint
    service = RolloutService(engine, engine_name, model_name, fp, fp["vocab_size"], parts.tokenizer, parts.eos_ids)
    spread = f", tensor parallel {tensor_parallel_size} x data parallel {data_parallel_size}" if engine_name == "vllm" else ""
    quantized = "" if quantization == "none" else f", {quantization}"
    print(f"grpokit serve: {model_name} ({engine_name}, {dtype}{quantized}{spread}) on http://{host}:{port}", flush=True)
    try:
        uvicorn.run(make_app(service), host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        engine.close()  # data-parallel vLLM: its replica processes
