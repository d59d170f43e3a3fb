"""A judge: a model behind an OpenAI-compatible chat-completions endpoint scores completions against
a rubric (`reward.functions=[judge]` and the reward.judge_* settings).

- `group` (the default, RULER's shape): the judge sees a prompt's completions together and gives
  one score each, relative to each other, which is what GRPO uses (differences within a group).
  The reply must be a JSON object {"scores": [s_1, ..., s_G]}, one number in [0, 1] per
  completion, in order.
- `single`: each completion alone; the reply {"score": s}.

Replies are parsed strictly: a reply that is not that JSON (code fences around it are allowed),
that scores fewer or more completions than asked, or a number out of range, is a failure, as are a
timeout and an HTTP error. A failure is retried (`judge_retries` times), then gives `None` to the
completions it covers (not 0: no part in their group's statistics), counted in `judge/failed`
(the share of the call's completions) and recorded with the raw reply in the completions' records
(the `judge` column: failures.jsonl at every step, completions.jsonl every monitor.log_completions). A group is a run of consecutive completions of one prompt, at most
rollout.num_generations long. Scores are cached by what was asked (the prompt, the completions in
their order, the rubric, the mode, the judge's model and temperature) in `<run>/judge_cache*.jsonl`,
so a resumed step asks the judge again for nothing it answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
from pathlib import Path

from grpokit.rewards.reward_set import completion_text
from grpokit.runtime import distributed

MODES = ("group", "single")
INSTRUCTIONS = {
    "group": ("You judge responses to one task by the rubric below. Score each response from 0 (worst) to 1 (best), "
              "comparing them with each other. Reply with JSON only, one score per response in their order: "
              '{{"scores": [{example}]}}'),
    "single": ("You judge a response to a task by the rubric below. Score it from 0 (worst) to 1 (best). Reply with "
               'JSON only: {"score": 0.5}'),
}
_FENCED = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class JudgeFailure(Exception):
    """A judge's answer that gives no score: its reason, and the raw reply (None: no reply)."""

    def __init__(self, reason: str, reply: str | None = None):
        super().__init__(reason)
        self.reason, self.reply = reason, reply


def parse(reply: str, count: int | None) -> list[float]:
    """The scores in judge reply `reply`: `count` of them ({"scores": [...]}), or one ({"score": s})
    when `count` is None. JudgeFailure when the reply is not exactly that."""
    text = reply.strip()
    fenced = _FENCED.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError:
        raise JudgeFailure("the reply is not JSON", reply) from None
    key = "score" if count is None else "scores"
    if not isinstance(value, dict) or key not in value:
        raise JudgeFailure(f"the reply has no {key!r}", reply)
    scores = [value[key]] if count is None else value[key]
    if not isinstance(scores, list):
        raise JudgeFailure("'scores' is not a list", reply)
    if count is not None and len(scores) != count:
        raise JudgeFailure(f"{len(scores)} scores for {count} responses", reply)
    for s in scores:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= 1:
            raise JudgeFailure(f"score {s!r} is not a number from 0 to 1", reply)
    return [float(s) for s in scores]


def rubric_text(rubric: str | None) -> str:
    """reward.judge_rubric: the text of a file it names, else itself."""
    if rubric is None:
        return "Is the response correct and helpful for the task?"
    path = Path(rubric)
    return path.read_text() if "\n" not in rubric and path.is_file() else rubric


def messages(rubric: str, prompt: str, responses: list[str], mode: str) -> list[dict]:
    """The judge's request: the instructions and rubric, then the task and the response(s)."""
    example = ", ".join(["0.5"] * len(responses))
    system = INSTRUCTIONS[mode].format(example=example) if mode == "group" else INSTRUCTIONS[mode]
    if mode == "group":
        shown = "\n\n".join(f"Response {i + 1}:\n{r}" for i, r in enumerate(responses))
    else:
        shown = f"Response:\n{responses[0]}"
    return [{"role": "system", "content": f"{system}\n\nRubric:\n{rubric}"},
            {"role": "user", "content": f"Task:\n{prompt}\n\n{shown}"}]


def _text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)


class Judge:
    """A judge's endpoint and settings (reward.judge_*), its cache, and the calls it makes."""

    def __init__(self, url: str, model: str, rubric: str | None, mode: str, timeout: float, retries: int,
                 concurrency: int, temperature: float, cache_dir: Path | None = None, group_size: int | None = None):
        self.url, self.model, self.mode = url.rstrip("/"), model, mode
        self.rubric = rubric_text(rubric)
        self.timeout, self.retries, self.temperature = timeout, retries, temperature
        self.concurrency, self.group_size = concurrency, group_size
        self.cache_dir = cache_dir
        self.cache: dict[str, list[float]] | None = None

    def _key(self, prompt: str, completions: list[str]) -> str:
        """What identifies a request's answer: all that was asked, and of whom."""
        asked = [prompt, completions, self.rubric, self.mode, self.model, self.temperature]
        return hashlib.sha256(json.dumps(asked).encode()).hexdigest()

    def _groups(self, prompts: list[str]) -> list[list[int]]:
        """The rows asked together: each one alone (single), or runs of one prompt of at most group_size."""
        if self.mode == "single":
            return [[i] for i in range(len(prompts))]
        groups: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            last = groups[-1] if groups else None
            if last and prompts[last[0]] == prompt and (self.group_size is None or len(last) < self.group_size):
                last.append(i)
            else:
                groups.append([i])
        return groups

    def _cached(self) -> dict[str, list[float]]:
        if self.cache is None:
            self.cache = {}
            for path in sorted(self.cache_dir.glob("judge_cache*.jsonl")) if self.cache_dir is not None else ():
                for line in path.read_text().splitlines():
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a kill: asked again
                        continue
                    self.cache[entry["key"]] = entry["scores"]
        return self.cache

    def _remember(self, key: str, scores: list[float]) -> None:
        self._cached()[key] = scores
        if self.cache_dir is not None:
            with (self.cache_dir / f"judge_cache.{distributed.rank()}.jsonl").open("a") as f:
                f.write(json.dumps({"key": key, "scores": scores}) + "\n")

    async def _ask(self, client, request: list[dict], count: int | None) -> tuple[list[float], str]:
        """Scores for one request, retried; JudgeFailure after the last try."""
        import httpx

        body = {"model": self.model, "messages": request, "temperature": self.temperature,
                "max_tokens": 64 + 16 * (count or 1)}
        failure = None
        for _ in range(self.retries + 1):
            try:  # the whole request within the timeout (the client's bounds each phase of it alike)
                response = await asyncio.wait_for(client.post(f"{self.url}/chat/completions", json=body), self.timeout)
                if response.status_code != 200:
                    raise JudgeFailure(f"HTTP {response.status_code}", response.text[:500])
                reply = response.json()["choices"][0]["message"]["content"] or ""
                return parse(reply, count), reply
            except JudgeFailure as e:
                failure = e
            except (httpx.TimeoutException, asyncio.TimeoutError):
                failure = JudgeFailure(f"no reply within reward.judge_timeout={self.timeout:g} s")
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                failure = JudgeFailure(f"{type(e).__name__}: {e}")
        raise failure

    async def score(self, prompts: list, completions: list, log_metric, log_extra) -> list[float | None]:
        """A score or None per completion (prompts[i]'s completions[i]); a prompt's completions are
        consecutive (a group)."""
        import httpx

        prompt_texts = [_text(p) for p in prompts]
        texts = [completion_text(c) for c in completions]
        scores: list[float | None] = [None] * len(texts)
        notes: list[dict | None] = [None] * len(texts)
        asks = []
        for rows in self._groups(prompt_texts):
            key = self._key(prompt_texts[rows[0]], [texts[i] for i in rows])
            cached = self._cached().get(key)
            if cached is None:
                asks.append((rows, key))
            for i, s in zip(rows, cached or ()):
                scores[i], notes[i] = s, {"cached": True}
        limit = asyncio.Semaphore(self.concurrency)

        async def one(rows: list[int], key: str) -> None:
            request = messages(self.rubric, prompt_texts[rows[0]], [texts[i] for i in rows], self.mode)
            async with limit:
                try:
                    got, reply = await self._ask(client, request, len(rows) if self.mode == "group" else None)
                except JudgeFailure as e:
                    for i in rows:
                        scores[i], notes[i] = None, {"error": e.reason, "reply": e.reply}
                    return
            self._remember(key, got)
            for i, s in zip(rows, got):
                scores[i], notes[i] = s, {"reply": reply}

        # httpx bounds each phase of a request by its own default, 5 s, unless told: a judge that
        # took longer to answer failed whatever reward.judge_timeout said.
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            await asyncio.gather(*(one(rows, key) for rows, key in asks))
        failed = sum(1 for n in notes if n is not None and "error" in n)
        log_metric("judge/failed", failed / max(1, len(texts)))
        log_extra("judge", notes)
        return scores


_JUDGES: dict[tuple, Judge] = {}


async def judge(prompts, completions, log_metric=None, log_extra=None, *, url: str, model: str,
                rubric: str | None = None, mode: str = "group", timeout: float = 60.0, retries: int = 2,
                concurrency: int = 8, temperature: float = 0.0, run=None, group_size: int | None = None, **columns):
    """The built-in `judge` reward: each completion's score from the judge (reward.judge_*), or
    None. run: the run's train settings, whose output_dir holds the cache (read when called: a
    default folder is named once the run starts)."""
    run_dir = getattr(run, "output_dir", None)
    settings = (url, model, rubric, mode, timeout, retries, concurrency, temperature, run_dir, group_size)
    if settings not in _JUDGES:
        _JUDGES[settings] = Judge(*settings[:-2], cache_dir=None if run_dir is None else Path(run_dir),
                                  group_size=group_size)
    noop = lambda *args: None  # noqa: E731 - called outside a run (no log)
    return await _JUDGES[settings].score(prompts, completions, log_metric or noop, log_extra or noop)
