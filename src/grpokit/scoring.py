"""Scoring a step's completions: the reward functions, group-relative advantages, which completions
need a forward/backward pass, and the step's reward and completion metrics.

Each process scores the completions it owns; the rewards are gathered into the whole step's (in
global order) before the advantages are taken, so a group's advantages are those of the whole
group wherever its completions were generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpokit import distributed
from grpokit.advantages import advantages as compute_advantages
from grpokit.config import Config
from grpokit.errors import ConfigError
from grpokit.rewards import RewardLog, RewardSet
from grpokit.rollout import RolloutBatch, decode_completions
from grpokit.tasks import Example


@dataclass
class Scored:
    """A step's completions, scored."""

    rewards: torch.Tensor  # (N,) the whole step's, all processes; NaN where no reward function applied
    per_function: dict[str, torch.Tensor]  # name -> (N,) each function's rewards
    advantages: torch.Tensor  # (n,) this process's completions', on the training device
    active: torch.Tensor  # (n,) bool: the completions that need a forward/backward pass
    samples: list[dict] = field(repr=False)  # this process's completions, as monitor.log_completions records them
    logged: dict[str, list[float]] = field(default_factory=dict)  # this process's log_metric values (rewards.RewardLog)

    @property
    def any_scored(self) -> bool:
        """Whether some reward function scored some completion of the step."""
        return not torch.isnan(self.rewards).all()


@dataclass
class Rewarded:
    """The reward functions' verdict on this process's completions of a step (or of a round)."""

    rewards: torch.Tensor  # (N,) the whole step's, gathered from every process, in global order
    per_function: dict[str, torch.Tensor]  # name -> (N,)
    samples: list[dict]  # this process's records of them, with the columns the functions log_extra'ed
    logged: dict[str, list[float]]  # the values they log_metric'ed


def loss_mask(batch: RolloutBatch, mask_truncated: bool) -> torch.Tensor:
    """(n, T) the tokens the loss trains: the model's own (not a conversation's tool results), less
    every token of a truncated completion with algorithm.mask_truncated_completions."""
    mask = batch.trained_mask
    if mask_truncated:
        kept = torch.tensor([f != "length" for f in batch.finish_reasons], dtype=mask.dtype, device=mask.device)
        mask = mask * kept[:, None]
    return mask


def high_entropy_tokens(batch: RolloutBatch, mask: torch.Tensor, rows: torch.Tensor, top_quantile: float,
                        engine: str) -> torch.Tensor:
    """(n, T) bool, on an update's `rows`: the trained tokens (`mask`) whose sampling entropy is at
    least the (1 - top_quantile) quantile of every trained token's of the update, all processes
    (algorithm.top_entropy_quantile; TRL's threshold, taken per micro-batch there; over the whole
    update here). engine: rollout.engine, named when it measures no entropies."""
    if batch.entropies is None:
        raise ConfigError(f"algorithm.top_entropy_quantile={top_quantile} selects tokens by their sampling entropy, "
                          f"which rollout.engine={engine} does not measure: use the transformers engine, or remove it")
    entropies = batch.entropies.to(mask.device)  # (n, T)
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


class Scorer:
    def __init__(self, config: Config, tokenizer, rewards: RewardSet, rows: torch.Tensor, device: torch.device,
                 lockstep: bool):
        """rows: the step's completions this process owns, in update order (distributed.shard_rows);
        lockstep: every process must make every forward call (sharded weights): every row runs."""
        self.config, self.tokenizer, self.rewards = config, tokenizer, rewards
        self.rows, self.device, self.lockstep = rows, device, lockstep

    def score(self, examples: list[Example], batch: RolloutBatch, state) -> Scored:
        """Rewards of this process's completions `batch` of the prompts `examples`, and their
        advantages; state: the reward functions' trainer_state."""
        return self.advantages(batch, self.reward(examples, batch, state))

    def reward(self, examples: list[Example], batch: RolloutBatch, state) -> Rewarded:
        """The reward functions on this process's completions `batch`."""
        cfg, G = self.config, self.config.rollout.num_generations
        N, U = cfg.completions_per_step, cfg.completions_per_update
        owned = [examples[r // G] for r in self.rows.tolist()]
        prompts = batch.prompts(owned)  # as the model saw them
        completions = decode_completions(self.tokenizer, batch, prompts)
        log = RewardLog(len(completions))
        local_rewards, local_per_function = self.rewards(
            owned, completions, batch.finish_reasons, batch.completion_id_lists(), batch.environments(),
            prompts=prompts, state=state, log=log)  # (n,)
        samples = [
            {"prompt": p, **({} if batch.images is None else {"images": list(batch.images[i])}), "completion": c,
             "finish_reason": f, "reward": r.item(),
             **{f"rewards/{name}": v[i].item() for name, v in local_per_function.items()}, **log.record(i)}
            for i, (p, c, f, r) in enumerate(zip(prompts, completions, batch.finish_reasons, local_rewards))
        ]
        rewards = distributed.gather_rows(local_rewards, N, U)  # (N,) in global order
        per_function = {k: distributed.gather_rows(v, N, U) for k, v in local_per_function.items()}
        return Rewarded(rewards, per_function, samples, log.metrics)

    def advantages(self, batch: RolloutBatch, rewarded: Rewarded, rows: torch.Tensor | None = None) -> Scored:
        """The step's advantages (advantages.py) from the whole step's rewards, kept for the
        completions `batch` (this process's rows, or `rows`), and which of them need a forward/backward pass."""
        a, G = self.config.algorithm, self.config.rollout.num_generations
        stacked = torch.stack(list(rewarded.per_function.values()), 1)  # (N, K)
        weights = torch.tensor(self.rewards.weights, dtype=stacked.dtype)
        advantages = compute_advantages(rewarded.rewards, stacked, weights, G, a.advantage_estimator, a.scale_rewards,
                                        a.reward_aggregation)[self.rows if rows is None else rows]  # (n,)
        # With no KL term, a completion with advantage exactly 0 adds exactly 0 to the loss, its
        # gradient and the clip metrics: it needs no forward/backward at all; a completion whose
        # tokens all leave the loss (a masked truncated one) adds 0 with any beta. Sharded weights
        # need every process in every forward (sharding.py), so there every row runs.
        active = torch.ones_like(advantages, dtype=torch.bool)  # (n,)
        if not self.lockstep:
            if a.beta == 0:
                active &= advantages != 0
            active &= loss_mask(batch, a.mask_truncated_completions).cpu().any(-1)
        return Scored(rewarded.rewards, rewarded.per_function, advantages.to(self.device), active, rewarded.samples,
                      rewarded.logged)


def step_metrics(config: Config, batch: RolloutBatch, scored: Scored) -> tuple[dict, int]:
    """The step's reward and completion metrics (TRL's names), over all processes' completions,
    and the number of prompt and completion tokens the step saw. Completion lengths and token
    counts are of the model's own tokens (a conversation's tool results are not counted), as TRL's."""
    G = config.rollout.num_generations
    N, U = config.completions_per_step, config.completions_per_update
    mask = batch.trained_mask.cpu()  # (n, T)
    lengths = distributed.gather_rows(mask.sum(-1).float(), N, U)  # (N,)
    truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.float32)
    truncated = distributed.gather_rows(truncated, N, U)  # (N,)
    entropies = batch.entropies if batch.entropies is not None else torch.full(mask.shape, math.nan)
    totals = distributed.all_reduce(torch.stack([
        (entropies.cpu().double() * mask).sum(),
        mask.sum().double(),
        batch.prompt_mask.sum().cpu().double() + mask.sum(),
    ])).tolist()
    rewards = scored.rewards
    group_std = torch.stack([_std(g) for g in rewards.view(-1, G)])  # (P,) over the scored members
    return {
        **({"entropy": totals[0] / max(totals[1], 1.0)} if batch.entropies is not None else {}),
        # NaN marks "not applicable" (None): every mean and std is over the scored completions.
        "reward": _mean(rewards),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": (group_std == 0).float().mean().item(),
        **{f"rewards/{n}/mean": _mean(v) for n, v in scored.per_function.items()},
        **{f"rewards/{n}/std": _std(v).item() for n, v in scored.per_function.items()},
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
        **(_conversation_metrics(config, batch) if batch.conversations is not None else {}),
        **(_image_metrics(config, batch) if batch.images is not None else {}),
    }, int(totals[2])


def _image_metrics(config: Config, batch: RolloutBatch) -> dict:
    """A vision-language model's prompts: images per prompt, and the share of completions that
    sampled an image placeholder token (which ends a completion: vision.py), over all processes."""
    from grpokit.vision import IMAGE_TOKEN

    N, U = config.completions_per_step, config.completions_per_update
    per_row = torch.tensor([[len(images), reason == IMAGE_TOKEN] for images, reason in
                            zip(batch.images, batch.finish_reasons)], dtype=torch.float64)  # (n, 2)
    images, sampled = distributed.gather_rows(per_row, N, U).T  # (N,) each
    return {"images/per_prompt": images.mean().item(), "completions/image_token_ratio": sampled.mean().item()}


def _conversation_metrics(config: Config, batch: RolloutBatch) -> dict:
    """Tool use over all processes' conversations: calls and failed calls (raised, timed out,
    unknown or malformed) per rollout and in all, model turns, and the share of rollouts that
    used their last turn (the budget's share is completions/clipped_ratio). Agents' (agents.py):
    requests per rollout, failed rollouts, refused requests and requests trained as sequences of their own."""
    from grpokit.rollout.agents import AgentOutcome

    N, U = config.completions_per_step, config.completions_per_update
    if isinstance(batch.conversations[0].environment, AgentOutcome):
        per_rollout = torch.tensor([[c.turns, c.environment.error is not None, c.environment.refused,
                                     c.environment.new_sequences] for c in batch.conversations], dtype=torch.float64)  # (n, 4)
        turns, failed, refused, new_sequences = distributed.gather_rows(per_rollout, N, U).T  # (N,) each
        return {"turns/mean": turns.mean().item(), "agents/failed": failed.sum().item(),
                "agents/refused_requests": refused.sum().item(), "agents/new_sequences": new_sequences.sum().item()}
    per_rollout = torch.tensor([[c.calls, c.failures, c.turns, c.stop == "max_turns"] for c in batch.conversations],
                               dtype=torch.float64)  # (n, 4)
    calls, failures, turns, max_turns = distributed.gather_rows(per_rollout, N, U).T  # (N,) each
    return {
        "tools/calls_per_rollout": calls.mean().item(),
        "tools/failures": failures.sum().item(),
        "tools/failures_per_rollout": failures.mean().item(),
        "turns/mean": turns.mean().item(),
        "turns/max_turns_ratio": max_turns.mean().item(),
    }


def _mean(values: torch.Tensor) -> float:
    """Mean over the scored values (NaN = not applicable); NaN when none is scored."""
    scored = values[~torch.isnan(values)]
    return scored.mean().item() if scored.numel() else math.nan


def _std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the scored values; 0 with fewer than two."""
    scored = values[~torch.isnan(values)]
    return scored.std() if scored.numel() > 1 else values.new_zeros(())
