"""The GRPO objective: pure functions over one micro-batch, registered by name.

Per token t of completion i (Shao et al. 2024, eq. 3; clipping as PPO, with DAPO's asymmetric
upper bound):

    ratio = exp(logp - old_logp)
    l_it  = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps_high) * A_i) + beta * KL_it

Every term of `l` goes through the same normalization, chosen by name (`algorithm.loss_type`):

    grpo     sum_i (sum_t l_it m_it / max(1, sum_t m_it)) / num_sequences   (per-sequence mean)
    dapo     sum_it l_it m_it / num_tokens                                  (global token mean)
    dr_grpo  sum_it l_it m_it / (num_sequences * max_completion_length)     (a constant)

Normalizing the policy term one way and the KL term another (as TRL once did) makes the loss of a
batch with beta 0 and ratio 1 non-zero although its group advantages sum to zero: here one
function, `NORMALIZERS[name]`, normalizes the whole per-token loss.

When the completions were sampled by an engine whose log-probs are not the trainer's own (vLLM's
kernels), the policy term of each token is weighted by the truncated importance ratio between the
trainer's policy before the update and the sampler (TIS; TRL's `vllm_importance_sampling_correction`):

    w_it  = min(exp(old_logp_it - sampling_logp_it), is_cap)     (no gradient)
    l_it  = -w_it * min(ratio * A_i, clip(ratio) * A_i) + beta * KL_it

`num_sequences` and `num_tokens` are those of the whole optimizer update, not of the micro-batch:
so the micro-batch losses add up exactly to the loss of the whole update batch, and the memory
knobs (micro-batch size, process count) never change the math.

A loss variant is a function `(LossInputs, LossSettings) -> LossOutput` registered in LOSSES under
the name `algorithm.loss_type` takes; the trainer looks it up there, and learns the names of its
metrics from `token_metric_names`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

# The names of the loss's per-token metrics (TRL's), summed over tokens in LossOutput.token_sums.
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
IS_MEAN, IS_MAX = "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max"


@dataclass(frozen=True)
class LossSettings:
    """The loss's hyperparameters (algorithm.* and rollout.is_cap), fixed for a run."""

    beta: float = 0.0  # KL coefficient; the KL term exists only when > 0
    epsilon: float = 0.2  # lower clip range
    epsilon_high: float | None = None  # upper clip range; None: epsilon
    kl_estimator: str = "k3"
    is_cap: float = 2.0  # upper bound of the importance-sampling weight


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors, and the counts of the whole update batch that normalize them.

    B completions of at most T tokens. `num_sequences` / `num_tokens` / `max_completion_length`
    default to this micro-batch's own (a caller that splits an update passes the update's)."""

    logps: torch.Tensor  # (B, T) the policy's log-probs, with gradient
    mask: torch.Tensor  # (B, T) 1 on the completion tokens that are trained
    advantages: torch.Tensor  # (B,) or (B, T)
    old_logps: torch.Tensor | None = None  # (B, T) before the update; None: sampled by this very policy (ratio 1, gradient flows)
    ref_logps: torch.Tensor | None = None  # (B, T) the reference model's; needed when beta > 0
    sampling_logps: torch.Tensor | None = None  # (B, T) the sampler's; given, it turns on the IS correction
    num_sequences: float | None = None
    num_tokens: float | None = None
    max_completion_length: int | None = None


@dataclass
class LossOutput:
    loss: torch.Tensor  # () this micro-batch's share of the update's loss
    # Detached sums over the micro-batch's trained tokens, by metric name: the clip indicators
    # (CLIP_METRICS), `kl` when beta > 0, and the importance weight (IS_MEAN) when corrected. They
    # add up over micro-batches; the trainer turns them into means.
    token_sums: dict[str, torch.Tensor]
    token_max: dict[str, torch.Tensor]  # detached maxima over the trained tokens (IS_MAX when corrected)


LossFn = Callable[[LossInputs, LossSettings], LossOutput]


def token_metric_names(settings: LossSettings) -> tuple[str, ...]:
    """The token-summed metrics every loss returns in LossOutput.token_sums (the importance weight's
    aside): the clip ratios, and `kl` when beta > 0. Known before any call, because every process
    logs the same keys, even one whose rows all skip the forward pass. A variant with a metric of
    its own adds its name here."""
    return (*CLIP_METRICS, *(("kl",) if settings.beta > 0 else ()))


# ---------------------------------------------------------------- KL estimators (Schulman 2020)


def kl_k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance, can be negative)."""
    return logps - ref_logps


def kl_k2(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref_logp)^2 / 2 (low variance, biased)."""
    return (logps - ref_logps) ** 2 / 2


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, >= 0)."""
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


# ---------------------------------------------------------------- normalizations


def per_sequence_mean(values: torch.Tensor, mask: torch.Tensor, num_sequences: float, num_tokens: float,
                      max_completion_length: int) -> torch.Tensor:
    """sum_i (sum_t v_it m_it / max(1, sum_t m_it)) / num_sequences (the GRPO paper)."""
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / num_sequences


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_sequences: float, num_tokens: float,
               max_completion_length: int) -> torch.Tensor:
    """sum_it v_it m_it / num_tokens (DAPO)."""
    return (values * mask).sum() / max(num_tokens, 1.0)


def constant_normalizer(values: torch.Tensor, mask: torch.Tensor, num_sequences: float, num_tokens: float,
                        max_completion_length: int) -> torch.Tensor:
    """sum_it v_it m_it / (num_sequences * max_completion_length) (Dr. GRPO)."""
    return (values * mask).sum() / (num_sequences * max_completion_length)


NORMALIZERS = {"grpo": per_sequence_mean, "dapo": token_mean, "dr_grpo": constant_normalizer}


# ---------------------------------------------------------------- the loss


def clipped_surrogate_loss(inputs: LossInputs, settings: LossSettings, normalize) -> LossOutput:
    """The module docstring's l_it (clipped ratio, optional TIS weight, optional KL), normalized by
    `normalize` (one of NORMALIZERS), with its metrics' token sums."""
    s = settings
    if s.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {tuple(KL_ESTIMATORS)}, got {s.kl_estimator!r}")
    if s.beta > 0 and inputs.ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's log-probs)")
    logps = inputs.logps
    eps_low = s.epsilon
    eps_high = s.epsilon if s.epsilon_high is None else s.epsilon_high
    mask = inputs.mask.to(logps.dtype)  # (B, T)
    num_sequences = logps.shape[0] if inputs.num_sequences is None else inputs.num_sequences
    num_tokens = mask.sum().item() if inputs.num_tokens is None else inputs.num_tokens
    length = logps.shape[1] if inputs.max_completion_length is None else inputs.max_completion_length
    advantages = inputs.advantages
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1), broadcast over tokens

    # Untrained positions (padding, a conversation's tool tokens) hold log-probs that no sampling
    # produced, possibly far from the others': every log-prob there is set to the policy's before
    # any exp, so that a huge difference cannot become inf * 0 = NaN. Trained positions are untouched.
    trained = inputs.mask.bool()  # (B, T)
    here = logps.detach()

    def on_trained(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.where(trained, x, here)

    old_logps = here if inputs.old_logps is None else on_trained(inputs.old_logps)
    ratio = torch.exp(logps - old_logps)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)

    weights = None
    if inputs.sampling_logps is not None:
        weights = importance_weights(old_logps, on_trained(inputs.sampling_logps.to(logps.dtype)), s.is_cap)  # (B, T)
        per_token = per_token * weights

    kl = None
    if s.beta > 0:
        kl = KL_ESTIMATORS[s.kl_estimator](logps, on_trained(inputs.ref_logps))  # (B, T)
        per_token = per_token + s.beta * kl

    loss = normalize(per_token, mask, num_sequences, num_tokens, length)

    with torch.no_grad():
        low = ((ratio < 1 - eps_low) & (advantages < 0)).to(logps.dtype)  # (B, T)
        high = ((ratio > 1 + eps_high) & (advantages > 0)).to(logps.dtype)  # (B, T)
        sums = {name: (value * mask).sum() for name, value in zip(CLIP_METRICS, (low, high, low + high))}
        maxima = {}
        if kl is not None:
            sums["kl"] = (kl * mask).sum()
        if weights is not None:
            sums[IS_MEAN] = (weights * mask).sum()
            maxima[IS_MAX] = weights.masked_fill(mask == 0, float("-inf")).max() if mask.any() else weights.new_tensor(float("-inf"))
    return LossOutput(loss, sums, maxima)


# algorithm.loss_type -> the loss function. Today's three share the clipped surrogate and differ in
# normalization; a variant with another per-token objective registers its own function here.
LOSSES: dict[str, LossFn] = {name: partial(clipped_surrogate_loss, normalize=fn) for name, fn in NORMALIZERS.items()}


def compute_loss(loss_type: str, inputs: LossInputs, settings: LossSettings) -> LossOutput:
    """The registered loss `loss_type` on one micro-batch."""
    if loss_type not in LOSSES:
        raise ValueError(f"loss_type must be one of {tuple(LOSSES)}, got {loss_type!r}")
    return LOSSES[loss_type](inputs, settings)
