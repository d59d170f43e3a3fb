"""The default engine: sampling with the policy itself, in the training process.

The engine holds the policy module, so it always generates with the current weights. Each prompt
is run through the model once; its key/value cache is then repeated for its n completions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from grpokit.logprobs import position_ids
from grpokit.rollout import RolloutBatch, SamplingParams


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) of softmax(logits (B, V))."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row from logits (B, V).

    Returns tokens (B,), their log-probs under the sampling distribution (B,), and the entropy of
    the tempered, unfiltered distribution (B,) (the policy's, as the trainer sees it).
    """
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), entropy(logits.float())
    logits = logits.float() / params.temperature
    policy_entropy = entropy(logits)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), policy_entropy


class TransformersEngine:
    def __init__(self, model, pad_id: int, eos_ids: list[int]):
        self.model = model
        self.pad_id = pad_id
        self.eos_ids = torch.tensor(eos_ids)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int | Sequence[int],
        params: SamplingParams,
        generator: torch.Generator,
    ) -> RolloutBatch:
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            return self._generate(prompts, n, params, generator)
        finally:
            model.train(was_training)

    def _generate(self, prompts, n, params, generator) -> RolloutBatch:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        prompt_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            prompt_ids[i, width - len(p) :] = torch.tensor(p)
            prompt_mask[i, width - len(p) :] = 1
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)

        cache = DynamicCache()
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids(prompt_mask),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # The completions of a prompt share its prefill: index the cache instead of recomputing.
        counts = torch.tensor([n] * len(prompts) if isinstance(n, int) else list(n))  # (P,)
        prompt_index = torch.repeat_interleave(torch.arange(len(prompts)), counts)  # (N,)
        index = prompt_index.to(device)
        cache.batch_select_indices(index)
        logits = out.logits[:, -1][index]  # (N, V)
        prompt_ids, prompt_mask = prompt_ids[index], prompt_mask[index]  # (N, Lp)
        N = prompt_ids.shape[0]

        eos_ids = self.eos_ids.to(device)
        attn = prompt_mask
        next_pos = prompt_mask.sum(-1)  # (N,)
        finished = torch.zeros(N, dtype=torch.bool, device=device)
        tokens, logps, entropies, masks = [], [], [], []
        for _ in range(params.max_tokens):
            tok, lp, ent = sample_next(logits, params, generator)
            alive = ~finished
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
            tokens.append(tok)
            logps.append(torch.where(alive, lp, torch.zeros_like(lp)))
            entropies.append(torch.where(alive, ent, torch.zeros_like(ent)))
            masks.append(alive)
            finished = finished | torch.isin(tok, eos_ids)
            if bool(finished.all()):
                break
            attn = torch.cat([attn, torch.ones((N, 1), dtype=attn.dtype, device=device)], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1]

        completion_ids = torch.stack(tokens, dim=1)  # (N, T)
        completion_mask = torch.stack(masks, dim=1).long()  # (N, T)
        return RolloutBatch(
            prompt_index=prompt_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            sampling_logps=torch.stack(logps, dim=1),
            entropies=torch.stack(entropies, dim=1),
            finish_reasons=["stop" if f else "length" for f in finished.tolist()],
        )
