"""Rollout engines: one protocol, several engines.

An engine turns tokenized prompts into G sampled completions each and reports, for every
completion, its tokens, its mask, why it ended and the log-probs it was sampled with. Nothing
downstream infers a mask from a pad id (the pad id of SmolLM2 *is* its EOS id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch


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


@dataclass
class RolloutBatch:
    """N completions; those of one prompt are contiguous, in the order of the prompts."""

    prompt_index: torch.Tensor  # (N,) which prompt of the request each completion continues
    prompt_ids: torch.Tensor  # (N, Lp) left-padded
    prompt_mask: torch.Tensor  # (N, Lp) 1 on prompt tokens
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) 1 on generated tokens, the EOS included
    sampling_logps: torch.Tensor  # (N, T) log-prob of each token under the sampling distribution
    entropies: torch.Tensor | None  # (N, T) entropy of the tempered policy distribution each token came from; None: not measured (vLLM)
    finish_reasons: list[str]  # "stop" (an EOS was sampled) or "length" (hit max_tokens)

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids, padding removed (TRL's `completion_ids` reward argument)."""
        return [ids[:n] for ids, n in zip(self.completion_ids.tolist(), self.completion_mask.sum(-1).tolist())]

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The completions `rows` (R,), in that order; `prompt_index` keeps naming the same prompts."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = [value[i] for i in rows.tolist()] if isinstance(value, list) else value[rows.to(value.device)]
        return RolloutBatch(**picked)


class RolloutEngine(Protocol):
    # The engine's log-probs come from the trainer's own code (no importance-sampling correction needed).
    exact_logprobs: bool
    # Generation happens in another process that only the trainer's process 0 talks to.
    remote: bool

    def weights_updated(self) -> None:
        """The policy changed (an optimizer step): generate with the new weights from now on."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        n: int | Sequence[int],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """`n` completions of every prompt, or n[i] of prompt i (a process of a data-parallel run
        may own only part of a group). Completion i samples from its own random stream, seeded by
        seeds[i] (one seed per completion; not needed when greedy): what a completion samples does
        not depend on the batch or the process it is generated in."""
        ...


def encode_prompt(tokenizer, prompt: list[dict] | str, max_length: int | None = None) -> list[int]:
    """Prompt token ids: chat messages through the chat template, plain text as it is; longer than
    `max_length` keeps the end (where the question and the generation prompt are)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_length:] if max_length is not None and len(ids) > max_length else ids


def decode_completions(tokenizer, batch: RolloutBatch, prompts: list) -> list:
    """Completions in TRL's shapes: [{"role": "assistant", "content": text}] after a chat prompt,
    the plain text after a plain-text prompt. prompts: the prompt of each completion."""
    lengths = batch.completion_mask.sum(-1).tolist()
    texts = [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(batch.completion_ids.tolist(), lengths)
    ]
    return [text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            for text, prompt in zip(texts, prompts)]


def make_engine(rollout, model, tokenizer, eos_ids: list[int], model_name: str, main: bool = True,
                lockstep: bool = False) -> RolloutEngine | None:
    """The engine of `rollout` (config.rollout) for the trainer's `model`. A server engine exists
    on process 0 alone (None elsewhere): only it talks to the server. `lockstep`: the model's
    weights are sharded, so every process makes every forward call (sharding.py)."""
    if rollout.engine == "transformers":
        from grpokit.rollout.transformers_engine import TransformersEngine

        return TransformersEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=eos_ids, lockstep=lockstep)
    if rollout.engine == "server":
        if not main:
            return None
        from grpokit.rollout.client import ServerEngine

        return ServerEngine(rollout.server_url, model, tokenizer.pad_token_id, rollout.server_timeout)
    if rollout.engine == "vllm":
        from grpokit.rollout.vllm_engine import VLLMEngine, model_path

        return VLLMEngine(model_path(model_name), str(next(model.parameters()).dtype).removeprefix("torch."),
                          tokenizer.pad_token_id, eos_ids, policy=model, sleep=rollout.vllm_sleep,
                          gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)
    raise ValueError(f"rollout.engine={rollout.engine!r} is not one of: transformers, server, vllm")
