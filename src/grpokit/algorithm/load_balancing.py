"""The mixture-of-experts load-balancing loss (algorithm.router_aux_loss_coef), per sequence.

transformers' `load_balancing_loss_func` (Switch Transformer's, which TRL adds) is, over the N
tokens of one forward call and all its MoE layers, with E experts and top-k routing:

    E * sum_e f_e P_e,   f_e = (choices of expert e) / N,   P_e = mean over tokens of softmax(router logits)_e

f_e counts top-k choices (no gradient); the gradient reaches the routers through P_e. Taken over a
call's tokens it depends on which sequences share the call (the micro-batch, its padding, a prompt
counted once for its group), so here it is taken per sequence, as DeepSeek-V3's sequence-wise
balance loss, over the positions that predict the sequence's trained tokens, every MoE layer:

    b_i = E * sum_e f_ie P_ie

and the loss adds coef * sum_i b_i / num_sequences over the optimizer update's sequences: a sum of
per-sequence terms normalized by the whole update's count, so micro-batch size and process count
never change it (the rest of the loss's promise). Perfectly balanced routing gives b_i = k.
"""

from __future__ import annotations

import torch


def sequence_balance(router_logits: torch.Tensor, mask: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """b_i (B,) of the module docstring, with gradient, and the experts' choice counts (E,) over
    the masked positions of every layer (detached: the experts' load).

    router_logits: (layers, B, T, E) at the positions that predict each completion token;
    mask: (B, T) 1 on the trained tokens."""
    L, B, T, E = router_logits.shape
    probs = torch.softmax(router_logits.to(torch.promote_types(router_logits.dtype, torch.float32)), -1)  # (L, B, T, E)
    weight = mask.to(probs.dtype)[None, :, :, None]  # (1, B, T, 1)
    with torch.no_grad():
        chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0) * weight  # (L, B, T, E)
    positions = (mask.to(probs.dtype).sum(-1) * L).clamp(min=1.0)  # (B,) positions x layers
    f = chosen.sum((0, 2)) / positions[:, None]  # (B, E)
    p = (probs * weight).sum((0, 2)) / positions[:, None]  # (B, E)
    return E * (f * p).sum(-1), chosen.sum((0, 1, 2))
