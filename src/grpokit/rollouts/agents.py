"""Agents as they are: `rollout.agent` (or `grpokit.train(agent=...)`), an

    async def agent(client, model, row) -> float | dict[str, float] | None

run once per rollout (or a plain `def`, run in a thread of its own with an `openai.OpenAI`, so that
the rollouts still run together). `client` is an `openai.AsyncOpenAI` whose base URL is the rollout's own on
the run's OpenAI-compatible endpoint (endpoint.py), `model` the name to put in requests, `row` the
dataset row (its `prompt` and other columns). The agent runs any code (several requests, its own
tools and loop) and returns its reward, or a dict of named rewards (their sum is the reward; each
is logged as `agent/<name>`). That reward is the `agent` reward function's value, added to
reward.functions'.

What is trained is what the endpoint recorded, one row per rollout: the first request's context is
the prompt; each request that extends the previous exchange (endpoint.py) adds its new messages as
context (never trained) and its sampled tokens (trained). A request that does not (the agent
rebuilt its messages, or the chat template renders history otherwise than before: a thinking
model's dropping earlier reasoning) is trained as a sequence of its own: its whole context, then
its sampled tokens, in the same row but attending only to each other, at positions from 0
(RolloutBatch.sequence_ids), so its log-probs are those it was sampled with. The rollout's tokens
share its one advantage and count as one completion in the loss, as a multi-turn rollout's turns
do. Such requests are counted in `agents/new_sequences`.

A failed rollout (the agent raised, exceeded `rollout.agent_timeout`, made no request, or returned
something that is not a reward) gets no reward (None: advantage 0, no part in its group's
statistics). It is counted in `agents/failed` and its record, error (`agent_error`) included, is
in failures.jsonl at the step it happens (rundir/monitor.py); a step in
which every rollout failed, FAILED_STEPS times in a row, stops the run before its update. A request
the endpoint refused (another model's name, messages the template cannot render) is answered with
HTTP 400, which the `openai` client raises in the agent; it is counted in `agents/refused_requests`.
The token budget (`rollout.max_completion_length`) covers every token after the prompt, as in
multi-turn rollouts: once spent, a request is answered at once with no tokens and finish reason
"length".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpokit.engines.batch import RolloutBatch, SamplingParams
from grpokit.engines.prompts import PromptEncoder
from grpokit.engines.protocols import AgentsEngine
from grpokit.rollouts.conversation import Conversation, RolloutTokens, sequences_batch
from grpokit.rollouts.endpoint import Endpoint, MODEL_NAME
from grpokit.rollouts.tool_formats import Replies
from grpokit.rollouts.tools import EnvironmentFailed
from grpokit.rollouts.transcript import Transcript
from grpokit.runtime import user_code
from grpokit.runtime import distributed
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.settings.schema import RolloutConfig


# A rollout that asked nothing has nothing to train. A framework's cache that leaves the base URL
# out of its key (DSPy's, by default) answers a second run's agents this way, from the first run.
NO_REQUEST = ("made no request to its endpoint (an agent answered from a cache makes none: turn the framework's "
              "cache off, e.g. dspy.LM(..., cache=False))")


@dataclass
class AgentOutcome:
    """How one rollout's agent ended: what reward functions see as its `environment`."""

    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)  # named rewards, as returned (logged as agent/<name>)
    error: str | None = None  # why it failed
    refused: int = 0  # requests the endpoint refused
    problems: tuple[str, ...] = ()  # malformed tool calls in its replies (endpoint.py)
    new_sequences: int = 0  # requests trained as a sequence of their own (not extending the one before)
    sequences: list[str] = field(default_factory=list)  # with new_sequences: each sequence trained from it, as text


def find_agent(name: str):
    """The agent rollout.agent names, checked (check_agent): ConfigError naming the setting."""
    agent = user_code.find(f"rollout.agent {name!r}", name)
    check_agent(agent, name)
    return agent


def check_agent(agent, name: str) -> None:
    """`agent` takes (client, model, row): ConfigError naming rollout.agent `name` otherwise."""
    try:
        inspect.signature(agent).bind(None, None, None)
    except TypeError as e:
        raise ConfigError(f"rollout.agent {name!r} must take (client, model, row): {e}") from None
    except ValueError:  # a callable whose signature cannot be read: called as it is
        pass


def import_openai():
    try:
        import fastapi  # noqa: F401 - the endpoint's
        import openai
        import uvicorn  # noqa: F401
    except ImportError:
        raise StartupError("rollout.agent needs the openai client and an HTTP server: pip install 'grpokit[agents]'") \
            from None
    return openai


# Steps in a row in which every rollout's agent failed that stop a run.
FAILED_STEPS = 3
# An async agent that holds the event loop this long at once (a blocking call inside it, or in a
# task it or its framework started) is named; a heartbeat on the loop measures it, every HEARTBEAT_S.
BLOCKED_S = 1.0
HEARTBEAT_S = 0.05


class AgentWarning(UserWarning):
    """What the console says about the agents: a step's failed rollouts (the first error), an async
    agent that blocks the loop the others run on."""


class Agents:
    """The rollout kind of agents (kinds.RolloutKind): each rollout one run of the user's agent."""

    def __init__(self, agent, name: str, tokenizer, eos_ids: list[int], timeout: float | None, encoder: PromptEncoder,
                 replies: Replies | None = None):
        """encoder: the run's prompts as token ids (a rollout whose agent sent nothing is its prompt);
        replies: how a reply is read (tool_formats.Replies; default: as the template says)."""
        check_agent(agent, name)
        # A plain `def` gets a blocking client and a thread of its own, so that the rollouts still
        # run (and send their requests) together.
        self.sync = not user_code.is_async(agent)
        self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=4096, thread_name_prefix="grpokit-agent") \
            if self.sync else None
        self.openai = import_openai()
        self.agent, self.name, self.tokenizer, self.eos_ids = agent, name, tokenizer, list(eos_ids)
        self.timeout, self.encoder, self.replies = timeout, encoder, replies
        # One endpoint per thread that generates: with rollout.max_staleness, the pipeline's worker
        # generates the steps ahead while an evaluation generates in the trainer's thread.
        self.endpoints: dict[int, Endpoint] = {}
        self.http = None  # the HTTP client every rollout's openai client shares (made on the user code's loop)
        self.waits = _Waits()  # each rollout's time in requests (rollout.agent_timeout does not count it)
        self.longest_held = 0.0  # the longest the agents' loop was held at once while they ran (named once a run)
        self.warned_blocking = False
        self.failed_in_a_row = 0  # steps in a row in which every rollout's agent failed

    @classmethod
    def from_config(cls, r: RolloutConfig, tokenizer, eos_ids, encoder: PromptEncoder,
                    replies: Replies | None = None) -> Agents:
        """The agents of rollout.agent, with the rollout section's timeout."""
        return cls(find_agent(r.agent), r.agent, tokenizer, eos_ids, r.agent_timeout, encoder, replies)

    @staticmethod
    def rewards(tools=None) -> tuple:
        """The reward function agents bring (RewardSet's `extra`): each rollout's returned reward."""

        def agent(environments, log_metric, log_extra, **kwargs):
            for name in sorted({n for e in environments for n in e.rewards}):
                values = [e.rewards[name] for e in environments if name in e.rewards]
                log_metric(f"agent/{name}", sum(values) / len(values))
            if any(e.error for e in environments):  # its record says why a rollout failed (failures.jsonl)
                log_extra("agent_error", [e.error for e in environments])
            if any(e.problems for e in environments):  # and what the model wrote that was no tool call
                log_extra("tool_call_problems", [list(e.problems) for e in environments])
            if any(e.new_sequences for e in environments):  # the completion shows the last sequence alone
                log_extra("sequences", [e.sequences for e in environments])
            return [e.reward for e in environments]

        return (("agent", agent),)

    @property
    def endpoint(self) -> Endpoint:
        """This thread's endpoint (started on first use)."""
        thread = threading.get_ident()
        if thread not in self.endpoints:
            self.endpoints[thread] = Endpoint(self.tokenizer, self.eos_ids, replies=self.replies)
        return self.endpoints[thread]

    def metrics(self, batch: RolloutBatch, num_rows: int, rows_per_update: int) -> dict[str, float]:
        """Over all processes' rollouts: requests per rollout, failed rollouts, refused requests and
        requests trained as sequences of their own (the module docstring)."""
        per_rollout = torch.tensor([[c.turns, c.environment.error is not None, c.environment.refused,
                                     c.environment.new_sequences] for c in batch.conversations], dtype=torch.float64)  # (n, 4)
        turns, failed, refused, new_sequences = distributed.gather_rows(per_rollout, num_rows, rows_per_update).T  # (N,) each
        self.failed_in_a_row = self.failed_in_a_row + 1 if bool(failed.all()) else 0
        if self.failed_in_a_row >= FAILED_STEPS:  # (the same count on every process: each stops)
            first = next((c.environment.error for c in batch.conversations if c.environment.error), "")
            raise EnvironmentFailed(f"every rollout's agent ({self.name!r}) failed in {self.failed_in_a_row} steps in a "
                                    f"row, the last for instance: {first}. failures.jsonl has every agent_error")
        return {"turns/mean": turns.mean().item(), "agents/failed": failed.sum().item(),
                "agents/refused_requests": refused.sum().item(), "agents/new_sequences": new_sequences.sum().item()}

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
        if self.http is not None:
            user_code.submit(self.http.close_shared(), "the agents' HTTP client").result(timeout=10)

    # ------------------------------------------------------------------ sampling

    def generate(self, engine, examples: list, counts: list[int], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutBatch:
        """counts[i] rollouts of examples[i] (those of one example contiguous), seeds[r]: rollout r's.
        The requests reach the rollout servers' own OpenAI routes when the engine has them
        (rollout.engine=server: server.py), else this thread's endpoint in front of `engine`."""
        rows = [e for e, count in zip(examples, counts) for _ in range(count)]
        outcomes = [AgentOutcome() for _ in rows]
        if isinstance(engine, AgentsEngine):
            reading = ("auto", "auto") if self.replies is None else (self.replies.format.name, self.replies.reasoning.kind)
            urls = engine.open_agents(counts, params, seeds, self.tokenizer.chat_template, reading)
            # The servers' endpoints are remote: the wait is timed on the agents' client.
            runs = self._start(urls, rows, outcomes, [functools.partial(self.waits.of, url) for url in urls])
            reported = set()
            while len(reported) < len(runs):
                concurrent.futures.wait([runs[r] for r in range(len(runs)) if r not in reported],
                                        return_when=concurrent.futures.FIRST_COMPLETED)
                ended = [r for r, run in enumerate(runs) if run.done() and r not in reported]
                engine.agents_finished(ended)
                reported.update(ended)
            transcripts = [Transcript.from_record(t, self.tokenizer, self.eos_ids) for t in engine.close_agents()]
        else:
            endpoint = self.endpoint
            transcripts = endpoint.open(len(rows), params)
            urls = [endpoint.base_url(r) for r in range(len(rows))]
            # Timed by the endpoint, whatever client the agent's framework makes from its URL.
            runs = self._start(urls, rows, outcomes, [t.waited for t in transcripts])
            for run in runs:
                run.add_done_callback(lambda _: endpoint.notify())
            endpoint.generate_rounds(engine, params, seeds, lambda: {r for r, run in enumerate(runs) if not run.done()})
        for run in runs:
            run.result()  # an exit of the user's code (UserCodeExit) stops the run; other errors are outcomes
        self.waits.forget(urls)
        batch = self._batch(rows, transcripts, outcomes)
        self._say(outcomes)
        return batch

    def _say(self, outcomes: list[AgentOutcome]) -> None:
        """On the console: a generation's failed rollouts (the first error), and, once a run, an
        async agent that held the loop every rollout's agent runs on."""
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            warnings.warn(AgentWarning(f"{len(failed)} of {len(outcomes)} rollouts' agents ({self.name!r}) failed, the "
                                       f"first: {failed[0]} (every agent_error is in failures.jsonl)"), stacklevel=2)
        if self.longest_held > BLOCKED_S and not self.warned_blocking:
            self.warned_blocking = True
            warnings.warn(AgentWarning(
                f"rollout.agent {self.name!r} held the event loop every rollout's agent runs on for {self.longest_held:.1f} s at "
                "once: a blocking call inside an async def, or in a task it or its framework started (a framework's "
                "synchronous run(), time.sleep, requests), so the other rollouts and their requests waited for it. "
                "Await the framework's async call, wrap the "
                "blocking one in asyncio.to_thread, or make the agent a plain def (each then runs in a thread of its "
                "own)"), stacklevel=2)

    def _start(self, urls: list[str], rows: list, outcomes: list[AgentOutcome],
               waited: list[Callable[[], float]]) -> list[concurrent.futures.Future]:
        """Each rollout's agent, running on the user code's loop, its client on its base URL;
        waited[r]: the seconds rollout r's requests have waited for generation so far."""
        runs = [user_code.submit(self._run(url, e, outcome, wait), f"rollout.agent {self.name!r}")
                for url, e, outcome, wait in zip(urls, rows, outcomes, waited)]
        if not self.sync:
            user_code.submit(self._watch(runs), f"rollout.agent {self.name!r}")
        return runs

    async def _watch(self, runs: list[concurrent.futures.Future]) -> None:
        """While `runs` go on, how late a heartbeat on their loop wakes: the longest the loop was held
        at once (longest_held), by an agent's own code or by any task it or its framework started."""
        while not all(run.done() for run in runs):
            start = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)
            self.longest_held = max(self.longest_held, time.monotonic() - start - HEARTBEAT_S)

    async def _run(self, base_url: str, example, outcome: AgentOutcome, waited: Callable[[], float]) -> None:
        if self.http is None:  # an openai client making its own HTTP client takes ~25 ms: a second a step
            self.http = _shared_http(self.openai, self.waits)
        client = self.openai.AsyncOpenAI(base_url=base_url, api_key="grpokit", max_retries=0, http_client=self.http)
        row = {"prompt": example.prompt, **example.columns}
        try:
            if self.sync:
                running = asyncio.get_running_loop().run_in_executor(self.threads, self._run_sync, base_url, row)
            else:
                running = self.agent(client, MODEL_NAME, row)
            result = await _within(running, self.timeout, waited)
        except asyncio.TimeoutError:
            outcome.error = (f"did not return within rollout.agent_timeout={self.timeout:g} s of its own time (its "
                             "requests' wait for generation not counted)")
        except user_code.UserCodeExit:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: counted and recorded, the step goes on
            outcome.error = f"raised {type(e).__name__}: {e}"
        else:
            _take_reward(result, outcome)
        finally:
            await client.close()

    def _run_sync(self, base_url: str, row: dict):
        """A plain `def` agent, in a worker thread, with a blocking client on its rollout's URL."""
        with self.openai.OpenAI(base_url=base_url, api_key="grpokit", max_retries=0,
                                http_client=_timed(self.openai.DefaultHttpxClient, self.waits)()) as client:
            return self.agent(client, MODEL_NAME, row)

    def _batch(self, rows: list, transcripts: list[Transcript], outcomes: list[AgentOutcome]) -> RolloutBatch:
        """One row per rollout: its first request's sequence, extended by the requests that extend
        it, and a sequence of its own for each request that does not (module docstring)."""
        sequences = []
        for example, t, outcome in zip(rows, transcripts, outcomes):
            chain = t.exchanges
            outcome.refused, outcome.new_sequences = len(t.errors), sum(not e.extends for e in chain[1:])
            outcome.problems = tuple(t.problems)
            if not chain and outcome.error is None:
                outcome.error = NO_REQUEST
            if outcome.error is not None:
                outcome.reward, outcome.rewards = None, {}
            conversation = Conversation(_messages(t), turns=len(chain), failures=int(outcome.error is not None),
                                        failed=outcome.error is not None,
                                        stop="length" if chain and chain[-1].finish == "length" else "answer",
                                        environment=outcome, prompt=t.first_messages or example.prompt)
            if chain:
                sequence = RolloutTokens(chain[0].prompt, {}, conversation, finish=chain[-1].finish)
                for previous, exchange in zip([None, *chain], chain):
                    if previous is not None and exchange.extends:
                        sequence.add(exchange.prompt[len(previous.prompt) + len(previous.sampled):], False)
                    elif previous is not None:
                        sequence.begin_sequence(exchange.prompt)
                    sequence.add(exchange.sampled, True, exchange.logps, exchange.entropies)
                if sequence.sequence:  # (one sequence: the record's completion is all of it)
                    outcome.sequences = [self.tokenizer.decode(ids) for ids in sequence.sequence_tokens()]
            else:  # nothing sampled: the row's one token is context, never trained
                prompt = self.encoder.messages(example.prompt)
                sequence = RolloutTokens(prompt, {}, conversation, finish="stop")
                sequence.add(self.eos_ids[:1], False)
            sequences.append(sequence)
        return sequences_batch(sequences, self.tokenizer.pad_token_id)


def _shared_http(openai, waits: _Waits):
    """The openai client's default HTTP client, which an agent's `client.close()` (or `async with
    client`) leaves open for the other rollouts; closed with the Agents. Its requests are timed
    (`waits`)."""
    class Shared(_timed(openai.DefaultAsyncHttpxClient, waits)):
        async def aclose(self) -> None:
            pass

        async def close_shared(self) -> None:
            await super().aclose()

    try:  # no cap on connections: a round waits for every running agent's request (openai's own: 1,000)
        from openai._constants import DEFAULT_CONNECTION_LIMITS as limits
        return Shared(limits=type(limits)(max_connections=None, max_keepalive_connections=limits.max_keepalive_connections))
    except (ImportError, AttributeError, TypeError):
        return Shared()


class _Waits:
    """Seconds each rollout (its URL's `/r/<id>/`) spent in requests to its endpoint, one under
    way included: rollout.agent_timeout counts an agent's own time, not the wait for generation
    (a round of every rollout's requests, or a long reply)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done: dict[str, float] = {}
        self.since: dict[str, list[float]] = {}

    def forget(self, urls: list[str]) -> None:
        """Drop the times of these rollouts (their generation is over; another may be under way)."""
        with self.lock:
            for key in map(self._key, urls):
                self.done.pop(key, None)

    @staticmethod
    def _key(url) -> str:
        """The rollout's URL up to its id (`http://host:port/r/<generation>-<rollout>`): servers
        number their generations each on its own."""
        before, _, after = str(url).partition("/r/")
        return f"{before}/r/{after.partition('/')[0]}"

    @contextlib.contextmanager
    def timing(self, url):
        key, start = self._key(url), time.monotonic()
        with self.lock:
            self.since.setdefault(key, []).append(start)
        try:
            yield
        finally:
            with self.lock:
                self.since[key].remove(start)
                if not self.since[key]:
                    del self.since[key]
                self.done[key] = self.done.get(key, 0.0) + time.monotonic() - start

    def of(self, url) -> float:
        key, now = self._key(url), time.monotonic()
        with self.lock:
            return self.done.get(key, 0.0) + sum(now - t for t in self.since.get(key, ()))


def _timed(client_class, waits: _Waits):
    """An httpx client class (sync or async, as `client_class`) whose requests `waits` times."""
    if asyncio.iscoroutinefunction(client_class.send):
        class Timed(client_class):
            async def send(self, request, *args, **kwargs):
                with waits.timing(request.url):
                    return await super().send(request, *args, **kwargs)
    else:
        class Timed(client_class):
            def send(self, request, *args, **kwargs):
                with waits.timing(request.url):
                    return super().send(request, *args, **kwargs)
    return Timed


async def _within(running, timeout: float | None, waited):
    """`running`'s result, or asyncio.TimeoutError once it has run `timeout` seconds beside
    `waited()` (the seconds its requests spent waiting)."""
    task = asyncio.ensure_future(running)
    if timeout is None:
        return await task
    start = time.monotonic()
    try:
        while not task.done():
            left = timeout + waited() - (time.monotonic() - start)
            if left <= 0:
                task.cancel()
                await asyncio.wait({task})  # its cleanup runs before the rollout counts as ended
                raise asyncio.TimeoutError
            await asyncio.wait({task}, timeout=left)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def _messages(t: Transcript) -> list[dict]:
    """The trained sequence's messages after its prompt: the last chat request's, then its reply."""
    last = t.last_messages or []
    first = t.first_messages or []
    after = last[len(first):] if last[:len(first)] == first else last
    return [*after, *([t.last_reply] if t.last_reply is not None else [])]


def _take_reward(result, outcome: AgentOutcome) -> None:
    """An agent's return value as its outcome's reward (a number, None, or a dict of numbers)."""
    def number(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    if hasattr(result, "reward") and hasattr(result, "parts"):  # a reward and its logged parts (tasks/verifiers.py)
        outcome.reward, outcome.rewards = float(result.reward), dict(result.parts)
    elif result is None or number(result):
        outcome.reward = None if result is None else float(result)
    elif isinstance(result, dict) and result and all(isinstance(k, str) and number(v) for k, v in result.items()):
        outcome.rewards = {k: float(v) for k, v in result.items()}
        outcome.reward = sum(outcome.rewards.values())
    else:
        outcome.error = (f"returned {str(result)[:80]!r}: an agent returns its reward (a finite number, or None), "
                         "or a dict of named rewards")
