"""Rollout engines: their protocols, several engines (ENGINES), and what they share.

An engine turns tokenized prompts into G sampled completions each and reports, for every
completion, its tokens, its mask, why it ended and the log-probs it was sampled with. Nothing
downstream infers a mask from a pad id (the pad id of SmolLM2 *is* its EOS id).

    transformers_engine.py  sampling with the policy module itself, in the training process
    client.py               `grpokit serve` processes over HTTP (server.py), weights pushed to each
    vllm_engine.py          vLLM in the training process (GPU), or in a server (tensor / data parallel)
    pipeline.py             generation ahead of training (rollout.max_staleness), on top of an engine
    weights.py              naming, fingerprinting, checksumming and sending weights
    conversation.py         multi-turn rollouts (tools, environments) on top of any engine
    tools.py                tools and environments: loading, schemas, parsing and running calls

The protocols are the contract between the engines and their callers (tests/test_protocols.py
checks every engine against those it must satisfy):

    RolloutEngine   what the trainer asks of every engine of ENGINES
    PipelineEngine  a RolloutEngine that generates ahead of training (rollout.max_staleness > 0):
                    the server engine
    ServedEngine    what `grpokit serve` asks of the engine it serves (the engines not `remote`)
    AgentsEngine    a RolloutEngine whose servers host the agents' OpenAI routes themselves
                    (rollout/agents.py): the server engine

To add an engine: a class with the protocols' attributes and methods, registered in ENGINES.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol, runtime_checkable

import torch

from grpokit.errors import ConfigError


# A rollout server's answers (HTTP 409) to a request that expects other weights than it holds,
# and to a trainer whose place another trainer took.
STALE_WEIGHTS = "stale weights"
TAKEN_OVER = "another trainer joined this server's weight group since: one server serves one trainer"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    min_p: float = 0.0  # 0 means no min-p filter


@dataclass
class RolloutBatch:
    """N completions; those of one prompt are contiguous, in the order of the prompts."""

    prompt_index: torch.Tensor  # (N,) which prompt of the request each completion continues; on the CPU
    prompt_ids: torch.Tensor  # (N, Lp) left-padded
    prompt_mask: torch.Tensor  # (N, Lp) 1 on prompt tokens
    completion_ids: torch.Tensor  # (N, T) right-padded: every token after the prompt
    completion_mask: torch.Tensor  # (N, T) 1 on every token after the prompt (the context), the EOS included
    sampling_logps: torch.Tensor  # (N, T) log-prob of each sampled token under the sampling distribution; 0 elsewhere
    entropies: torch.Tensor | None  # (N, T) entropy of the tempered policy distribution each sampled token came from; None: not measured (vLLM)
    # "stop" (an EOS was sampled), "length" (hit max_tokens), or "image_token" (an image placeholder
    # was sampled: vision.py)
    finish_reasons: list[str]
    # (N, T) 1 on the tokens the model sampled, which alone are trained: the loss, its normalizers,
    # the KL and the completion metrics count these. None: every completion token (single-turn).
    trained_mask: torch.Tensor | None = None
    conversations: list | None = None  # multi-turn rollouts: one conversation.Conversation each
    # A vision-language model's: each completion's prompt images (a tuple of PIL images, maybe empty).
    images: list | None = None
    # (N, T) which sequence of its row each completion token belongs to: 0 continues the prompt; k > 0
    # is the k-th of an agent's requests that began a sequence of their own (rollout/agents.py), whose
    # tokens attend only to each other, at positions from 0 (logprobs.py). None: all continue the prompt.
    sequence_ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.trained_mask is None:
            self.trained_mask = self.completion_mask

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids, padding removed (TRL's `completion_ids` reward argument)."""
        return [ids[:n] for ids, n in zip(self.completion_ids.tolist(), self.completion_mask.sum(-1).tolist())]

    def prompts(self, examples: list) -> list:
        """Each completion's prompt as the model saw it: its conversation's (an environment's reset()
        may have added to it), else its example's (`examples`: one per completion)."""
        if self.conversations is None:
            return [e.prompt for e in examples]
        return [e.prompt if c.prompt is None else c.prompt for c, e in zip(self.conversations, examples)]

    def environments(self) -> list | None:
        """Each completion's environment instance (reward functions' `environments`), None without one."""
        if self.conversations is None or self.conversations[0].environment is None:
            return None
        return [c.environment for c in self.conversations]

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The completions `rows` (R,), in that order; `prompt_index` keeps naming the same prompts."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                picked[f.name] = None
            else:
                picked[f.name] = [value[i] for i in rows.tolist()] if isinstance(value, list) else value[rows.to(value.device)]
        return RolloutBatch(**picked)

    def to(self, device: torch.device) -> RolloutBatch:
        """The same completions with every tensor on `device`, but `prompt_index`, which indexes on
        the host (as every engine returns it)."""
        return RolloutBatch(**{f.name: getattr(self, f.name).to(device)
                               if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "prompt_index"
                               else getattr(self, f.name) for f in fields(self)})

    @staticmethod
    def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """The completions of `batches`, one after the other: prompts padded on the left and
        completions on the right to the widest (masked positions, whose values nothing reads);
        `prompt_index` as each batch had it."""
        width = max(b.prompt_ids.shape[1] for b in batches)
        length = max(b.completion_ids.shape[1] for b in batches)

        def joined(name: str, left: bool):
            values = [getattr(b, name) for b in batches]
            if name == "sequence_ids" and any(v is not None for v in values):  # a batch without: all continue the prompt
                values = [torch.zeros_like(b.completion_ids) if v is None else v for v, b in zip(values, batches)]
            if values[0] is None:
                return None
            if isinstance(values[0], list):
                return [x for v in values for x in v]
            if values[0].dim() == 1:
                return torch.cat(values)
            wide = width if left else length
            padded = [torch.nn.functional.pad(v, (wide - v.shape[1], 0) if left else (0, wide - v.shape[1]))
                      for v in values]  # zeros: masked out
            return torch.cat(padded)

        return RolloutBatch(**{f.name: joined(f.name, f.name in ("prompt_ids", "prompt_mask"))
                               for f in fields(RolloutBatch)})


@runtime_checkable
class RolloutEngine(Protocol):
    """Everything training asks of an engine (rollout/rollouts.py; evaluate.py, conversation.py
    and the CLI use a part): every engine of ENGINES is one. Each is built from the
    config by its `from_config`.

    An engine is used from one thread at a time: the trainer's, or the pipeline's worker
    (pipeline.py) when generation runs ahead of training."""

    # The engine's log-probs come from the trainer's own code (no importance-sampling correction
    # needed). Read from the engine made: it may depend on what the engine connected to.
    exact_logprobs: bool
    # Generation happens in another process that only the trainer's process 0 talks to: that
    # process generates the whole step and shares it; the other processes make no engine. Read
    # from the class (engine_class), before any engine is made; `grpokit serve` serves only the
    # engines that are not remote (a server cannot serve a server).
    remote: ClassVar[bool]

    @classmethod
    def from_config(cls, rollout, model, tokenizer, eos_ids: list[int], model_name: str,
                    lockstep: bool, vision=None) -> RolloutEngine:
        """The engine of `rollout` (config.rollout) for the trainer's `model`. `lockstep`: the model's
        weights are sharded, so every process makes every forward call (sharding.py). `vision`: a
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
    """A RolloutEngine that can generate ahead of training (rollout.max_staleness > 0, pipeline.py):
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


@runtime_checkable
class AgentsEngine(RolloutEngine, Protocol):
    """A RolloutEngine whose rollout servers host the OpenAI-compatible routes of an agents'
    generation themselves (server.py), so that the agents' requests reach the servers directly;
    agents.py uses the trainer's own endpoint in front of any other engine. The server engine:
    ServerEngine (client.py)."""

    def open_agents(self, counts: list[int], params: SamplingParams, seeds: Sequence[int] | None,
                    chat_template: str | None) -> list[str]:
        """Open a generation of counts[i] rollouts of prompt i (seeds[r]: rollout r's), their
        messages rendered with `chat_template` (None: the model's own): each rollout's base URL.
        It says which weights it samples with (PipelineEngine.weights_step), as `generate` does."""
        ...

    def agents_finished(self, rollouts: list[int]) -> None:
        """These rollouts' agents have returned: the generation's rounds stop waiting for them."""
        ...

    def close_agents(self) -> list[dict]:
        """Every rollout's record of what its agent sent and got (endpoint.Transcript.record), in
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

    def close(self) -> None:
        """The server is stopping: end what the engine started (vLLM replicas' processes)."""
        ...


# rollout.engine -> the module and class of each engine, imported when chosen (vLLM's module is
# not imported by a run that does not use it).
ENGINES = {
    "transformers": "grpokit.rollout.transformers_engine:TransformersEngine",
    "server": "grpokit.rollout.client:ServerEngine",
    "vllm": "grpokit.rollout.vllm_engine:VLLMEngine",
}


def engine_class(name: str) -> type[RolloutEngine]:
    import importlib

    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is not one of: {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(rollout, model, tokenizer, eos_ids: list[int], model_name: str, lockstep: bool = False,
                vision=None) -> RolloutEngine:
    """The engine rollout.engine names, for the trainer's `model` (see RolloutEngine.from_config)."""
    return engine_class(rollout.engine).from_config(rollout, model, tokenizer, eos_ids, model_name, lockstep, vision)


def encode_prompt(tokenizer, prompt: list[dict] | str, max_length: int | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids: chat messages through the chat template (with the `tools` schemas), plain
    text as it is; longer than `max_length` keeps the end (where the question and the generation
    prompt are)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_length:] if max_length is not None and len(ids) > max_length else ids


def prompt_ids(tokenizer, tools, example, max_length: int | None = None, vision=None) -> list[int]:
    """The token ids of `example`'s prompt (a tasks.Example) as the engines see it: with the tools'
    schemas (`tools`: a tools.Tools), and for a vision-language model (`vision`: a vision.Vision)
    through its processor, each image's tokens in place. Longer than `max_length` keeps the end
    (data.long_prompts=truncate; with "drop" no longer one is left); a prompt whose images' tokens
    would be cut is refused (the dataset refuses such rows first, naming them)."""
    schemas = None if tools is None else tools.schemas
    if vision is None:
        parts = not isinstance(example.prompt, str) and any(isinstance(m["content"], list) for m in example.prompt)
        if example.images or parts:
            what = f"{len(example.images)} image(s) (data column image / images)" if example.images else \
                "messages whose content is a list of parts"
            raise ConfigError(f"a prompt has {what}, and the model is a text model: train a vision-language model "
                              "on it (docs/vision.md), or give text content and no images "
                              f"(the prompt: {str(example.prompt)[:120]!r})")
        return encode_prompt(tokenizer, example.prompt, max_length, schemas)
    try:
        ids = vision.encode(example.prompt, example.images, schemas)
    except ValueError as e:  # e.g. the processor's image token written in the text: a place for a missing image
        raise ConfigError(f"the model's processor cannot encode the prompt: {e} (the prompt: "
                          f"{str(example.prompt)[:120]!r})") from None
    if max_length is not None and len(ids) > max_length:
        if vision.image_tokens(ids[:-max_length]):
            raise ValueError(f"a prompt of {len(ids)} tokens with {len(example.images)} image(s) is over "
                             f"data.max_prompt_length={max_length}, and an image's tokens are never cut")
        ids = ids[-max_length:]
    return ids


def check_images(images: list[tuple] | None, vision) -> None:
    """An engine of a vision-language model (its `vision`) is given each prompt's images, one of a
    text model none."""
    if (images is None) != (vision is None):
        raise ValueError("a vision-language model's engine takes each prompt's images (an empty tuple for none)"
                         if vision is not None else "a text model's engine takes no images")


def images_of(examples, vision) -> dict:
    """The `images` argument of an engine's generate for `examples` (tasks.Example): none for a
    text model, each prompt's images (a tuple, maybe empty) for a vision-language model."""
    return {} if vision is None else {"images": [e.images for e in examples]}


def decode_completions(tokenizer, batch: RolloutBatch, prompts: list) -> list:
    """Completions in TRL's shapes: [{"role": "assistant", "content": text}] after a chat prompt,
    the plain text after a plain-text prompt; a conversation's messages after its prompt (assistant
    turns with their tool calls, tool results). prompts: the prompt of each completion."""
    if batch.conversations is not None:
        return [c.messages for c in batch.conversations]
    lengths = batch.completion_mask.sum(-1).tolist()
    texts = [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(batch.completion_ids.tolist(), lengths)
    ]
    return [text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            for text, prompt in zip(texts, prompts)]


def group_counts(prompts: list, n: int | Sequence[int]) -> list[int]:
    """An engine's `n` as one completion count per prompt: n for each, or the counts given."""
    return [n] * len(prompts) if isinstance(n, int) else [int(k) for k in n]


def consecutive_groups(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Runs of identical prompts in a row (a group's completions): each run's prompt once, and the
    counts of the runs, in order: what an engine's generate takes to share one prefill per run."""
    unique, counts = [], []
    for prompt in prompts:
        if unique and prompt == unique[-1]:
            counts[-1] += 1
        else:
            unique.append(prompt)
            counts.append(1)
    return unique, counts


def from_completions(prompts: list[list[int]], counts: list[int], completions: list[dict], pad_id: int,
                     images: list[tuple] | None = None) -> RolloutBatch:
    """A RolloutBatch from per-completion lists (token_ids, logprobs, entropies or None,
    finish_reason), those of prompt i being the counts[i] after those of the prompts before it:
    what a server answers and what vLLM's outputs become. `images`: each prompt's (a
    vision-language model's), carried by each of its completions."""
    N = sum(counts)
    if len(completions) != N:
        raise ValueError(f"asked for {N} completions, got {len(completions)}")
    prompt_index = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(counts))  # (N,)
    width = max(len(p) for p in prompts)
    T = max(1, max(len(c["token_ids"]) for c in completions))
    prompt_ids = torch.full((N, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((N, width), dtype=torch.long)
    completion_ids = torch.full((N, T), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((N, T), dtype=torch.long)
    logps = torch.zeros((N, T))
    measured = all(c.get("entropies") is not None for c in completions)
    entropies = torch.zeros((N, T)) if measured else None
    for i, (p, c) in enumerate(zip(prompt_index.tolist(), completions)):
        prompt, k = prompts[p], len(c["token_ids"])
        prompt_ids[i, width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, width - len(prompt):] = 1
        completion_ids[i, :k] = torch.tensor(c["token_ids"], dtype=torch.long)
        completion_mask[i, :k] = 1
        logps[i, :k] = torch.tensor(c["logprobs"], dtype=torch.float32)
        if measured:
            entropies[i, :k] = torch.tensor(c["entropies"], dtype=torch.float32)
    batch = RolloutBatch(prompt_index, prompt_ids, prompt_mask, completion_ids, completion_mask, logps, entropies,
                         [c["finish_reason"] for c in completions])
    if images is not None:
        batch.images = [images[i] for i in prompt_index.tolist()]
    return batch


def split_groups(costs: list[int], k: int) -> list[list[int]]:
    """Indices of `costs` (one per prompt group, its expected tokens) in k shares of nearly equal
    cost: the costliest group first, each to the share with the least so far (ties: the lower
    share); each share in index order."""
    shares, loads = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(k), key=lambda j: (loads[j], j))
        shares[j].append(i)
        loads[j] += costs[i]
    return [sorted(s) for s in shares]


def split_generation(prompts: list[list[int]], counts: list[int], seeds: Sequence[int] | None, max_tokens: int,
                     k: int, among: list[int] | None = None) -> list[tuple[list[int], list[list[int]], list[int], list[int] | None]]:
    """The prompts `among` (default: all) of a generation, in k shares of whole prompt groups
    balanced by expected tokens (split_groups): each share's prompt indices, and its prompts,
    counts and seeds (None when greedy), what one engine of several is asked for. Shares may be empty."""
    among = list(range(len(prompts))) if among is None else among
    starts = [0, *itertools.accumulate(counts)]  # the completion index of each prompt's first
    shares = split_groups([counts[i] * (len(prompts[i]) + max_tokens) for i in among], k)
    out = []
    for share in shares:
        group = [among[j] for j in share]
        out.append((group, [prompts[i] for i in group], [counts[i] for i in group],
                    None if seeds is None else [int(seeds[c]) for i in group for c in range(starts[i], starts[i + 1])]))
    return out


def join_generation(prompts: list[list[int]], counts: list[int], answered: list[tuple[list[int], list[dict]]],
                    pad_id: int, images: list[tuple] | None = None) -> RolloutBatch:
    """from_completions over the answers to split_generation's shares (each: its prompt indices and
    their completions, in order), put back in the prompts' order."""
    by_prompt = {}
    for group, completions in answered:
        for i in group:
            by_prompt[i], completions = completions[:counts[i]], completions[counts[i]:]
    return from_completions(prompts, counts, [c for i in range(len(prompts)) for c in by_prompt[i]], pad_id, images)
