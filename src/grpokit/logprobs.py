"""Per-token log-probabilities of completions under a causal LM, with the prompt run once per group.

The G completions of a prompt share its tokens (with the default task, ~90% of every sequence).
So the prompt goes through the model once, its key/value cache is indexed out to every completion
that continues it, and the completions run on top of it. Autograd sums the completions' gradients
into the shared prompt activations: the same math as running every sequence whole, a fraction of
the FLOPs. Only positions that predict completion tokens reach the output layer.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token of every row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    prompt_index: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(completion token t | prompt, tokens < t), shape (B, T).

    prompt_ids, prompt_mask: (P, Lp) left-padded, each prompt once.
    completion_ids: (B, T) right-padded; padding positions get values that the caller masks.
    prompt_index: (B,) the prompt row each completion continues; None means row i of both (P == B).
    Logits are divided by `temperature` so that log-probs are those of the sampling distribution
    (as TRL does).
    """
    B, T = completion_ids.shape
    prompt_out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask),
        past_key_values=DynamicCache(),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = prompt_out.past_key_values
    first = prompt_out.logits[:, -1]  # (P, V): the prompt's last position predicts completion token 0
    if prompt_index is not None:
        # (P, ...) -> (B, ...), differentiable. index_select, not Tensor[index] (what the cache's
        # own batch_select_indices does): the backward of indexing sums the rows that share a
        # prompt in an order that varies from run to run on several CPU threads; index_select's
        # sums in a fixed order, so a run is bit for bit repeatable (and resumable).
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, prompt_index), layer.values.index_select(0, prompt_index)
        first, prompt_mask = first.index_select(0, prompt_index), prompt_mask.index_select(0, prompt_index)
    logits = first[:, None, :]  # (B, 1, V)
    if T > 1:
        # Completion token t-1 at position len(prompt) + t - 1 predicts token t. Padding after an
        # EOS is attended only by later padding (causal), so a mask of ones changes no real token.
        attention = torch.cat([prompt_mask, prompt_mask.new_ones(B, T - 1)], dim=1)  # (B, Lp + T - 1)
        start = prompt_mask.sum(-1, keepdim=True)  # (B, 1)
        out = model(
            input_ids=completion_ids[:, :-1],
            attention_mask=attention,
            position_ids=start + torch.arange(T - 1, device=start.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits = torch.cat([logits, out.logits], dim=1)  # (B, T, V)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # log-softmax over a 49k vocabulary needs more than 8 mantissa bits
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (B, T)
    return logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - logz  # (B, T)
