"""An OpenAI-compatible endpoint for the model being trained: agents written against the `openai`
client sample from the run's engine through it, and what they sampled is recorded to be trained.

Each rollout has its own base URL, `http://127.0.0.1:<port>/r/<rollout>/v1`, with
`/chat/completions`, `/completions`, `/responses` (responses_api.py; each answered whole, or
streamed as server-sent events with `stream: true`) and `/models`. A request is not generated
when it arrives: it waits until every running agent has one waiting (or has ended), and the
trainer's thread then generates all that wait in one engine call (`Endpoint.take`, agents.py), in
rollout order, each from its own seed (rollout r's request k samples from turn_seed(seeds[r], k),
as multi-turn rollouts do). Which requests share an engine call thus depends on what the agents do, not on timing, and a
run is reproducible bit for bit. One thing leaves it to timing: an agent that spends over GATHER_S
seconds between requests (its tools, say), since the requests waiting are then generated without
it (in float32 a different batch can move a sampled token by rounding). A rollout's requests go one
at a time: a second while one is pending, or one after the rollout's agent returned, is refused
(what a client shared by several rollouts sends: MISROUTED).

Every field of a request is honoured or refused by name (request_fields.py): the run samples from
its own distribution, which is what is trained, so `temperature` is taken only when it is the
run's, and a forced tool call or a JSON schema is refused; `max_tokens` can only shorten a reply;
`stop` cuts it after the token that completes a stop string (the text returned stops before it, as
OpenAI's does, and a conversation the agent continues from that text goes on token in, token out
from the tokens kept, stop string included); `logprobs` gives the sampled tokens' (`top_logprobs` the alternatives beside each, kept by the sampling pass). Tool calls come
back in OpenAI's `tool_calls` shape, parsed from the model's text by the chat template's format
(tool_formats.Replies); a reply with a malformed call has the model's whole text as its content (the
well-formed calls still as `tool_calls`), and the problem is recorded with the rollout.

Token in, token out: transcript.py.
"""


import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from grpokit.engines.batch import alternatives, consecutive_groups
from grpokit.rollouts import request_fields, responses_api
from grpokit.rollouts.conversation import turn_seed
from grpokit.rollouts.request_fields import Asked, RequestError
from grpokit.rollouts.tool_formats import Replies
from grpokit.rollouts.transcript import Exchange, Transcript
from grpokit.runtime.abandoned import Abandoned, unless_disconnected


# The model's name in requests and answers (the `model` argument an agent is given).
MODEL_NAME = "grpokit"
# Seconds the server keeps an idle connection open: longer than a client's pool keeps one (httpx,
# under the openai client: 5 s), so the client always closes first. With equal timeouts (uvicorn's
# default is 5 s too) a request sent as the server closes its connection fails, and the agent sees
# APIConnectionError (ReadError, BrokenResourceError): steps of about 5 s lost rollouts that way.
KEEP_ALIVE_S = 300
# Requests that have waited this long are generated without waiting for the agents still working
# (on their own tools, say): see the module docstring.
GATHER_S = 2.0


# Why requests reach a rollout's URL that are not its agent's, and the fix.
MISROUTED = ("a client made once and shared by several rollouts (a module-level client, the Agents SDK's "
             "set_default_openai_client) sends every rollout's requests to one rollout's URL. Make each rollout's "
             "requests with the client its agent is given (the Agents SDK: OpenAIChatCompletionsModel(model=model, "
             "openai_client=client) in the agent). Nothing from this request is trained")


@dataclass
class Waiting:
    """A request waiting for its generation."""

    rollout: int
    prompt: list[int]
    extends: bool
    max_tokens: int | None  # what the request allows (None: no limit of its own)
    answer: Future  # set to the Exchange once generated
    stop: list[str] = field(default_factory=list)  # the request's stop strings
    top_logprobs: int = 0  # the alternatives it lists beside each token's log-prob
    since: float = field(default_factory=time.monotonic)


def _text_content(messages) -> list[dict]:
    """Messages with content given as a list of text parts joined into a string (the shape every
    chat template takes); anything else in a list of parts is refused."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"every message needs a role: {str(m)[:80]}")
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        if m["role"] == "developer":  # OpenAI's newer name for system, which chat templates know
            m["role"] = "system"
        if isinstance(m.get("content"), list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in m["content"]):
                raise RequestError("only text content parts are supported")
            m["content"] = "".join(p.get("text", "") for p in m["content"])
        out.append(m)
    return out


class Endpoint:
    """The requests waiting for generation, their rollouts' transcripts, and the HTTP routes: on an
    HTTP server of its own on 127.0.0.1 (the trainer's, `listen`), or added to another app (a
    rollout server's: `add_routes`)."""

    def __init__(self, tokenizer, eos_ids, listen: bool = True, replies: Replies | None = None):
        """replies: how a reply is read, its reasoning and tool calls (tool_formats.Replies; default:
        as the tokenizer's chat template says)."""
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.replies = replies or Replies.of(tokenizer)
        self.transcripts: dict[int, Transcript] = {}
        self.waiting: list[Waiting] = []
        self.changed = threading.Condition()
        self.session = 0  # rollout ids of an earlier generate are refused
        self.running: Callable[[], set[int]] | None = None  # the rollouts whose agents have not returned
        self.params = None  # the generation's sampling (rollout.SamplingParams)
        self.url, self.server = None, None
        if listen:
            self._listen()

    def _listen(self) -> None:
        import uvicorn
        from fastapi import FastAPI

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = FastAPI(title="grpokit OpenAI-compatible endpoint")
        self.add_routes(app)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="grpokit-endpoint")
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)

    def base_url(self, rollout: int, url: str | None = None) -> str:
        """Rollout `rollout`'s base URL, on this endpoint's server or on `url`'s."""
        return f"{url or self.url}/r/{self.session}-{rollout}/v1"

    def open(self, rollouts: int, params=None) -> list[Transcript]:
        """Transcripts for a generation's `rollouts` agents sampling with `params` (those of the last
        one are dropped)."""
        with self.changed:
            self.session += 1
            self.params = params
            self.running = None  # until generate_rounds says
            self.transcripts = {r: Transcript(self.tokenizer, self.eos_ids) for r in range(rollouts)}
            for w in self.waiting:  # of agents that gave up on them: their handlers end
                w.answer.cancel()
            self.waiting = []
            return list(self.transcripts.values())

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def take(self, running: Callable[[], set[int]]) -> list[Waiting]:
        """The requests waiting once every rollout still running (`running()`: those whose agent
        has not returned) has one, or once the oldest has waited GATHER_S; in rollout order ([]
        after a while without either: the caller asks again)."""
        def ready() -> bool:
            return bool(self.waiting) and (running() <= {w.rollout for w in self.waiting}
                                           or time.monotonic() - min(w.since for w in self.waiting) >= GATHER_S)

        with self.changed:
            if not self.changed.wait_for(ready, timeout=0.1):
                return []
            taken = sorted(self.waiting, key=lambda w: w.rollout)  # stable: a rollout's in arrival order
            self.waiting = []
            return taken

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=5)

    # ------------------------------------------------------------------ generation

    def generate_rounds(self, engine, params, seeds: list[int] | None, running: Callable[[], set[int]]) -> None:
        """Generate the rollouts' requests with `engine` in rounds (`take`) until none runs
        (`running()`: those whose agent has not returned); seeds[r]: rollout r's."""
        self.running = running
        while running():
            taken = self.take(running)
            if taken:
                self._round(engine, taken, params, seeds)

    def _round(self, engine, taken: list[Waiting], params, seeds: list[int] | None) -> None:
        """Generate the waiting requests in one engine call, each cut to what its rollout's budget
        and its own max_tokens allow, and answer them."""
        # This generation's transcripts: a generation opened meanwhile (`open`) has its own.
        transcripts = self.transcripts
        limits = []
        for w in taken:
            t = transcripts[w.rollout]
            start = len(t.exchanges[t.start].prompt) if w.extends else len(w.prompt)
            room = params.max_tokens - (len(w.prompt) - start)
            limits.append(max(0, min(room, w.max_tokens if w.max_tokens is not None else room)))
        asked = [(w, limit) for w, limit in zip(taken, limits) if limit > 0]
        batch = None
        if asked:
            turn_seeds = None if seeds is None else [turn_seed(int(seeds[w.rollout]), len(transcripts[w.rollout].exchanges))
                                                     for w, _ in asked]
            # Rollouts in a row with the same context (a group's first requests) share one prefill,
            # as single-turn and multi-turn sampling do: the same engine call, the same tokens.
            prompts, counts = consecutive_groups([w.prompt for w, _ in asked])
            try:
                batch = engine.generate(prompts, counts, replace(params, max_tokens=max(l for _, l in asked),
                                                                 top_logprobs=max(w.top_logprobs for w, _ in asked)),
                                        turn_seeds)
            except BaseException as e:
                for w in taken:  # their handlers answer with the error, and the agents end
                    if not w.answer.done():
                        w.answer.set_exception(e)
                raise
        row = 0
        for w, limit in zip(taken, limits):
            t = transcripts[w.rollout]
            exchange = Exchange(w.prompt, w.extends, finish="length")
            if limit > 0:
                n = int(batch.completion_mask[row].sum())
                exchange.finish = batch.finish_reasons[row]
                if n > limit:  # the engine was asked for the longest limit of the round
                    n, exchange.finish = limit, "length"
                exchange.sampled = batch.completion_ids[row, :n].tolist()
                exchange.logps = batch.sampling_logps[row, :n].tolist()
                exchange.entropies = None if batch.entropies is None else batch.entropies[row, :n].tolist()
                if w.top_logprobs:
                    k = w.top_logprobs
                    exchange.alternatives = alternatives(batch.top_ids[row, :n, :k].tolist(),
                                                         batch.top_logps[row, :n, :k].tolist())
                if w.stop:
                    self._stopped(exchange, w.stop)
                row += 1
            if not w.answer.set_running_or_notify_cancel():  # its client went away first: unseen, not trained
                continue
            if not w.extends:
                t.start = len(t.exchanges)
            t.exchanges.append(exchange)
            w.answer.set_result(exchange)

    def _stopped(self, exchange: Exchange, stops: list[str]) -> None:
        """`exchange` cut after the token that completes the first of `stops` in its text: the
        tokens kept are a prefix of what was sampled (their log-probs are still the sampled ones)."""
        def text(n: int) -> str:
            return self.tokenizer.decode(exchange.sampled[:n], skip_special_tokens=True)

        def found(n: int) -> int | None:
            at = [i for i in (text(n).find(s) for s in stops) if i >= 0]
            return min(at) if at else None

        if found(len(exchange.sampled)) is None:
            return
        low, high = 1, len(exchange.sampled)  # the fewest tokens whose text holds a stop string
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if found(middle) is not None else (middle + 1, high)
        at = found(low)
        if at is None:  # a decoding whose prefixes do not grow as the tokens do: left whole
            return
        exchange.sampled, exchange.logps = exchange.sampled[:low], exchange.logps[:low]
        if exchange.entropies is not None:
            exchange.entropies = exchange.entropies[:low]
        if exchange.alternatives is not None:
            exchange.alternatives = exchange.alternatives[:low]
        exchange.finish, exchange.text_end = "stop", at

    # ------------------------------------------------------------------ HTTP

    def _transcript(self, rollout: str) -> tuple[int, Transcript]:
        session, _, index = rollout.partition("-")
        if session != str(self.session) or not index.isdigit() or int(index) not in self.transcripts:
            raise RequestError(f"no rollout {rollout!r} is running: its agent's generation has ended")
        return int(index), self.transcripts[int(index)]

    def _accepted(self, rollout: str, body: dict, api: str) -> tuple[int, Transcript, Asked]:
        """A request to `rollout`'s URL on route `api` (request_fields.FIELDS), checked as every
        route takes it: its rollout index and transcript, and what it asks. Refused (RequestError):
        another model, a field refused by request_fields, and what cannot be the rollout's own
        request: a second one while one is pending, or one after its agent returned (what a client
        shared by several rollouts sends)."""
        r, t = self._transcript(rollout)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("model") not in (None, MODEL_NAME):
            raise RequestError(f"model {body.get('model')!r}: this endpoint serves the model being trained, "
                               f"named {MODEL_NAME!r} (the `model` argument an agent is given)")
        request = request_fields.asked(api, body, self.params)
        if self.running is not None and r not in self.running():
            raise RequestError(f"rollout {r}'s agent has returned, and a request reached its URL: {MISROUTED}")
        if t.pending:
            raise RequestError(f"rollout {r} has a request pending already, and another reached its URL (a rollout's "
                               f"requests go one at a time): {MISROUTED}")
        return r, t, request

    async def _generate(self, r: int, t: Transcript, ids: list[int], extends: bool, request: Asked) -> Exchange:
        with self.changed:
            if self.transcripts.get(r) is not t:  # a generation opened since the request was checked
                raise RequestError(f"rollout {r}'s generation has ended: nothing from this request is trained")
            waiting = Waiting(r, ids, extends, request.max_tokens, Future(), request.stop, request.top_logprobs)
            self.waiting.append(waiting)
            self.changed.notify_all()
        t.pending, t.waiting_since = True, time.monotonic()
        try:
            return await asyncio.wrap_future(waiting.answer)
        except asyncio.CancelledError:  # its client went away (runtime/abandoned.py): not generated if not begun
            with self.changed:
                if waiting in self.waiting:
                    self.waiting.remove(waiting)
                    self.changed.notify_all()
            raise
        finally:
            t.pending, t.wait_s, t.waiting_since = False, t.waited(), None

    def add_routes(self, app) -> None:
        """The OpenAI routes of every rollout, on FastAPI `app`."""
        from fastapi import Request
        from fastapi.responses import JSONResponse

        @app.exception_handler(RequestError)
        async def refused(request: Request, error: RequestError):
            try:  # counted against its rollout, if it is one of this generation's
                self._transcript(request.path_params.get("rollout", ""))[1].errors.append(str(error))
            except RequestError:
                pass
            return JSONResponse(status_code=400, content={"error": {"message": str(error), "type": "invalid_request_error"}})

        @app.exception_handler(Abandoned)
        async def abandoned(request: Request, error: Abandoned):  # (read by nobody: the client has gone)
            return JSONResponse(status_code=499, content={"error": {"message": "the client closed the request"}})

        @app.get("/r/{rollout}/v1/models")
        async def models(rollout: str):
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "grpokit"}]}

        def route(answer):
            async def handler(rollout: str, request: Request):
                return await unless_disconnected(request, answer(rollout, await request.json()))
            return handler

        for path, answer in (("chat/completions", self._chat), ("completions", self._completions),
                             ("responses", self._responses)):
            app.post(f"/r/{{rollout}}/v1/{path}")(route(answer))

    async def _chat(self, rollout: str, body: dict):
        r, t, asked = self._accepted(rollout, body, "chat")
        exchange = await self._chat_turn(r, t, _text_content(body.get("messages")), body.get("tools") or None,
                                         asked)
        message, finish = t.last_reply, _chat_finish(exchange, t.last_reply)
        logprobs = {"content": self._logprobs(exchange), "refusal": None} if asked.logprobs else None
        response = self._response(rollout, t, exchange, "chat.completion",
                                  {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs})
        return response if asked.stream is None else _streamed(response, _chat_deltas(message, finish, logprobs),
                                                                asked.stream)

    async def _completions(self, rollout: str, body: dict):
        r, t, asked = self._accepted(rollout, body, "completions")
        if not isinstance(body.get("prompt"), str):
            raise RequestError("prompt must be one string")
        ids, extends = t.completion(body["prompt"])
        exchange = await self._generate(r, t, ids, extends, asked)
        whole = self.tokenizer.decode(exchange.sampled, skip_special_tokens=True)
        t.replied(None, whole)  # a continuation holds the stop string, as the tokens do
        text = whole[:exchange.text_end]
        logprobs = None
        if asked.logprobs:
            tokens = self._logprobs(exchange)
            offsets = [sum(len(x["token"]) for x in tokens[:i]) for i in range(len(tokens))]
            top = [{y["token"]: y["logprob"] for y in x["top_logprobs"]} for x in tokens] if asked.top_logprobs else None
            logprobs = {"tokens": [x["token"] for x in tokens], "token_logprobs": [x["logprob"] for x in tokens],
                        "top_logprobs": top, "text_offset": [len(body["prompt"]) + o for o in offsets]}
        response = self._response(rollout, t, exchange, "text_completion",
                                  {"index": 0, "text": text, "finish_reason": exchange.finish, "logprobs": logprobs})
        return response if asked.stream is None else _streamed(response, _text_deltas(text, exchange.finish, logprobs),
                                                                asked.stream)

    async def _responses(self, rollout: str, body: dict):
        r, t, asked = self._accepted(rollout, body, "responses")
        messages, tools = responses_api.chat_form(body)
        exchange = await self._chat_turn(r, t, messages, tools, asked)
        whole = responses_api.response(f"{rollout}_{len(t.exchanges)}", t.last_reply,
                                       _chat_finish(exchange, t.last_reply), _usage(exchange), body,
                                       self._logprobs(exchange) if asked.logprobs else None)
        if asked.stream is None:
            return whole
        from fastapi.responses import StreamingResponse

        return StreamingResponse(iter(responses_api.events(whole)), media_type="text/event-stream")

    async def _chat_turn(self, r: int, t: Transcript, messages: list[dict], tools: list[dict] | None,
                         asked: Asked) -> Exchange:
        """A chat request's generation; its reply (the assistant message: content, tool calls)
        becomes t.last_reply. A malformed tool call leaves the model's whole text as the content, and
        is recorded."""
        ids, extends = t.chat(messages, tools)  # handlers run on one event loop: no other request interleaves
        exchange = await self._generate(r, t, ids, extends, asked)
        # (a stop string's place is in the text without special tokens: a format whose marks are
        # special tokens reads a reply cut at one as that text)
        text = self.replies.text(exchange.sampled) if exchange.text_end is None else \
            self.tokenizer.decode(exchange.sampled, skip_special_tokens=True)[:exchange.text_end]
        message, calls, problems = self.replies.read(text)
        if problems:  # nothing the model wrote vanishes: the agent reads the malformed call as written
            message["content"] = text
            t.problems += problems
        if calls:
            message["tool_calls"] = [{"id": f"call_{len(t.exchanges)}_{i}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for i, c in enumerate(calls)]
        t.replied(message, text)
        return exchange

    def _logprobs(self, exchange: Exchange) -> list[dict]:
        """The reply's tokens (its EOS left out, as OpenAI's API does) with the log-probs they were
        sampled with, in the chat form (token, logprob, bytes, and the alternatives asked for)."""
        def entry(token: int, logp: float) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logp, "bytes": list(text.encode())}

        out = []
        for t, (token, logp) in enumerate(zip(exchange.sampled, exchange.logps)):
            if token not in self.eos_ids:
                top = exchange.alternatives[t] if exchange.alternatives is not None else []
                out.append({**entry(token, logp), "top_logprobs": [entry(i, lp) for i, lp in top]})
        return out

    def _response(self, rollout: str, t: Transcript, exchange: Exchange, kind: str, choice: dict) -> dict:
        return {"id": f"grpokit-{rollout}-{len(t.exchanges)}", "object": kind, "created": int(time.time()),
                "model": MODEL_NAME, "choices": [choice], "usage": _usage(exchange)}


def _usage(exchange: Exchange) -> dict:
    return {"prompt_tokens": len(exchange.prompt), "completion_tokens": len(exchange.sampled),
            "total_tokens": len(exchange.prompt) + len(exchange.sampled)}


def _chat_finish(exchange: Exchange, message: dict) -> str:
    return "length" if exchange.finish == "length" else "tool_calls" if message.get("tool_calls") else "stop"


# ---------------------------------------------------------------------- streaming


def _chat_deltas(message: dict, finish: str, logprobs: dict | None = None) -> list[dict]:
    """A chat reply as the choices of its stream's chunks: the role, the content, each tool call
    whole (a client joins the deltas back into `message`), and the finish reason. `logprobs`, every
    token's, ride on the first chunk after the role (the content's, or a reply of tool calls only's
    first call)."""
    deltas = [{"role": "assistant", "content": ""}]
    if message["content"]:
        deltas.append({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        deltas.append({"tool_calls": [{"index": i, **call}]})
    choices = [{"index": 0, "delta": d, "logprobs": logprobs if i == 1 else None, "finish_reason": None}
               for i, d in enumerate(deltas)]
    return choices + [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]


def _text_deltas(text: str, finish: str, logprobs: dict | None) -> list[dict]:
    """A completion's text (with its `logprobs`) as the choices of its stream's chunks, then its finish reason."""
    return [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None},
            {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}]


def _streamed(response: dict, choices: list[dict], options: dict):
    """The reply `response` as server-sent events, one chunk per choice of `choices`, then the
    usage (`options` include_usage: every chunk carries `usage`, null but in the last) and
    [DONE]. The reply is whole before the first chunk: a rollout's request is generated in a round
    with the others' (module docstring), and its tokens are recorded as sampled whatever the client
    does with the chunks."""
    from fastapi.responses import StreamingResponse

    usage = response.pop("usage")
    kind = response["object"] + (".chunk" if response["object"] == "chat.completion" else "")
    head = {k: v for k, v in response.items() if k not in ("choices", "object")}
    chunks = [{**head, "object": kind, "choices": [choice]} for choice in choices]
    if options.get("include_usage"):
        chunks = [{**c, "usage": None} for c in chunks] + [{**head, "object": kind, "choices": [], "usage": usage}]
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream")
