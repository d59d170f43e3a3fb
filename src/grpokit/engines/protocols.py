"""The engine protocols, the contract between the engines and their callers, and the registry of
engines (ENGINES); tests/engines/test_protocols.py checks every engine against those it must satisfy.

    RolloutEngine   what the trainer asks of every engine of ENGINES
    PipelineEngine  a RolloutEngine that generates ahead of training (rollout.max_staleness > 0):
                    the server engine
    ServedEngine    what `grpokit serve` asks of the engine it serves (the engines not `remote`)
    AgentsEngine    a RolloutEngine whose servers host the agents' OpenAI routes themselves
                    (rollouts/agents.py): the server engine

To add an engine: a class with the protocols' attributes and methods, in a module of this folder,
registered in ENGINES.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch

from grpokit.engines.batch import RolloutBatch, SamplingParams
from grpokit.settings.schema import RolloutConfig


@runtime_checkable
class RolloutEngine(Protocol):
    """Everything training asks of an engine (sampling/sampler.py; sampling/evaluation.py, rollouts/
    and the CLI use a part): every engine of ENGINES is one. Each is built from the
    config by its `from_config`.

    An engine is used from one thread at a time: the trainer's, or the pipeline's worker
    (sampling/pipeline.py) when generation runs ahead of training."""

    # The engine's log-probs come from the trainer's own code (no importance-sampling correction
    # needed). Read from the engine made: it may depend on what the engine connected to.
    exact_logprobs: bool
    # The engine measures the entropy of each sampled token's distribution (RolloutBatch.entropies;
    # vLLM does not). Read from the engine made, as exact_logprobs.
    measures_entropies: bool
    # Generation happens in another process that only the trainer's process 0 talks to: that
    # process generates the whole step and shares it; the other processes make no engine. Read
    # from the class (engine_class), before any engine is made; `grpokit serve` serves only the
    # engines that are not remote (a server cannot serve a server).
    remote: ClassVar[bool]

    @classmethod
    def from_config(cls, rollout: RolloutConfig, model, tokenizer, eos_ids: list[int], model_name: str,
                    lockstep: bool, vision=None) -> RolloutEngine:
        """The engine of `rollout` (config.rollout) for the trainer's `model`. `lockstep`: the model's
        weights are sharded, so every process makes every forward call (training/sharding.py). `vision`: a
        vision-language model's vision.Vision."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        n: int | Sequence[int],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        images: list[tuple] | None = None,
    ) -> RolloutBatch:
        """`n` completions of every prompt, or n[i] of prompt i (a process of a data-parallel run
        may own only part of a group). Completion i samples from its own random stream, seeded by
        seeds[i] (one seed per completion; not needed when greedy): what a completion samples does
        not depend on the batch or the process it is generated in. `images`: a vision-language
        model's, each prompt's images (a tuple of PIL images, maybe empty), which the returned
        batch carries per completion (RolloutBatch.images)."""
        ...

    def weights_updated(self) -> None:
        """The policy changed (an optimizer step): generate with the new weights from now on."""
        ...

    def needs_weights(self) -> bool:
        """Whether the next generation must be handed the policy's whole weights (`use_weights`)
        because the engine cannot read them from the policy module: a sharded policy's weights
        are whole only when gathered, a collective every process takes part in."""
        ...

    def use_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """The policy's whole weights, (name, tensor) as sharding.full_weights gives them, to
        generate with from the next generation on."""
        ...

    def sleep(self) -> None:
        """The trainer is about to update: free what the engine holds that the update could use."""
        ...

    def close(self) -> None:
        """The run is over: release connections and groups."""
        ...


@runtime_checkable
class PipelineEngine(RolloutEngine, Protocol):
    """A RolloutEngine that can generate ahead of training (rollout.max_staleness > 0, sampling/pipeline.py):
    it samples in another process, so the steps queued ahead generate while the trainer trains,
    and it says which weights each generation was sampled with. The config accepts
    rollout.max_staleness > 0 with rollout.engine=server alone: ServerEngine (client.py).

    The pipeline uses it from its worker thread only, in the order the schedule queued the work:
    weight copies (`use_weights`) and generations (`generate`, then `weights_step`)."""

    # The trainer step of the weights the last `generate` sampled with, as the generating side
    # reports it (the `step` of the `use_weights` they came from); None: not labelled (weights
    # not handed over by `use_weights`, or a server too old to say). The pipeline reads it right
    # after each generation and stops the run when it is not the schedule's.
    weights_step: int | None

    def use_weights(self, weights: list[tuple[str, torch.Tensor]], step: int | None = None) -> None:
        """Generate with `weights`, (name, tensor), from the next generation on: a sharded policy's
        gathered weights (RolloutEngine.use_weights), or the pipeline's host copy of the weights
        after trainer step `step`, with which later generations are labelled (`weights_step`)."""
        ...

    def push(self, weights: list[tuple[str, torch.Tensor]], step: int) -> None:
        """rollout.in_flight_updates: send the weights after trainer step `step` now, from the
        pipeline's push thread, into the generation in flight (engines/in_flight.py)."""
        ...


@runtime_checkable
class AgentsEngine(RolloutEngine, Protocol):
    """A RolloutEngine whose rollout servers host the OpenAI-compatible routes of an agents'
    generation themselves (server.py), so that the agents' requests reach the servers directly;
    rollouts/agents.py uses the trainer's own endpoint in front of any other engine. The server engine:
    ServerEngine (client.py)."""

    def open_agents(self, counts: list[int], params: SamplingParams, seeds: Sequence[int] | None,
                    chat_template: str | None, reading: tuple[str, str] = ("auto", "auto")) -> list[str]:
        """Open a generation of counts[i] rollouts of prompt i (seeds[r]: rollout r's), their
        messages rendered with `chat_template` (None: the model's own), the replies read with
        `reading` (rollout.tool_call_format, model.reasoning_parser): each rollout's base URL.
        It says which weights it samples with (PipelineEngine.weights_step), as `generate` does."""
        ...

    def agents_finished(self, rollouts: list[int]) -> None:
        """These rollouts' agents have returned: the generation's rounds stop waiting for them."""
        ...

    def close_agents(self) -> list[dict]:
        """Every rollout's record of what its agent sent and got (transcript.Transcript.record), in
        rollout order, once all have finished."""
        ...


@runtime_checkable
class ServedEngine(Protocol):
    """What `grpokit serve` (server.py) asks of the engine it serves: the RolloutEngines that are
    not `remote` (transformers, vllm), and vLLM spread over several replicas (DataParallelVLLM).
    The server, not a trainer, owns it: its weights arrive as pushes (`load_weights`), checked by
    checksum, rather than read from a policy module. The server calls it under one lock: a
    generation and a weight load never overlap."""

    # Where it computes. The server reports "cpu" or the CUDA device's id in /health, and a
    # trainer picks the weight transfer's backend (gloo or NCCL) from it.
    device: torch.device

    # Its RolloutEngine class in ENGINES builds it, from model.* and rollout.* with the parallel
    # sizes `grpokit serve` was given: classmethod served(m, rollout, tokenizer, vision,
    # tensor_parallel_size, data_parallel_size) -> (engine, model for the fingerprint, EOS ids).

    def generate(
        self,
        prompts: list[list[int]],
        n: int | Sequence[int],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """As RolloutEngine.generate, with the weights last loaded (or those it was built with)."""
        ...

    def weights_checksum(self) -> str | None:
        """The checksum (weights.checksum) of the weights it generates with, reported in /health;
        None where the engine cannot compute it before a load (vLLM keeps its own fused tensors)."""
        ...

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load the (name, tensor) pairs of a push as they arrive (`pairs` may be a generator over
        the transfer: one tensor in flight), and return the checksum of what it loaded, which
        the trainer compares with its own."""
        ...

    # It takes a LoRA trainer's adapters alone, put on the base it holds (`adapter_layout`,
    # `load_adapters`); else a LoRA trainer pushes it the merged weights (`load_weights`).
    takes_adapters: bool
    # Its generate takes `until`, `offsets` and `abandoned` (TransformersEngine.generate): stopped
    # between two decode steps and continued, so a weight push lands in the middle of a generation,
    # and stopped there when the request's client has gone (server.py).
    stops_between_tokens: bool

    def adapter_layout(self, settings: dict) -> list[list]:
        """Make the LoRA adapters of `settings` (models/loading.py adapter_settings) on the base it
        holds, unless the same are there; the layout (weights.layout) an adapter push of them must
        announce."""
        ...

    def load_adapters(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
        """As load_weights, for the adapters `adapter_layout` made: their checksum."""
        ...

    def close(self) -> None:
        """The server is stopping: end what the engine started (vLLM replicas' processes)."""
        ...


# rollout.engine -> the module and class of each engine, imported when chosen (vLLM's module is
# not imported by a run that does not use it).
ENGINES = {
    "transformers": "grpokit.engines.transformers_engine:TransformersEngine",
    "server": "grpokit.engines.client:ServerEngine",
    "vllm": "grpokit.engines.vllm_engine:VLLMEngine",
}


def engine_class(name: str) -> type[RolloutEngine]:
    import importlib

    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is not one of: {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(rollout: RolloutConfig, model, tokenizer, eos_ids: list[int], model_name: str, lockstep: bool = False,
                vision=None) -> RolloutEngine:
    """The engine rollout.engine names, for the trainer's `model` (see RolloutEngine.from_config)."""
    return engine_class(rollout.engine).from_config(rollout, model, tokenizer, eos_ids, model_name, lockstep, vision)

