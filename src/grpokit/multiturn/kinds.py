"""The kinds of rollout: one protocol, three implementations, and the one choice between them.

    SingleTurn   one engine generation per completion (the default)
    MultiTurn    a conversation with tools or an environment (conversation.py)
    Agents       the user's agent, through the run's OpenAI-compatible endpoint (agents.py)

A kind turns prompts into rollouts with an engine (`generate`), brings the reward functions its
rollouts carry (`rewards`: an environment's get_reward, an agent's returned reward), and says what
its rollouts did (`metrics`: tool calls, turns, failed agents) over all processes. Whatever asks
for rollouts (sampling/rollouts.py, sampling/evaluation.py) asks a kind, never which kind it is; a
new kind of rollout is a class here, chosen in `kind_of` and built in `make_kind`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from grpokit.multiturn.agents import Agents
from grpokit.multiturn.conversation import MultiTurn
from grpokit.multiturn.tool_formats import Replies
from grpokit.multiturn.tools import Tools
from grpokit.rollout.batch import RolloutBatch, SamplingParams
from grpokit.rollout.prompts import PromptEncoder, images_of


@runtime_checkable
class RolloutKind(Protocol):
    """How a run's rollouts are sampled and what they report (module docstring). Made by
    `make_kind` once the model is loaded (its EOS ids end a turn)."""

    def generate(self, engine, examples: list, counts: list[int], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutBatch:
        """counts[i] rollouts of examples[i] (tasks.Example; those of one example contiguous) with
        `engine` (a rollout engine), rollout r sampling from seeds[r] (None: greedy)."""
        ...

    def metrics(self, batch: RolloutBatch, num_rows: int, rows_per_update: int) -> dict[str, float]:
        """What this process's rollouts `batch` did, over every process's (a collective): the step
        holds num_rows rollouts, rows_per_update per optimizer update (distributed.gather_rows)."""
        ...

    def close(self) -> None:
        """The run is over: stop what the kind started (the agents' endpoints)."""
        ...


class SingleTurn:
    """One engine generation per completion, from the prompt's token ids (with a vision-language
    model's images)."""

    def __init__(self, encoder: PromptEncoder):
        self.encoder = encoder

    @staticmethod
    def rewards(config, tools: Tools | None) -> tuple:
        return ()

    def generate(self, engine, examples: list, counts: list[int], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutBatch:
        return engine.generate([self.encoder(e) for e in examples], counts, params, seeds,
                               **images_of(examples, self.encoder.vision))

    def metrics(self, batch: RolloutBatch, num_rows: int, rows_per_update: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def kind_of(config, tools: Tools | None) -> type[SingleTurn] | type[MultiTurn] | type[Agents]:
    """The kind of a run's rollouts: an agent's (rollout.agent), conversations with its tools or
    environment (Tools.from_config), or single generations."""
    return Agents if config.rollout.agent is not None else MultiTurn if tools is not None else SingleTurn


def make_kind(config, tokenizer, tools: Tools | None, encoder: PromptEncoder, eos_ids: list[int]) -> RolloutKind:
    """The run's rollout kind (`kind_of`), built for `tokenizer` and a model of EOS ids `eos_ids`."""
    kind = kind_of(config, tools)
    replies = Replies.of(tokenizer, config.rollout.tool_call_format, config.model.reasoning_parser)
    if kind is Agents:
        return Agents.from_config(config, tokenizer, eos_ids, encoder, replies)
    if kind is MultiTurn:
        return MultiTurn(tokenizer, tools, config.rollout.max_turns, eos_ids, encoder, replies)
    return SingleTurn(encoder)
