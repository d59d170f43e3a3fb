"""What an engine returns: a batch of sampled completions (`RolloutBatch`), the sampling settings
it is asked for (`SamplingParams`), and the helpers that build and read batches.

An engine turns tokenized prompts into G sampled completions each and reports, for every
completion, its tokens, its mask, why it ended and the log-probs it was sampled with. Nothing
downstream infers a mask from a pad id (the pad id of SmolLM2 *is* its EOS id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from grpokit.settings.schema import RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    min_p: float = 0.0  # 0 means no min-p filter
    # How many of the most likely tokens to report beside each sampled one (RolloutBatch.top_logprobs):
    # an agent's request's top_logprobs. Nothing sampled depends on it.
    top_logprobs: int = 0

    @classmethod
    def of(cls, rollout: RolloutConfig, greedy: bool = False) -> SamplingParams:
        """A run's sampling, as its config's `rollout` section says (training's, and `grpokit eval`'s
        with samples); greedy: an evaluation's (temperature 0)."""
        if greedy:
            return cls(rollout.max_completion_length, temperature=0.0)
        return cls(rollout.max_completion_length, rollout.temperature, rollout.top_p, rollout.top_k, rollout.min_p)


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
    # was sampled: models/vision.py)
    finish_reasons: list[str]
    # (N, T) 1 on the tokens the model sampled, which alone are trained: the loss, its normalizers,
    # the KL and the completion metrics count these. None: every completion token (single-turn).
    trained_mask: torch.Tensor | None = None
    conversations: list | None = None  # multi-turn rollouts: one conversation.Conversation each
    # A vision-language model's: each completion's prompt images (a tuple of PIL images, maybe empty).
    images: list | None = None
    # (N, T) which sequence of its row each completion token belongs to: 0 continues the prompt; k > 0
    # is the k-th of an agent's requests that began a sequence of their own (rollouts/agents.py), whose
    # tokens attend only to each other, at positions from 0 (models/logprobs.py). None: all continue the prompt.
    sequence_ids: torch.Tensor | None = None
    # (N, T) of each token of a later sequence (sequence_ids > 0), how many of its row's first prompt
    # tokens that sequence begins with: it attends to them, its positions after theirs, and they are
    # computed once for the row (a rollout's history that its chat template renders otherwise:
    # rollouts/conversation.py). 0: none, the sequence stands alone. None: 0 everywhere.
    sequence_prefix: torch.Tensor | None = None
    # With SamplingParams.top_logprobs = k > 0: the k most likely tokens at each sampled token's
    # position under the sampling distribution, their log-probs (N, T, k) (-inf where a filter
    # dropped one) and ids (N, T, k). None: not asked (training never asks).
    top_logps: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    # (N, T) the trainer step of the weights that sampled each token, where a weight push landed in
    # the middle of the generation (rollout.in_flight_updates: engines/in_flight.py). None: one
    # generation, one set of weights.
    versions: torch.Tensor | None = None

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

    def failed(self) -> torch.Tensor:
        """(n,) bool: the rollouts that failed as a whole (their conversation says so: an agent that
        raised, timed out or asked nothing), which get no reward whatever the reward functions say."""
        return torch.tensor([c.failed for c in self.conversations] if self.conversations is not None
                            else [False] * len(self.finish_reasons), dtype=torch.bool)

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
            if name in ("sequence_ids", "sequence_prefix") and any(v is not None for v in values):  # a batch without: 0
                values = [torch.zeros_like(b.completion_ids) if v is None else v for v, b in zip(values, batches)]
            if values[0] is None:
                return None
            if isinstance(values[0], list):
                return [x for v in values for x in v]
            if values[0].dim() == 1:
                return torch.cat(values)
            wide = width if left else length
            inner = (0, 0) * (values[0].dim() - 2)  # dimension 1 is padded, whatever follows it
            padded = [torch.nn.functional.pad(v, inner + ((wide - v.shape[1], 0) if left else (0, wide - v.shape[1])))
                      for v in values]  # zeros: masked out
            return torch.cat(padded)

        return RolloutBatch(**{f.name: joined(f.name, f.name in ("prompt_ids", "prompt_mask"))
                               for f in fields(RolloutBatch)})



@dataclass
class Completion:
    """One completion so far, generated in pieces (partial rollouts' rounds, sampling/partial.py;
    a server's segments between weight pushes, in_flight.py): its tokens, and each token's sampling
    log-prob, entropy (None where the engine does not measure them) and weights version."""

    tokens: list[int]
    logps: list[float]
    entropies: list[float] | None
    versions: list[int]
    finish: str | None = None  # once ended: "stop" (an EOS sampled) or "length" (its longest reached)

    def extend(self, batch: RolloutBatch, row: int, length: int, longest: int, version: int | None) -> None:
        """Append row `row` of `batch` (`length` tokens), its continuation, cut at `longest` tokens
        in all, each new token of weights `version` (or of batch.versions', where a server's
        generation took pushes in flight and tagged its tokens itself); it ends on an EOS (or
        another stop) within its room, or at `longest` tokens."""
        kept = min(length, longest - len(self.tokens))  # (a row with less room than its generation's is cut)
        self.tokens += batch.completion_ids[row, :kept].tolist()
        self.logps += batch.sampling_logps[row, :kept].tolist()
        self.entropies = None if batch.entropies is None or self.entropies is None else \
            self.entropies + batch.entropies[row, :kept].tolist()
        self.versions += [version] * kept if batch.versions is None else batch.versions[row, :kept].tolist()
        if batch.finish_reasons[row] != "length" and kept == length:
            self.finish = batch.finish_reasons[row]
        elif len(self.tokens) >= longest:
            self.finish = "length"


def decode_completions(tokenizer, batch: RolloutBatch, prompts: list, reasoning=None) -> list:
    """Completions in TRL's shapes: [{"role": "assistant", "content": text}] after a chat prompt
    (with `reasoning`, a models.reasoning.Reasoning, the content is the answer and the reasoning is
    apart: models/reasoning.py), the plain text after a plain-text prompt; a conversation's messages
    after its prompt (assistant turns with their tool calls, tool results). prompts: the prompt of
    each completion."""
    if batch.conversations is not None:
        return [c.messages for c in batch.conversations]
    lengths = batch.completion_mask.sum(-1).tolist()
    texts = [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(batch.completion_ids.tolist(), lengths)
    ]
    if reasoning is None or reasoning.kind == "none":
        return [text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
                for text, prompt in zip(texts, prompts)]
    if reasoning.kind == "harmony":  # its channels are special tokens
        texts = [tokenizer.decode(ids[:n]) for ids, n in zip(batch.completion_ids.tolist(), lengths)]
    return [text if isinstance(prompt, str) else [reasoning.split(text).message()] for text, prompt in zip(texts, prompts)]



def alternatives(ids: list[list[int]], logps: list[list[float]]) -> list[list[list]]:
    """Each token's alternatives (RolloutBatch.top_ids, top_logps: one completion's (T, k) as lists)
    as [[id, log-prob], ...], most likely first, those a filter dropped (-inf) left out."""
    return [[[i, lp] for i, lp in zip(row_ids, row_logps) if lp != float("-inf")] for row_ids, row_logps in zip(ids, logps)]


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
    finish_reason, top_logprobs where asked: each token's [[id, log-prob], ...], weights_steps
    where a server's generation took pushes in flight), those of prompt i being the counts[i] after those of the prompts before it:
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
    # Each token's alternatives, [[id, log-prob], ...] (SamplingParams.top_logprobs), where given.
    k = max((len(a) for c in completions for a in c.get("top_logprobs") or ()), default=0)
    top_logps = torch.full((N, T, k), float("-inf")) if k else None
    top_ids = torch.zeros((N, T, k), dtype=torch.long) if k else None
    for i, (p, c) in enumerate(zip(prompt_index.tolist(), completions)):
        prompt, k = prompts[p], len(c["token_ids"])
        prompt_ids[i, width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, width - len(prompt):] = 1
        completion_ids[i, :k] = torch.tensor(c["token_ids"], dtype=torch.long)
        completion_mask[i, :k] = 1
        logps[i, :k] = torch.tensor(c["logprobs"], dtype=torch.float32)
        if measured:
            entropies[i, :k] = torch.tensor(c["entropies"], dtype=torch.float32)
        for t, alternatives in enumerate(c.get("top_logprobs") or () if top_logps is not None else ()):
            for j, (token, logp) in enumerate(alternatives):
                top_ids[i, t, j], top_logps[i, t, j] = token, logp
    batch = RolloutBatch(prompt_index, prompt_ids, prompt_mask, completion_ids, completion_mask, logps, entropies,
                         [c["finish_reason"] for c in completions], top_logps=top_logps, top_ids=top_ids)
    if all(None not in c.get("weights_steps", [None]) for c in completions):  # a server's in flight: every token's
        batch.versions = torch.zeros((N, T), dtype=torch.long)
        for i, c in enumerate(completions):
            batch.versions[i, :len(c["weights_steps"])] = torch.tensor(c["weights_steps"], dtype=torch.long)
    if images is not None:
        batch.images = [images[i] for i in prompt_index.tolist()]
    return batch

