"""An OpenAI-compatible endpoint for the model being trained: agents written against the `openai`
client sample from the run's engine through it, and what they sampled is recorded to be trained.

Each rollout has its own base URL, `http://127.0.0.1:<port>/r/<rollout>/v1`, with
`/chat/completions`, `/completions` (each answered whole, or streamed as server-sent events with
`stream: true`) and `/models`. A request is not generated when it arrives: it
waits until every running agent has one waiting (or has ended), and the trainer's thread then
generates all that wait in one engine call (`Endpoint.take`, agents.py), in rollout order, each from
its own seed (rollout r's request k samples from turn_seed(seeds[r], k), as multi-turn rollouts
do). Which requests share an engine call thus depends on what the agents do, not on timing, and a
run is reproducible bit for bit. One thing leaves it to timing: an agent that spends over GATHER_S
seconds between requests (its tools, say), since the requests waiting are then generated without
it (in float32 a different batch can move a sampled token by rounding). A rollout's requests go one
at a time: a second while one is pending, or one after the rollout's agent returned, is refused
(what a client shared by several rollouts sends: MISROUTED).

The run's sampling settings apply whatever a request says (its temperature, top_p, n are not
honoured); its `max_tokens` / `max_completion_tokens` can only shorten a reply. Tool calls come
back in OpenAI's `tool_calls` shape, parsed from the model's text by the chat template's format
(tools.parse_calls); a reply with a malformed call has the model's whole text as its content (the
well-formed calls still as `tool_calls`), and the problem is recorded with the rollout.

Token in, token out (`Transcript`): a chat request whose messages are the previous request's, then
the reply it got, then new messages (tool results, a user turn), is that exchange's ids as they
were (prompt and sampled tokens, never decoded and encoded again) and the new messages as the chat
template renders them after an assistant turn (conversation.turn_segment). A request that does not
extend the previous exchange so, or whose history the template renders otherwise than before (a
thinking model dropping earlier reasoning), starts a new sequence.
"""


import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace

from grpokit.multiturn.conversation import turn_seed, turn_segment
from grpokit.multiturn.tools import parse_calls
from grpokit.rollout.batch import consecutive_groups
from grpokit.runtime.errors import ConfigError


# The model's name in requests and answers (the `model` argument an agent is given).
MODEL_NAME = "grpokit"
# Requests that have waited this long are generated without waiting for the agents still working
# (on their own tools, say): see the module docstring.
GATHER_S = 2.0


# Why requests reach a rollout's URL that are not its agent's, and the fix.
MISROUTED = ("a client made once and shared by several rollouts (a module-level client, the Agents SDK's "
             "set_default_openai_client) sends every rollout's requests to one rollout's URL. Make each rollout's "
             "requests with the client its agent is given (the Agents SDK: OpenAIChatCompletionsModel(model=model, "
             "openai_client=client) in the agent). Nothing from this request is trained")


class RequestError(ValueError):
    """A request the endpoint cannot take: answered with HTTP 400 and its message, and recorded."""


@dataclass
class Exchange:
    """One generated request of a rollout."""

    prompt: list[int]  # the context's ids
    extends: bool  # prompt = the previous exchange's prompt + sampled + a segment of new messages
    sampled: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    entropies: list[float] | None = None
    finish: str = "stop"


@dataclass
class Waiting:
    """A request waiting for its generation."""

    rollout: int
    prompt: list[int]
    extends: bool
    max_tokens: int | None  # what the request allows (None: no limit of its own)
    answer: Future  # set to the Exchange once generated
    since: float = field(default_factory=time.monotonic)


class Transcript:
    """What one rollout's agent sent and got (token in, token out: module docstring)."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.exchanges: list[Exchange] = []
        self.start = 0  # the exchange that begins the current sequence (the token budget counts from its prompt)
        self.errors: list[str] = []  # requests refused (messages the template cannot render, ...)
        self.problems: list[str] = []  # the replies' malformed tool calls (tools.parse_calls)
        self.first_messages: list[dict] | None = None
        self.last_messages: list[dict] | None = None  # the last chat request's
        self._tools: list[dict] | None = None
        self._rendered: str | None = None  # its rendering, with the generation prompt
        self.last_reply: dict | None = None  # the assistant message it got
        self.pending = False  # a request of it is waiting or being generated
        self._text: str | None = None  # the last completions request's prompt and reply, as text

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's error, told to the agent and counted
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    def chat(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], bool]:
        """A chat request's context ids, and whether it extends the previous exchange."""
        rendered = self.render(messages, tools)
        last = self.exchanges[-1] if self.exchanges else None
        n = len(self.last_messages or ())
        extends = (last is not None and self.last_messages is not None and tools == self._tools and len(messages) > n + 1
                   and messages[:n] == self.last_messages and same_reply(messages[n], self.last_reply)
                   and self._renders_as_before(rendered, messages[:n + 1], tools))
        if extends:
            after_eos = last.sampled[-1] if last.sampled and last.sampled[-1] in self.eos_ids else None
            try:
                ids = last.prompt + last.sampled + turn_segment(self.tokenizer, messages[n + 1:], tools, after_eos)
            except ConfigError:  # the template tells no turn apart from the history before it
                extends = False
        if not extends:
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if self.first_messages is None:
            self.first_messages = messages
        self.last_messages, self._tools, self._rendered, self._text = messages, tools, rendered, None
        return ids, extends

    def _renders_as_before(self, rendered: str, history: list[dict], tools: list[dict] | None) -> bool:
        """Whether `rendered` (a request's messages) begins with the last request's context and the
        reply it got as the template renders them as the last turn: a template that renders
        history otherwise once a turn follows (a thinking model's dropping earlier reasoning)
        does not."""
        try:
            before = self.tokenizer.apply_chat_template(history, tools=tools, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot end on an assistant turn: no telling
            return False
        return rendered.startswith(self._rendered) and rendered.startswith(before)

    def completion(self, prompt: str) -> tuple[list[int], bool]:
        """A completions request's context ids: the previous exchange's ids and the new text's when
        its prompt is the previous prompt and reply followed by more text."""
        last = self.exchanges[-1] if self.exchanges else None
        extends = last is not None and self._text is not None and prompt.startswith(self._text) and prompt != self._text
        if extends:
            ids = last.prompt + last.sampled + self.tokenizer(prompt[len(self._text):], add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        self.last_messages, self._text = None, prompt
        return ids, extends

    def replied(self, reply: dict | None, text: str) -> None:
        """What the last request was answered (the trainer's thread recorded its Exchange)."""
        self.last_reply = reply
        if self._text is not None:
            self._text += text

    def record(self) -> dict:
        """What the trainer builds the rollout's row from, as JSON (a rollout server's answer)."""
        return {"exchanges": [asdict(e) for e in self.exchanges], "errors": self.errors, "problems": self.problems,
                "first_messages": self.first_messages, "last_messages": self.last_messages,
                "last_reply": self.last_reply}

    @classmethod
    def from_record(cls, record: dict, tokenizer, eos_ids) -> "Transcript":
        t = cls(tokenizer, set(eos_ids))
        t.exchanges = [Exchange(**e) for e in record["exchanges"]]
        t.errors, t.problems, t.first_messages = record["errors"], record["problems"], record["first_messages"]
        t.last_messages, t.last_reply = record["last_messages"], record["last_reply"]
        return t


def same_reply(message: dict, reply: dict | None) -> bool:
    """Whether `message` (sent back by an agent) is the assistant `reply` it was given."""
    if reply is None or message.get("role") != "assistant" or (message.get("content") or "") != (reply["content"] or ""):
        return False
    return _calls(message.get("tool_calls")) == _calls(reply.get("tool_calls"))


def _calls(calls) -> list:
    out = []
    for call in calls or ():
        function = call.get("function", call)
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        out.append((function.get("name"), arguments))
    return out


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

    def __init__(self, tokenizer, eos_ids, listen: bool = True):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.transcripts: dict[int, Transcript] = {}
        self.waiting: list[Waiting] = []
        self.changed = threading.Condition()
        self.session = 0  # rollout ids of an earlier generate are refused
        self.running: Callable[[], set[int]] | None = None  # the rollouts whose agents have not returned
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
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="grpokit-endpoint")
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)

    def base_url(self, rollout: int, url: str | None = None) -> str:
        """Rollout `rollout`'s base URL, on this endpoint's server or on `url`'s."""
        return f"{url or self.url}/r/{self.session}-{rollout}/v1"

    def open(self, rollouts: int) -> list[Transcript]:
        """Transcripts for a generation's `rollouts` agents (those of the last one are dropped)."""
        with self.changed:
            self.session += 1
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
                batch = engine.generate(prompts, counts, replace(params, max_tokens=max(l for _, l in asked)), turn_seeds)
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
                row += 1
            if not w.extends:
                t.start = len(t.exchanges)
            t.exchanges.append(exchange)
            w.answer.set_result(exchange)

    # ------------------------------------------------------------------ HTTP

    def _transcript(self, rollout: str) -> tuple[int, Transcript]:
        session, _, index = rollout.partition("-")
        if session != str(self.session) or not index.isdigit() or int(index) not in self.transcripts:
            raise RequestError(f"no rollout {rollout!r} is running: its agent's generation has ended")
        return int(index), self.transcripts[int(index)]

    def _accepted(self, rollout: str, body: dict) -> tuple[int, Transcript, dict | None]:
        """A request to `rollout`'s URL, checked as every route takes it: its rollout index and
        transcript, and its stream options (None: not streamed). Refused (RequestError): another
        model, n other than 1, and what cannot be the rollout's own request: a second one while one
        is pending, or one after its agent returned (what a client shared by several rollouts sends)."""
        r, t = self._transcript(rollout)
        if body.get("model") not in (None, MODEL_NAME):
            raise RequestError(f"model {body.get('model')!r}: this endpoint serves the model being trained, "
                               f"named {MODEL_NAME!r} (the `model` argument an agent is given)")
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1: each request is one sample of a rollout")
        if self.running is not None and r not in self.running():
            raise RequestError(f"rollout {r}'s agent has returned, and a request reached its URL: {MISROUTED}")
        if t.pending:
            raise RequestError(f"rollout {r} has a request pending already, and another reached its URL (a rollout's "
                               f"requests go one at a time): {MISROUTED}")
        return r, t, _streaming(body)

    async def _generate(self, r: int, t: Transcript, ids: list[int], extends: bool, body: dict) -> Exchange:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        with self.changed:
            waiting = Waiting(r, ids, extends, int(limit) if limit else None, Future())
            self.waiting.append(waiting)
            self.changed.notify_all()
        t.pending = True
        try:
            return await asyncio.wrap_future(waiting.answer)
        finally:
            t.pending = False

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

        @app.get("/r/{rollout}/v1/models")
        async def models(rollout: str):
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "grpokit"}]}

        @app.post("/r/{rollout}/v1/chat/completions")
        async def chat(rollout: str, request: Request):
            body = await request.json()
            r, t, stream = self._accepted(rollout, body)
            messages = _text_content(body.get("messages"))
            tools = body.get("tools") or None
            ids, extends = t.chat(messages, tools)  # handlers run on one event loop: no other request interleaves
            exchange = await self._generate(r, t, ids, extends, body)
            text = self.tokenizer.decode(exchange.sampled, skip_special_tokens=True)
            content, calls, problems = parse_calls(self.tokenizer, text)
            if problems:  # nothing the model wrote vanishes: the agent reads the malformed call as written
                content = text
                t.problems += problems
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"id": f"call_{len(t.exchanges)}_{i}", "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                         for i, c in enumerate(calls)]
            t.replied(message, text)
            finish = "length" if exchange.finish == "length" else "tool_calls" if calls else "stop"
            response = self._response(rollout, t, exchange, "chat.completion",
                                      {"index": 0, "message": message, "finish_reason": finish, "logprobs": None})
            return response if stream is None else _streamed(response, _chat_deltas(message, finish), stream)

        @app.post("/r/{rollout}/v1/completions")
        async def completions(rollout: str, request: Request):
            body = await request.json()
            r, t, stream = self._accepted(rollout, body)
            if not isinstance(body.get("prompt"), str):
                raise RequestError("prompt must be one string")
            ids, extends = t.completion(body["prompt"])
            exchange = await self._generate(r, t, ids, extends, body)
            text = self.tokenizer.decode(exchange.sampled, skip_special_tokens=True)
            t.replied(None, text)
            response = self._response(rollout, t, exchange, "text_completion",
                                      {"index": 0, "text": text, "finish_reason": exchange.finish, "logprobs": None})
            return response if stream is None else _streamed(response, _text_deltas(text, exchange.finish), stream)

    def _response(self, rollout: str, t: Transcript, exchange: Exchange, kind: str, choice: dict) -> dict:
        return {"id": f"grpokit-{rollout}-{len(t.exchanges)}", "object": kind, "created": int(time.time()),
                "model": MODEL_NAME, "choices": [choice],
                "usage": {"prompt_tokens": len(exchange.prompt), "completion_tokens": len(exchange.sampled),
                          "total_tokens": len(exchange.prompt) + len(exchange.sampled)}}


# ---------------------------------------------------------------------- streaming


def _streaming(body: dict) -> dict | None:
    """A request's `stream` and `stream_options`: None when not streamed, else the options."""
    stream, options = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}")
    if options is not None and not stream:
        raise RequestError("stream_options is only allowed with stream: true")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise RequestError(f"stream_options: only include_usage is supported, got {options!r}")
    return (options or {}) if stream else None


def _chat_deltas(message: dict, finish: str) -> list[dict]:
    """A chat reply as the choices of its stream's chunks: the role, the content, each tool call
    whole (a client joins the deltas back into `message`), and the finish reason."""
    deltas = [{"role": "assistant", "content": ""}]
    if message["content"]:
        deltas.append({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
        deltas.append({"tool_calls": [{"index": i, **call}]})
    choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    return choices + [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]


def _text_deltas(text: str, finish: str) -> list[dict]:
    """A completion's text as the choices of its stream's chunks, then its finish reason."""
    return [{"index": 0, "text": text, "logprobs": None, "finish_reason": None},
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
