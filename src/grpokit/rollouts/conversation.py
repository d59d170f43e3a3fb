"""Multi-turn rollouts: the model and its tools in conversation, on top of any engine.

A rollout is the prompt, then model segments (sampled, trained) and tool segments (the tools'
results as the chat template renders them: never sampled, never trained), interleaved until the
model answers without a tool call, `rollout.max_turns` model turns were taken, or the token budget
(`rollout.max_completion_length`, every token after the prompt) is spent (finish reason "length").

Each model turn is one engine generation over the whole context so far, given as token ids: model
tokens stay exactly as sampled, never decoded and encoded again (which can change them). The
batch's `completion_mask` covers every token after the prompt, the context its log-probs are
computed in; its `trained_mask` only the model's tokens.

Turn k of completion i samples from its own seed, derived from seeds[i] and k: what a rollout
samples depends neither on the other rollouts of its batch nor on the process or engine.

A tool segment is the text the chat template puts between the end of an assistant turn and the
start of the next one: it is found by rendering a stand-in conversation with and without the tool
results, so that any template that can express tools works (a stand-in turn with reasoning where
the template renders a last turn otherwise: a thinking model's).

Some templates render the history otherwise once a turn follows (Qwen3's drops an earlier turn's
empty think block; others drop earlier reasoning). Before each next turn, the conversation is
rendered as the template would: where that is not the context so far followed by the tool
segment, the next turn is sampled in the context the template renders, a sequence of its own
(RolloutBatch.sequence_ids) that begins with the prompt's tokens it shares (sequence_prefix), so
every turn is trained in exactly the context it was sampled in, and the shared prefix is computed
once. A turn's text is read by the run's Replies (tool_formats.py): its reasoning apart from its
answer, its tool calls in the model family's format.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from grpokit.engines.batch import RolloutBatch, SamplingParams, consecutive_groups, from_completions
from grpokit.engines.prompts import PromptEncoder, encode_prompt
from grpokit.rollouts.tool_formats import Replies
from grpokit.rollouts.tools import ToolResult, Tools, call_message
from grpokit.runtime import distributed
from grpokit.runtime.errors import ConfigError

# Why a rollout ended: the model answered without a tool call, it used its last turn, or the budget ran out.
STOPS = ("answer", "max_turns", "length")
_MARK = "\u2063grpokit-assistant\u2063"  # stand-in assistant text, found again in the rendering


@dataclass
class Conversation:
    """One rollout after its prompt, as reward functions and completions.jsonl see it."""

    messages: list[dict]  # assistant turns ({"content", "tool_calls"}) and tool results ({"name", "content"})
    turns: int = 0  # model turns
    calls: int = 0  # tool calls, the malformed ones included
    failures: int = 0  # calls that raised, timed out, named no tool, or were malformed
    stop: str = "answer"  # one of STOPS
    environment: object | None = field(default=None, repr=False, compare=False)
    prompt: list[dict] | None = None  # the prompt as the model saw it (with the text reset() appended)
    failed: bool = False  # the rollout as a whole failed (an agent raised, timed out, asked nothing): no reward


@dataclass
class RolloutTokens:
    """A rollout as it is sampled: its prompt, then every token after it."""

    prompt: list[int]
    tools: dict
    conversation: Conversation
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    trained: list[int] = field(default_factory=list)  # 1 on model tokens
    logps: list[float] = field(default_factory=list)
    entropies: list[float] | None = field(default_factory=list)
    finish: str = "stop"
    sequence_ids: list[int] = field(default_factory=list)  # which sequence each token is of (RolloutBatch.sequence_ids)
    prefix: list[int] = field(default_factory=list)  # the prompt tokens its sequence begins with (sequence_prefix)
    sequence: int = 0  # the sequence tokens are added to
    shared: int = 0  # the prompt tokens that sequence begins with (a later sequence's)
    start: int = 0  # where in `ids` that sequence begins
    history: list[dict] = field(default_factory=list)  # the conversation after the prompt, as the template takes it
    rendered: str | None = None  # the context the last turn was sampled in, as the template renders it
    cut: int = 0  # the tokens data.max_prompt_length cut off the prompt's front

    def add(self, ids: list[int], trained: bool, logps=None, entropies=None) -> None:
        self.ids += ids
        self.trained += [int(trained)] * len(ids)
        self.sequence_ids += [self.sequence] * len(ids)
        self.prefix += [self.shared] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)
        if self.entropies is not None:  # (an agent's request after its budget is spent samples nothing: ids [])
            unmeasured = trained and entropies is None and ids
            self.entropies = None if unmeasured else self.entropies + (entropies or [0.0] * len(ids))

    def begin_sequence(self, context: list[int], shared: int = 0) -> None:
        """A sequence of its own from here: `context` (never trained), then what is added after it;
        the tokens before it are not in its context, but the prompt's first `shared`, which it
        begins with (and `context` goes on from)."""
        self.sequence += 1
        self.shared, self.start = shared, len(self.ids)
        self.add(context, False)

    def context(self) -> list[int]:
        """What the next turn is sampled after: the prompt and every token after it, or a later
        sequence's shared prompt tokens and its own."""
        return self.prompt + self.ids if self.sequence == 0 else self.prompt[:self.shared] + self.ids[self.start:]

    def sequence_tokens(self) -> list[list[int]]:
        """Each sequence's tokens in order: the first's prompt, a later one's shared part of it
        (`prefix`), then its own tokens."""
        out = []
        for k in range(self.sequence + 1):
            first = self.sequence_ids.index(k) if k else 0
            out.append((self.prompt if k == 0 else self.prompt[:self.prefix[first]]) +
                       [t for t, s in zip(self.ids, self.sequence_ids) if s == k])
        return out

    def spent(self) -> int:
        """The tokens of the current sequence after the prompt (rollout.max_completion_length's count)."""
        return len(self.ids) - self.start


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a rollout's turn `turn` (turn 0: the rollout's own seed)."""
    return (seed + turn * 0x9E3779B97F4A7C15) % 2**62


def turn_segment(tokenizer, messages: list[dict], tools: list[dict] | None, after_eos: int | None) -> list[int]:
    """Token ids of `messages` (tool results, a user's turn) as the chat template renders them
    after an assistant turn, up to the next assistant turn's start; after_eos: the EOS id the
    assistant's turn ended with (the model sampled that part itself)."""
    def render(conversation: list[dict], add_generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    for turn in ({"role": "assistant", "content": _MARK}, {"role": "assistant", "content": _MARK,
                                                           "reasoning_content": "?"}):
        stand_in = [{"role": "user", "content": "?"}, turn]
        base, full = render(stand_in), render([*stand_in, *messages], add_generation_prompt=True)
        if full.startswith(base):  # (a template that renders a last turn otherwise, unless it reasoned: Qwen3's)
            break
    else:  # at start-up for tools (MultiTurn probes it); an agent's own messages tell later
        raise ConfigError("the chat template renders an assistant turn differently once tool results follow it; "
                          "grpokit cannot tell where the tool results start: set model.chat_template to one that "
                          "does not (for example grpokit's chatml_tools.jinja)")
    closing = base[base.rindex(_MARK) + len(_MARK):]  # what ends an assistant turn, e.g. "<|im_end|>\n"
    if after_eos is not None:
        eos_text = tokenizer.decode([after_eos])
        if closing.startswith(eos_text):
            closing = closing[len(eos_text):]
    return tokenizer(closing + full[len(base):], add_special_tokens=False)["input_ids"]


class MultiTurn:
    """The rollout kind of conversations with tools or an environment (kinds.RolloutKind)."""

    def __init__(self, tokenizer, tools: Tools, max_turns: int, eos_ids: list[int], encoder: PromptEncoder,
                 replies: Replies | None = None):
        """encoder: the run's prompts as token ids, with the tools' schemas (data.max_prompt_length);
        replies: how a turn is read (rollout.tool_call_format, model.reasoning_parser; default auto)."""
        self.tokenizer = tokenizer
        self.replies = replies or Replies.of(tokenizer)
        self.tools = tools
        self.max_turns = max_turns
        self.eos_ids = set(eos_ids)
        self.encoder = encoder
        self.tool_segment([{"role": "tool", "name": "tool", "content": "?"}], None)  # a template it fails on fails now

    @staticmethod
    def rewards(tools: Tools) -> tuple:
        """The reward functions the tools bring (RewardSet's `extra`): the environment's get_reward, if any."""
        return Tools.rewards(tools)

    def close(self) -> None:
        pass

    def metrics(self, batch: RolloutBatch, num_rows: int, rows_per_update: int) -> dict[str, float]:
        """Tool use over all processes' conversations: calls and failed calls (raised, timed out,
        unknown or malformed) per rollout and in all, model turns, and the share of rollouts that
        used their last turn (the budget's share is completions/clipped_ratio)."""
        per_rollout = torch.tensor([[c.calls, c.failures, c.turns, c.stop == "max_turns"] for c in batch.conversations],
                                   dtype=torch.float64)  # (n, 4)
        calls, failures, turns, max_turns = distributed.gather_rows(per_rollout, num_rows, rows_per_update).T  # (N,) each
        return {
            "tools/calls_per_rollout": calls.mean().item(),
            "tools/failures": failures.sum().item(),
            "tools/failures_per_rollout": failures.mean().item(),
            "turns/mean": turns.mean().item(),
            "turns/max_turns_ratio": max_turns.mean().item(),
        }

    def tool_segment(self, results: list[dict], after_eos: int | None) -> list[int]:
        return turn_segment(self.tokenizer, results, self.tools.schemas, after_eos)

    def generate(self, engine, examples: list, counts: list[int], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutBatch:
        """counts[i] rollouts of examples[i] (those of one example contiguous), seeds[r]: rollout r's."""
        rollouts = []
        for example, count in zip(examples, counts):
            if isinstance(example.prompt, str):  # only the row tells (a task's stream gives it at its step)
                raise ConfigError("multi-turn rollouts (rollout.tools, rollout.environment) need chat prompts: "
                                  "set data.chat_template=true, or give prompts as lists of messages")
            for _ in range(count):
                environment, appended = self.tools.start({"prompt": example.prompt, **example.columns})
                messages = [dict(m) for m in example.prompt]
                if appended:  # TRL's rule: reset's text is appended to the last message of the prompt
                    messages[-1]["content"] += appended
                rollout = RolloutTokens(self.encoder.messages(messages), self.tools.callables(environment),
                                        Conversation([], environment=environment, prompt=messages))
                if self.encoder.max_length is not None:  # the front it lost, which a new sequence's loses too
                    whole = encode_prompt(self.encoder.tokenizer, messages, None, self.encoder.schemas)
                    rollout.cut = len(whole) - len(rollout.prompt)
                rollouts.append(rollout)
        # Rollouts in a row with the same prompt (all of a group, unless reset() told them apart)
        # share one prefill.
        prompts, counts = consecutive_groups([r.prompt for r in rollouts])
        budget = params.max_tokens
        active = list(range(len(rollouts)))
        for turn in range(self.max_turns):
            if not active:
                break
            room = [budget - rollouts[r].spent() for r in active]
            turn_params = replace(params, max_tokens=max(room))
            turn_seeds = None if seeds is None else [turn_seed(int(seeds[r]), turn) for r in active]
            if turn == 0:
                batch = engine.generate(prompts, counts, turn_params, turn_seeds)
            else:
                batch = engine.generate([rollouts[r].context() for r in active], 1, turn_params, turn_seeds)
            active = [r for j, r in enumerate(active) if self._take_turn(rollouts[r], batch, j, room[j], turn, budget)]
        return sequences_batch(rollouts, self.tokenizer.pad_token_id)

    def _take_turn(self, rollout: RolloutTokens, batch: RolloutBatch, row: int, room: int, turn: int, budget: int) -> bool:
        """Add row `row` of `batch` as `rollout`'s model turn, run its tool calls and add their
        results; whether the rollout goes on."""
        c = rollout.conversation
        n = int(batch.completion_mask[row].sum())
        finish = batch.finish_reasons[row]
        if n > room:  # the engine was asked for the longest room of the turn's rollouts
            n, finish = room, "length"
        ids = batch.completion_ids[row, :n].tolist()
        entropies = None if batch.entropies is None else batch.entropies[row, :n].tolist()
        rollout.add(ids, True, batch.sampling_logps[row, :n].tolist(), entropies)
        c.turns += 1
        message, calls, problems = self.replies.read(self.replies.text(ids))
        if calls:
            message["tool_calls"] = [call_message(call) for call in calls]
        c.messages.append(message)
        # (GPT-OSS's template reads an earlier turn's reasoning as `thinking`)
        rollout.history.append({**message, "thinking": message["reasoning_content"]} if "reasoning_content" in message
                               else message)
        if finish == "length":
            rollout.finish, c.stop = "length", "length"
            return False
        if not calls and not problems:
            c.stop = "answer"
            return False
        if turn == self.max_turns - 1:  # its calls are not run: the model would have no turn to read them
            c.stop = "max_turns"
            return False
        results = [self.tools.call(rollout.tools, call) for call in calls]
        results += [ToolResult("error", problem, failed=True) for problem in problems]
        c.calls += len(results)
        c.failures += sum(r.failed for r in results)
        segment = self.tool_segment([r.message() for r in results], ids[-1] if ids and ids[-1] in self.eos_ids else None)
        context = self._rendered_otherwise(rollout, [r.message() for r in results])
        if context is None:  # after the turn: the tool segment, in the budget's room left
            needed, room, shared = len(segment), budget - rollout.spent(), 0
        else:  # a sequence of its own, after the prompt tokens it shares: a budget of its own
            shared = _common(context, rollout.prompt)
            needed, room = len(context) - shared, budget
        if needed >= room:  # no room left for the model to read them: the rollout ends
            rollout.finish, c.stop = "length", "length"
            c.messages += self._cut(c, results, room - 1 - (needed - self._tokens(results)))
            return False
        if context is None:
            rollout.add(segment, False)
        else:  # the next turn in the context the template renders
            rollout.begin_sequence(context[shared:], shared)
        c.messages += [r.record() for r in results]
        rollout.history += [r.message() for r in results]
        return True

    def _rendered_otherwise(self, rollout: RolloutTokens, results: list[dict]) -> list[int] | None:
        """The token ids of the conversation so far as the template renders it, with the generation
        prompt, where that is not the context the turn was sampled in, followed by the turn and
        `results` (its tool results): the template renders the history otherwise (the module
        docstring). None where it is that context (checked on the rendered text, as the agents'
        transcript does)."""
        def render(messages: list[dict], prompt: bool) -> str:
            return self.tokenizer.apply_chat_template([*rollout.conversation.prompt, *messages], tools=self.tools.schemas,
                                                      tokenize=False, add_generation_prompt=prompt)

        before = rollout.rendered if rollout.rendered is not None else render([], True)
        rendered = render([*rollout.history, *results], True)
        rollout.rendered = rendered
        if rendered.startswith(before) and rendered.startswith(render(rollout.history, False)):
            return None
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"][rollout.cut:]  # as the prompt was cut

    def _tokens(self, results: list[ToolResult]) -> int:
        return sum(len(self.tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in results)

    def _cut(self, c: Conversation, results: list[ToolResult], room: int) -> list[dict]:
        """The `tool` messages of a turn whose results did not fit the token budget, as recorded: in
        turn, those that fit in the `room` tokens left for their texts (the template's own tokens
        aside) whole; each that does not, cut there (empty once the room is spent), marked
        `truncated` and counted as a failure: the model never read it."""
        messages = []
        for r in results:
            ids = self.tokenizer(r.text, add_special_tokens=False)["input_ids"]
            if len(ids) <= room:
                messages.append(r.record())
            else:
                c.failures += not r.failed
                messages.append({**r.message(), "content": self.tokenizer.decode(ids[:max(room, 0)]), "truncated": True})
            room -= len(ids)
        return messages

def _common(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sequences_batch(rollouts: list[RolloutTokens], pad_id: int) -> RolloutBatch:
    """The batch of `rollouts` (those in a row with the same prompt sharing it): every token after
    the prompt in completion_mask, the model's in trained_mask."""
    prompts, counts = consecutive_groups([r.prompt for r in rollouts])
    batch = from_completions(prompts, counts, [
        {"token_ids": r.ids, "logprobs": r.logps, "entropies": r.entropies, "finish_reason": r.finish}
        for r in rollouts], pad_id)
    trained = torch.zeros_like(batch.completion_mask)  # (N, T)
    for i, r in enumerate(rollouts):
        trained[i, : len(r.trained)] = torch.tensor(r.trained, dtype=torch.long)
    batch.trained_mask, batch.conversations = trained, [r.conversation for r in rollouts]
    if any(r.sequence for r in rollouts):  # some row holds several sequences
        batch.sequence_ids = torch.zeros_like(batch.completion_mask)  # (N, T)
        for i, r in enumerate(rollouts):
            batch.sequence_ids[i, : len(r.sequence_ids)] = torch.tensor(r.sequence_ids, dtype=torch.long)
    if any(any(r.prefix) for r in rollouts):  # some later sequence begins with its prompt's tokens
        batch.sequence_prefix = torch.zeros_like(batch.completion_mask)  # (N, T)
        for i, r in enumerate(rollouts):
            batch.sequence_prefix[i, : len(r.prefix)] = torch.tensor(r.prefix, dtype=torch.long)
    return batch
