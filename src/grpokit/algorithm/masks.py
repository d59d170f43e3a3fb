"""Which tokens the loss trains: the model's own tokens (not a conversation's tool results), less a
truncated completion's with algorithm.mask_truncated_completions, and of those the high-entropy
ones with algorithm.top_entropy_quantile < 1 ("Beyond the 80/20 rule": the forking tokens)."""

from __future__ import annotations

import math

import torch

from grpokit.runtime import distributed


def loss_mask(trained_mask: torch.Tensor, finish_reasons: list[str], mask_truncated: bool) -> torch.Tensor:
    """(n, T) the tokens the loss trains: `trained_mask` (n, T), the model's own, less every token
    of a completion that ended for its length (finish reason "length") when `mask_truncated`."""
    mask = trained_mask
    if mask_truncated:
        kept = torch.tensor([f != "length" for f in finish_reasons], dtype=mask.dtype, device=mask.device)
        mask = mask * kept[:, None]
    return mask


def high_entropy_tokens(entropies: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                        top_quantile: float) -> torch.Tensor:
    """(n, T) bool, on an update's `rows`: the trained tokens (`mask`) whose sampling entropy
    (`entropies`, (n, T)) is at least the (1 - top_quantile) quantile of every trained token's of
    the update, all processes (algorithm.top_entropy_quantile; TRL's threshold, taken per
    micro-batch there; over the whole update here)."""
    entropies = entropies.to(mask.device)  # (n, T)
    trained = mask.bool()
    values = torch.cat(distributed.gather_lists([entropies[rows][trained[rows]].double().cpu()]))
    out = torch.zeros_like(trained)
    if values.numel():
        threshold = quantile(values, 1 - top_quantile)
        out[rows] = (entropies[rows].double() >= threshold) & trained[rows]
    return out


def quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile's (linear interpolation), without its limit of 2^24 values."""
    ordered = values.sort().values
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return (ordered[low] + (ordered[high] - ordered[low]) * (position - low)).item()
