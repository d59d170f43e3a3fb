"""What both decoders of the transformers engine share: drawing a token (`sample_next`), the
completions being decoded (`Decoded`), and the questions every process of a sharded model answers
together (`all_ended`, `longest`)."""

from __future__ import annotations

import torch

from grpokit.engines.batch import RolloutBatch, SamplingParams
from grpokit.models.vision import IMAGE_TOKEN
from grpokit.runtime import distributed


Top = tuple[torch.Tensor, torch.Tensor] | None  # the most likely tokens' log-probs and ids, (B, k) each


def sample_next(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Top]:
    """Draw one token per row from logits (B, V), by inverse CDF of one uniform (B,) per row.

    The sampling distribution: softmax(logits / temperature), then top-k, top-p and min-p (in
    transformers' order), renormalised. Returns tokens (B,), their log-probs under it (B,), the
    entropy of the tempered, unfiltered distribution (B,) (the policy's, as the trainer sees it),
    and, with params.top_logprobs = k > 0, the k most likely tokens under the sampling distribution
    (an agent's request's alternatives: -inf where a filter dropped them), else None.
    """
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), _entropy_of(logprobs), _top(logprobs, params)
    # Few (B, V) float32 temporaries at a time (in place where the arithmetic is the same): on a
    # GPU, with a large vocabulary, they are most of a decoding step's memory.
    logits = logits.float().div_(params.temperature) if logits.dtype != torch.float32 else logits / params.temperature
    unfiltered = torch.log_softmax(logits, dim=-1)  # (B, V)
    policy_entropy = _entropy_of(unfiltered)
    top_k = 0 < params.top_k < logits.shape[-1]
    if not (top_k or params.top_p < 1.0 or params.min_p > 0):  # no filter: the sampling distribution is the policy's
        del logits
        return _inverse_cdf(unfiltered, uniforms) + (policy_entropy, _top(unfiltered, params))
    del unfiltered
    if top_k:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        # Last, as transformers' MinPLogitsWarper: drop p < min_p * max p. The bound is relative to
        # the most likely token, so the renormalisation by top-k/top-p before does not move it.
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    del logits
    return _inverse_cdf(logprobs, uniforms) + (policy_entropy, _top(logprobs, params))


def _top(logprobs: torch.Tensor, params: SamplingParams) -> Top:
    """The params.top_logprobs largest of `logprobs` (B, V) and their ids, (B, k) each; None for k = 0."""
    if params.top_logprobs == 0:
        return None
    values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[-1]), dim=-1)
    return values, ids


def _entropy_of(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) of the distribution whose log-probs are `logprobs` (B, V)."""
    return -(logprobs.exp().mul_(logprobs)).sum(-1)


def _inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logprobs` (B, V), the first whose CDF exceeds its uniform (B,), and its log-prob."""
    cdf = logprobs.exp().cumsum_(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1), ~1
    # Strictly below the total, the first entry of the CDF above x is a token of positive probability.
    x = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (B, 1)
    tokens = torch.searchsorted(cdf, x, right=True).squeeze(-1)  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def all_ended(left: int, lockstep: bool, device: torch.device) -> bool:
    """Whether no completion is `left` to decode; with sharded weights (lockstep), on every process:
    each decodes until all are done, since every forward call is a collective."""
    if lockstep:
        left = int(distributed.all_reduce(torch.tensor(left, device=device)))
    return left == 0


def longest(count: torch.Tensor, lockstep: bool) -> int:
    """The most tokens any completion has (counts (N,)); with sharded weights, any process's."""
    longest = count.max()
    if lockstep:
        longest = distributed.all_reduce(longest, "max")
    return int(longest)


class Decoded:
    """The completions being decoded: each one's tokens so far, their log-probs and the entropies
    they were sampled from, and whether it has ended."""

    def __init__(self, N: int, T: int, pad_id: int, eos_ids: torch.Tensor, device: torch.device,
                 image_ids: torch.Tensor | None = None):
        """T: the most tokens a completion has; image_ids: a vision-language model's image token,
        which ends a completion too."""
        self.pad_id, self.eos_ids, self.image_ids, self.T = pad_id, eos_ids, image_ids, T
        self.finished = torch.zeros(N, dtype=torch.bool, device=device)  # (N,) an EOS (or image token) was sampled
        self.imaged = torch.zeros(N, dtype=torch.bool, device=device)  # (N,) an image token was sampled
        self.count = torch.zeros(N, dtype=torch.long, device=device)  # (N,) tokens each completion has
        self.tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)  # (N, T), padding after the end
        self.logps = self.entropies = None  # (N, T) each, made with the first tokens (in their dtype)
        self.top_logps = self.top_ids = None  # (N, T, k) each with params.top_logprobs = k > 0 (sample_next)
        self.masks = torch.zeros((N, T), dtype=torch.bool, device=device)  # (N, T)
        self.positions = N  # token positions run through the model for these completions: the prompts' last, then each step's
        self.width = T  # the columns of the batch: the most tokens a completion has (the decoder sets it)

    def done(self, rows: torch.Tensor) -> torch.Tensor:
        """Whether completions `rows` (n,) have ended (n,): an EOS, an image token or T tokens."""
        return self.finished[rows] | (self.count[rows] >= self.T)

    def add(self, tok: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor, top, rows: torch.Tensor) -> torch.Tensor:
        """Record the next token (n,) of completions `rows` (n,), its log-prob, entropy and top
        alternatives (sample_next); a completion that had ended records nothing. Returns the
        tokens, the pad id for those."""
        if self.logps is None:
            self.logps = torch.zeros(self.tokens.shape, dtype=lp.dtype, device=lp.device)
            self.entropies = torch.zeros(self.tokens.shape, dtype=ent.dtype, device=ent.device)
            if top is not None:
                self.top_logps = torch.full((*self.tokens.shape, top[0].shape[-1]), float("-inf"), dtype=lp.dtype,
                                            device=lp.device)
                self.top_ids = torch.zeros(self.top_logps.shape, dtype=torch.long, device=lp.device)
        alive = ~self.done(rows)  # (n,)
        tok = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
        rows, at = rows[alive], self.count[rows][alive]  # (a,)
        self.tokens[rows, at], self.logps[rows, at], self.entropies[rows, at] = tok[alive], lp[alive], ent[alive]
        self.masks[rows, at] = True
        if top is not None:
            self.top_logps[rows, at], self.top_ids[rows, at] = top[0][alive], top[1][alive]
        self.count[rows] += 1
        ended = torch.isin(tok[alive], self.eos_ids)
        if self.image_ids is not None:
            image = torch.isin(tok[alive], self.image_ids)
            self.imaged[rows] |= image
            ended |= image
        self.finished[rows] |= ended
        return tok

    def batch(self, prompt_index: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> RolloutBatch:
        """The completions decoded, (N, width) each, after their prompts."""
        w = self.width
        return RolloutBatch(
            prompt_index=prompt_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=self.tokens[:, :w],
            completion_mask=self.masks[:, :w].long(),
            sampling_logps=self.logps[:, :w],
            entropies=self.entropies[:, :w],
            finish_reasons=[IMAGE_TOKEN if i else "stop" if f else "length"
                            for f, i in zip(self.finished.tolist(), self.imaged.tolist())],
            top_logps=None if self.top_logps is None else self.top_logps[:, :w],
            top_ids=None if self.top_ids is None else self.top_ids[:, :w],
        )
