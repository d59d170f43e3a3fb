"""The GRPO objective as one pure function.

Per token t of completion i (Shao et al. 2024, eq. 3; clipping as PPO, with DAPO's asymmetric
upper bound):

    ratio = exp(logp - old_logp)
    l_it  = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps_high) * A_i) + beta * KL_it

Every term of `l` goes through the same aggregation (CONTEXT.md, report 2), chosen by name:

    grpo     sum_i (sum_t l_it m_it / max(1, sum_t m_it)) / num_sequences   (per-sequence mean)
    dapo     sum_it l_it m_it / num_tokens                                  (global token mean)
    dr_grpo  sum_it l_it m_it / (num_sequences * max_completion_length)     (a constant)

When the completions were sampled by an engine whose log-probs are not the trainer's own (vLLM's
kernels), the policy term of each token is weighted by the truncated importance ratio between the
trainer's policy before the update and the sampler (TIS; TRL's `vllm_importance_sampling_correction`):

    w_it  = min(exp(old_logp_it - sampling_logp_it), is_cap)     (no gradient)
    l_it  = -w_it * min(ratio * A_i, clip(ratio) * A_i) + beta * KL_it

`num_sequences` and `num_tokens` default to this call's own batch. A caller that splits an update
batch into micro-batches passes the whole update batch's counts instead, so that the micro-batch
losses (and metrics) add up exactly to the loss of the whole batch: memory knobs never change the
math (DESIGN.md, "Batch knobs").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
IS_MEAN, IS_MAX = "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max"


def kl_k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance, can be negative)."""
    return logps - ref_logps


def kl_k2(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref_logp)^2 / 2 (low variance, biased)."""
    return (logps - ref_logps) ** 2 / 2


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, >= 0; Schulman 2020)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights (B, T): min(exp(old_logps - sampling_logps), cap), detached."""
    return torch.clamp(torch.exp(old_logps.detach() - sampling_logps), max=cap)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token values (B, T) to a scalar with the named normalization (see module doc).

    The one place where a normalization choice is made: the policy term, the KL term and the
    logged metrics all go through it.
    """
    mask = mask.to(values.dtype)
    if num_sequences is None:
        num_sequences = values.shape[0]
    if num_tokens is None:
        num_tokens = mask.sum().item()
    if loss_type == "grpo":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
        return per_seq.sum() / num_sequences
    if loss_type == "dapo":
        return (values * mask).sum() / max(num_tokens, 1.0)
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else values.shape[1]
        return (values * mask).sum() / (num_sequences * length)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    kl_estimator: str = "k3",
    max_completion_length: int | None = None,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    sampling_logps: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss and its diagnostics for one (micro-)batch; see the module docstring for the formula.

    logps, old_logps, ref_logps, mask: (B, T) over completion tokens; advantages: (B,) or (B, T).
    `old_logps=None` means the batch was sampled by the current policy (ratio 1, gradient of the
    ratio still flows). `ref_logps` is required when beta > 0 and ignored when beta == 0.
    `sampling_logps` (B, T), when given, turns on the importance-sampling correction, capped at `is_cap`.

    Metrics (detached; token means normalized by `num_tokens`, so they too add up over
    micro-batches): `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`, and
    `kl` when beta > 0.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {tuple(KL_ESTIMATORS)}, got {kl_estimator!r}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's log-probs)")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask_f = mask.to(logps.dtype)
    if num_sequences is None:
        num_sequences = logps.shape[0]
    if num_tokens is None:
        num_tokens = mask_f.sum().item()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1), broadcast over tokens

    if old_logps is None:
        old_logps = logps.detach()
    ratio = torch.exp(logps - old_logps)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)

    weights = None
    if sampling_logps is not None:
        weights = importance_weights(old_logps, sampling_logps, is_cap)  # (B, T)
        per_token = per_token * weights

    kl = None
    if beta > 0:
        kl = KL_ESTIMATORS[kl_estimator](logps, ref_logps)  # (B, T)
        per_token = per_token + beta * kl

    loss = aggregate(
        per_token,
        mask_f,
        loss_type,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        max_completion_length=max_completion_length,
    )

    with torch.no_grad():
        denom = max(num_tokens, 1.0)
        low = ((ratio < 1 - eps_low) & (advantages < 0)).to(logps.dtype)
        high = ((ratio > 1 + eps_high) & (advantages > 0)).to(logps.dtype)
        metrics = {
            name: (value * mask_f).sum() / denom
            for name, value in zip(CLIP_METRICS, (low, high, low + high))
        }
        if kl is not None:
            metrics["kl"] = (kl * mask_f).sum() / denom
        if weights is not None:
            metrics[IS_MEAN] = (weights * mask_f).sum() / denom
            # A max does not add up over micro-batches: the caller takes the max of these.
            metrics[IS_MAX] = (
                weights.masked_fill(mask_f == 0, float("-inf")).max() if mask_f.any() else weights.new_tensor(float("-inf")))
    return loss, metrics
