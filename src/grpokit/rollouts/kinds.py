"""The kinds of rollout: one protocol, three implementations, and the one choice between them.

    SingleTurn   one engine generation per completion (the default)
    MultiTurn    a conversation with tools or an environment (conversation.py)
    Agents       the user's agent, through the run's OpenAI-compatible endpoint (agents.py)

A kind turns prompts into rollouts with an engine (`generate`), brings the reward functions its
rollouts carry (`rewards`: an environment's get_reward, an agent's returned reward), and says what
its rollouts did (`metrics`: tool calls, turns, failed agents) over all processes. Whatever asks
for rollouts (sampling/sampler.py, sampling/evaluation.py) asks a kind, never which kind it is; a
new kind of rollout is a class here, chosen in `kind_of` and built in `make_kind`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from grpokit.engines.batch import RolloutBatch, SamplingParams
from grpokit.engines.prompts import PromptEncoder, images_of
from grpokit.rollouts.agents import Agents
from grpokit.rollouts.conversation import MultiTurn
from grpokit.rollouts.tool_formats import Replies
from grpokit.rollouts.tools import Tools
from grpokit.settings.schema import RolloutConfig


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
    def rewards(tools: Tools | None) -> tuple:
        return ()

    def generate(self, engine, examples: list, counts: list[int], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutBatch:
        return engine.generate([self.encoder(e) for e in examples], counts, params, seeds,
                               **images_of(examples, self.encoder.vision))

    def metrics(self, batch: RolloutBatch, num_rows: int, rows_per_update: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def kind_of(rollout: RolloutConfig, tools: Tools | None) -> type[SingleTurn] | type[MultiTurn] | type[Agents]:
    """The kind of a run's rollouts: an agent's (rollout.agent), conversations with its tools or
    environment (Tools.from_config), or single generations."""
    return Agents if rollout.agent is not None else MultiTurn if tools is not None else SingleTurn


def make_kind(rollout: RolloutConfig, tokenizer, tools: Tools | None, encoder: PromptEncoder, eos_ids: list[int],
              reasoning_parser: str | None = None) -> RolloutKind:
    """The run's rollout kind (`kind_of`), built for `tokenizer` and a model of EOS ids `eos_ids`
    (`reasoning_parser`: model.reasoning_parser)."""
    kind = kind_of(rollout, tools)
    replies = Replies.of(tokenizer, rollout.tool_call_format, reasoning_parser)
    if kind is Agents:
        return Agents.from_config(rollout, tokenizer, eos_ids, encoder, replies)
    if kind is MultiTurn:
        return MultiTurn(tokenizer, tools, rollout.max_turns, eos_ids, encoder, replies)
    return SingleTurn(encoder)
