"""The GRPO family's objectives: pure functions over one micro-batch, registered by name.

Per token t of completion i, with ratio r_it = exp(logp_it - old_logp_it) (`importance_sampling_level`
token) or, GSPO (Zheng et al. 2025), one ratio per completion, the geometric mean of its tokens'
(`sequence`): r_i = exp(sum_t m_it (logp_it - old_logp_it) / sum_t m_it). The policy term p_it of
each registered objective:

    clipped  -min(r A_i, clip(r, 1 - eps, 1 + eps_high) A_i)        PPO / GRPO (Shao et al. 2024, eq. 3),
             with `delta`, r is first capped at delta in the          DAPO's asymmetric upper bound;
             unclipped term: a negative-advantage token's loss        dual clipping (INTELLECT-2; veRL's
             is at most -delta A_i                                    clip_ratio_c)
    cispo    -sg(min(r, 1 + eps_high)) A_i logp_it                   MiniMax-M1: the weight is capped and
                                                                      has no gradient; every token keeps its own
    sapo     -(4 / tau) sigmoid(tau (r - 1)) A_i,                    SAPO (Gao et al. 2025): a soft gate;
             tau = tau_pos if A_i > 0 else tau_neg                    gradient A_i at r = 1, fading away from it

and the per-token loss is l_it = w_it h_it p_it + beta KL_it - c H_it, where w_it is the rollout
importance weight (below, 1 without it), h_it the top-entropy mask (1 without it), and H_it the
entropy of the policy's (tempered) next-token distribution at token t, with its gradient: an
entropy bonus of weight c = `algorithm.entropy_coef` (0: none). Every term of l goes through the
same normalization, chosen with the objective by `algorithm.loss_type`:

With a teacher (on-policy distillation, `distill.teacher`), the advantage of each token is the
completion's minus `distill.coef` times the per-token reverse KL estimate on the sampled token,
the student's log-prob before the update minus the teacher's (no gradient):

    A_it = A_i - coef (old_logp_it - teacher_logp_it)

so a token the teacher finds likelier than the student is pushed up, one it finds less likely
pushed down; with a teacher equal to the student it is A_i exactly.

    grpo     clipped, sum_i (sum_t l_it m_it / max(1, sum_t m_it)) / num_sequences   (per-sequence mean)
    dapo     clipped, sum_it l_it m_it / num_tokens                                  (global token mean)
    dr_grpo  clipped, sum_it l_it m_it / (num_sequences * max_completion_length)     (a constant)
    cispo    cispo,   the token mean (the paper's 1 / sum_i |o_i|)
    sapo     sapo,    the per-sequence mean (as TRL)

A mixture-of-experts model's load-balancing term, each sequence's b_i (algorithm/load_balancing.py), adds
`router_aux_loss_coef` * sum_i b_i / num_sequences beside the normalized per-token loss.

Normalizing the policy term one way and the KL term another (as TRL once did) makes the loss of a
batch with beta 0 and ratio 1 non-zero although its group advantages sum to zero: here one
function, `NORMALIZERS[name]`, normalizes the whole per-token loss.

When the completions were sampled by an engine whose log-probs are not the trainer's own (vLLM's
kernels), the policy term is weighted by the importance ratio between the trainer's policy before
the update and the sampler (TRL's `vllm_importance_sampling_correction`), without gradient:

    rho_it = exp(old_logp_it - sampling_logp_it)       is_level token
    rho_i  = exp(sum_t m_it (old_logp_it - sampling_logp_it))   is_level sequence (the whole completion's ratio)
    w      = clamp(rho, is_min, is_cap)                 is_mode truncate
    w      = rho if is_min <= rho <= is_cap else 0      is_mode mask

`num_sequences` and `num_tokens` are those of the whole optimizer update, not of the micro-batch:
so the micro-batch losses add up exactly to the loss of the whole update batch, and the memory
knobs (micro-batch size, process count) never change the math.

A loss is a `Loss` (an objective, a normalizer and the names of its metrics) registered in LOSSES
under the name `algorithm.loss_type` takes; the trainer looks it up there, and learns the names of
its metrics from `token_metric_names`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The names of the loss's per-token metrics (TRL's), summed over tokens in LossOutput.token_sums.
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CISPO_CLIP = "cispo_clip_ratio"
IS_MEAN, IS_MAX = "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max"
REVERSE_KL = "distill/reverse_kl"
AUX_LOSS = "aux_loss"  # TRL's name for the mixture-of-experts load-balancing term (before its coefficient)
IS_OUTSIDE = {"truncate": "sampling/is_truncated_fraction", "mask": "sampling/is_masked_fraction"}
LEVELS = ("token", "sequence")
IS_MODES = tuple(IS_OUTSIDE)


@dataclass(frozen=True)
class LossSettings:
    """The loss's hyperparameters (algorithm.* and rollout.is_*), fixed for a run."""

    beta: float = 0.0  # KL coefficient; the KL term exists only when > 0
    epsilon: float = 0.2  # lower clip range
    epsilon_high: float | None = None  # upper clip range; None: epsilon
    kl_estimator: str = "k3"
    importance_sampling_level: str = "token"  # the policy ratio's: token | sequence (GSPO)
    delta: float | None = None  # dual clip of negative-advantage tokens (clipped objective)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    is_level: str = "token"  # the rollout importance weight's level: token | sequence
    is_mode: str = "truncate"  # truncate | mask
    is_cap: float = 3.0  # upper bound of the rollout importance weight
    is_min: float | None = None  # its lower bound
    entropy_coef: float = 0.0  # the entropy bonus's weight; the term exists only when > 0
    distill_coef: float = 1.0  # the teacher's per-token signal's weight (with teacher_logps)
    router_aux_loss_coef: float = 0.0  # the load-balancing term's weight (algorithm/load_balancing.py); exists only when > 0

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


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
    sampling_logps: torch.Tensor | None = None  # (B, T) the sampler's; given, it turns on the rollout importance weight
    num_sequences: float | None = None
    num_tokens: float | None = None
    max_completion_length: int | None = None
    policy_mask: torch.Tensor | None = None  # (B, T) 1 where the policy term applies (top_entropy_quantile); None: everywhere
    entropies: torch.Tensor | None = None  # (B, T) the policy's entropies, with gradient; needed when entropy_coef > 0
    teacher_logps: torch.Tensor | None = None  # (B, T) a teacher's log-probs of the sampled tokens (distill.teacher)
    balance: torch.Tensor | None = None  # (B,) each sequence's load-balancing term, with gradient; needed when router_aux_loss_coef > 0


@dataclass
class LossOutput:
    loss: torch.Tensor  # () this micro-batch's share of the update's loss
    # Detached sums over the micro-batch's trained tokens, by metric name: the objective's indicators
    # (its Loss.metrics), `kl` when beta > 0, and the importance weight (IS_MEAN, IS_OUTSIDE) when
    # corrected. They add up over micro-batches; the trainer turns them into means.
    token_sums: dict[str, torch.Tensor]
    token_max: dict[str, torch.Tensor]  # detached maxima over the trained tokens (IS_MAX when corrected)
    # Detached sums over the micro-batch's sequences (the load-balancing term, AUX_LOSS): the trainer
    # divides them by the update's sequences.
    sequence_sums: dict[str, torch.Tensor] = field(default_factory=dict)


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


def log_ratio(logps: torch.Tensor, other: torch.Tensor, mask: torch.Tensor, level: str, mean: bool) -> torch.Tensor:
    """log(p / other) per token (B, T), or per completion (B, 1) over the `mask`ed tokens: their mean
    (GSPO's geometric mean) when `mean`, else their sum (the whole completion's probability ratio)."""
    diff = logps - other  # (B, T)
    if level == "token":
        return diff
    total = (diff * mask).sum(-1, keepdim=True)  # (B, 1)
    return total / mask.sum(-1, keepdim=True).clamp(min=1.0) if mean else total


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                       s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout importance weights (B, T) or (B, 1) of the module docstring, detached, and where the
    ratio fell outside [is_min, is_cap] (bool, same shape)."""
    rho = torch.exp(log_ratio(old_logps.detach(), sampling_logps, mask, s.is_level, mean=False))
    low = -torch.inf if s.is_min is None else s.is_min
    outside = (rho > s.is_cap) | (rho < low)
    if s.is_mode == "truncate":
        return rho.clamp(min=s.is_min, max=s.is_cap), outside
    return torch.where(outside, torch.zeros_like(rho), rho), outside


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


# ---------------------------------------------------------------- objectives
# Each: (ratio (B, T) or (B, 1), logps (B, T), advantages (B, 1) or (B, T), settings) -> the policy
# term p (B, T) and its metrics' per-token indicators (broadcastable to (B, T)), by name.


def clipped(ratio, logps, advantages, s: LossSettings):
    """-min(r A, clip(r, 1 - eps, 1 + eps_high) A), r capped at delta in the first term when set."""
    clip = torch.clamp(ratio, 1 - s.epsilon, 1 + s.eps_high)
    capped = ratio if s.delta is None else torch.clamp(ratio, max=s.delta)
    per_token = -torch.minimum(capped * advantages, clip * advantages)
    with torch.no_grad():
        low = ((ratio < 1 - s.epsilon) & (advantages < 0)).to(logps.dtype)
        high = ((ratio > 1 + s.eps_high) & (advantages > 0)).to(logps.dtype)
    return per_token.expand_as(logps), dict(zip(CLIP_METRICS, (low, high, low + high)))


def cispo(ratio, logps, advantages, s: LossSettings):
    """-sg(min(r, 1 + eps_high)) A logp."""
    weight = torch.clamp(ratio, max=1 + s.eps_high).detach()
    with torch.no_grad():
        capped = ((ratio > 1 + s.eps_high) & (advantages > 0)).to(logps.dtype)
    return -weight * advantages * logps, {CISPO_CLIP: capped}


def sapo(ratio, logps, advantages, s: LossSettings):
    """-(4 / tau) sigmoid(tau (r - 1)) A, tau by the advantage's sign."""
    pos, neg = (torch.tensor(t, dtype=logps.dtype, device=logps.device) for t in (s.sapo_temperature_pos, s.sapo_temperature_neg))
    tau = torch.where(advantages > 0, pos, neg)
    return (-(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * advantages).expand_as(logps), {}


@dataclass(frozen=True)
class Loss:
    """A registered loss: its objective, its normalizer, the names of the objective's metrics, and
    the LossSettings fields that only its objective reads (the config refuses one set for a loss
    that does not read it: algorithm.delta means something only to a clipped ratio)."""

    objective: Callable
    normalize: Callable
    metrics: tuple[str, ...]
    reads: tuple[str, ...] = ()

    def __call__(self, inputs: LossInputs, settings: LossSettings) -> LossOutput:
        return surrogate_loss(inputs, settings, self)


# algorithm.loss_type -> the loss. A variant with another per-token objective registers a Loss here.
LOSSES: dict[str, Callable[[LossInputs, LossSettings], LossOutput]] = {
    "grpo": Loss(clipped, per_sequence_mean, CLIP_METRICS, reads=("delta",)),
    "dapo": Loss(clipped, token_mean, CLIP_METRICS, reads=("delta",)),
    "dr_grpo": Loss(clipped, constant_normalizer, CLIP_METRICS, reads=("delta",)),
    "cispo": Loss(cispo, token_mean, (CISPO_CLIP,)),
    "sapo": Loss(sapo, per_sequence_mean, (), reads=("sapo_temperature_pos", "sapo_temperature_neg")),
}


def token_metric_names(loss_type: str, settings: LossSettings, teacher: bool = False) -> tuple[str, ...]:
    """The token-summed metrics the loss returns in LossOutput.token_sums, the rollout importance
    weight's aside (IS_MEAN, IS_OUTSIDE): its objective's, `kl` when beta > 0, and the reverse KL
    to a `teacher`'s. Known before any call, because every process logs the same keys, even one
    whose rows all skip the forward pass."""
    own = getattr(LOSSES[loss_type], "metrics", CLIP_METRICS)
    return (*own, *(("kl",) if settings.beta > 0 else ()), *((REVERSE_KL,) if teacher else ()))


# ---------------------------------------------------------------- the loss


def surrogate_loss(inputs: LossInputs, settings: LossSettings, loss: Loss) -> LossOutput:
    """The module docstring's l_it for `loss`'s objective (ratio at the configured level, optional
    rollout importance weight, top-entropy mask and KL), normalized by `loss.normalize`, with its
    metrics' token sums."""
    s = settings
    _check_inputs(inputs, s)
    logps = inputs.logps
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
    reverse_kl = None
    if inputs.teacher_logps is not None:  # the module docstring's A_it
        reverse_kl = old_logps - on_trained(inputs.teacher_logps.to(logps.dtype))  # (B, T)
        advantages = advantages - s.distill_coef * reverse_kl
    ratio = torch.exp(log_ratio(logps, old_logps, mask, s.importance_sampling_level, mean=True))  # (B, T) or (B, 1)
    per_token, indicators = loss.objective(ratio, logps, advantages, s)  # (B, T)

    weights = outside = None
    if inputs.sampling_logps is not None:
        sampling = on_trained(inputs.sampling_logps.to(logps.dtype))
        weights, outside = importance_weights(old_logps, sampling, mask, s)  # (B, T) or (B, 1)
        per_token = per_token * weights
    if inputs.policy_mask is not None:
        per_token = per_token * inputs.policy_mask.to(logps.dtype)

    kl = None
    if s.beta > 0:
        kl = KL_ESTIMATORS[s.kl_estimator](logps, on_trained(inputs.ref_logps))  # (B, T)
        per_token = per_token + s.beta * kl
    if s.entropy_coef > 0:
        per_token = per_token - s.entropy_coef * inputs.entropies

    value = loss.normalize(per_token, mask, num_sequences, num_tokens, length)
    per_sequence = {}
    if s.router_aux_loss_coef > 0:  # algorithm/load_balancing.py: per sequence, over the update's sequences
        value = value + s.router_aux_loss_coef * inputs.balance.sum() / num_sequences
        per_sequence[AUX_LOSS] = inputs.balance.detach().sum()
    sums = {**indicators, **({"kl": kl} if kl is not None else {}),
            **({REVERSE_KL: reverse_kl} if reverse_kl is not None else {})}
    return LossOutput(value, *_metrics(sums, mask, weights, outside, s), per_sequence)


def _check_inputs(inputs: LossInputs, s: LossSettings) -> None:
    """The inputs each term of the loss `s` asks for are there."""
    if s.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {tuple(KL_ESTIMATORS)}, got {s.kl_estimator!r}")
    if s.beta > 0 and inputs.ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's log-probs)")
    if s.entropy_coef > 0 and inputs.entropies is None:
        raise ValueError("entropy_coef > 0 needs entropies (the policy's, from its pass)")
    if s.router_aux_loss_coef > 0 and inputs.balance is None:
        raise ValueError("router_aux_loss_coef > 0 needs balance (each sequence's load-balancing term, from its pass)")


@torch.no_grad()
def _metrics(per_token: dict[str, torch.Tensor], mask: torch.Tensor, weights: torch.Tensor | None,
             outside: torch.Tensor | None, s: LossSettings) -> tuple[dict, dict]:
    """LossOutput's token sums (of each `per_token` value, and the importance weight's when
    `weights`) and maxima over the `mask`ed tokens."""
    sums = {name: (value * mask).sum() for name, value in per_token.items()}
    maxima = {}
    if weights is not None:
        sums[IS_MEAN] = (weights * mask).sum()
        sums[IS_OUTSIDE[s.is_mode]] = (outside * mask).sum()
        spread = weights.expand_as(mask)
        maxima[IS_MAX] = spread.masked_fill(mask == 0, float("-inf")).max() if mask.any() else spread.new_tensor(float("-inf"))
    return sums, maxima


def compute_loss(loss_type: str, inputs: LossInputs, settings: LossSettings) -> LossOutput:
    """The registered loss `loss_type` on one micro-batch."""
    if loss_type not in LOSSES:
        raise ValueError(f"loss_type must be one of {tuple(LOSSES)}, got {loss_type!r}")
    return LOSSES[loss_type](inputs, settings)
