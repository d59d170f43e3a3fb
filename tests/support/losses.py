"""The loss on a random batch (tests/algorithm/): as the trainer reports it for an update made of
one micro-batch."""

from __future__ import annotations

import torch


def loss_of(logps, old, ref, adv, mask, *, loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=None,
            kl_estimator="k3", max_completion_length=None, num_sequences=None, num_tokens=None,
            sampling_logps=None, is_cap=2.0, policy_mask=None, entropies=None, teacher_logps=None, **settings):
    """The loss `loss_type` on one micro-batch, and its metrics as the trainer reports them for an
    update made of it: token sums over the update's token count (the importance weight's over the
    micro-batch's own tokens)."""
    from grpokit.algorithm.loss import IS_MAX, IS_MEAN, IS_OUTSIDE, LossInputs, LossSettings, compute_loss

    out = compute_loss(loss_type, LossInputs(logps, mask, adv, old, ref, sampling_logps, num_sequences, num_tokens,
                                             max_completion_length, policy_mask, entropies, teacher_logps),
                       LossSettings(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, kl_estimator=kl_estimator,
                                    is_cap=is_cap, **settings))
    denom = max(mask.sum().item() if num_tokens is None else num_tokens, 1.0)
    corrected = (IS_MEAN, *IS_OUTSIDE.values())
    metrics = {k: v / denom for k, v in out.token_sums.items() if k not in corrected}
    if IS_MEAN in out.token_sums:
        for k in corrected:
            if k in out.token_sums:
                metrics[k] = out.token_sums[k] / mask.sum()
        metrics[IS_MAX] = out.token_max[IS_MAX]
    return out.loss, metrics


def random_batch(B=6, T=7, seed=0):
    """Float64 log-probs (policy, old, reference), advantages and a ragged mask (row 0 whole)."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logps, old, ref, adv, mask
