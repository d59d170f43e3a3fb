"""Scoring a step's completions: the reward functions, group-relative advantages, and which
completions need a forward/backward pass.

Each process scores the completions it owns; the rewards are gathered into the whole step's (in
global order) before the advantages are taken, so a group's advantages are those of the whole
group wherever its completions were generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpokit.algorithm.advantages import advantages as compute_advantages
from grpokit.algorithm.masks import loss_mask
from grpokit.engines.batch import RolloutBatch, decode_completions
from grpokit.rewards.reward_set import RewardLog, RewardSet
from grpokit.runtime import distributed
from grpokit.settings.schema import Config
from grpokit.tasks.task import Example


@dataclass
class Scored:
    """A step's completions, scored."""

    rewards: torch.Tensor  # (N,) the whole step's, all processes; NaN where no reward function applied
    per_function: dict[str, torch.Tensor]  # name -> (N,) each function's rewards
    advantages: torch.Tensor  # (n,) this process's completions', on the training device
    active: torch.Tensor  # (n,) bool: the completions that need a forward/backward pass
    samples: list[dict] = field(repr=False)  # this process's completions, as monitor.log_completions records them
    logged: dict[str, list[tuple]] = field(default_factory=dict)  # this process's log_metric (value, completions) pairs (rewards.RewardLog)
    failed: torch.Tensor | None = None  # (N,) bool, the whole step's: rollouts that failed (no reward, whatever the functions say)
    failures: list[dict] = field(default_factory=list)  # this process's records with a failure (failures.jsonl)

    def first_error(self) -> str | None:
        """The first reason a reward function logged for a completion it did not score: a
        `log_extra` record {"error": ...} (the judge's), as "<column>: <reason>"; None without one."""
        for sample in self.samples:
            for column, value in sample.items():
                if isinstance(value, dict) and value.get("error"):
                    return f"{column}: {value['error']}"
        return None

    @property
    def any_scored(self) -> bool:
        """Whether some reward function scored some completion of the step."""
        return not torch.isnan(self.rewards).all()

    @property
    def all_failed(self) -> bool:
        """Whether every rollout of the step failed (the rollout kind says why, and stops a run of such steps)."""
        return self.failed is not None and bool(self.failed.all())


@dataclass
class Rewarded:
    """The reward functions' verdict on this process's completions of a step (or of a round)."""

    rewards: torch.Tensor  # (N,) the whole step's, gathered from every process, in global order
    per_function: dict[str, torch.Tensor]  # name -> (N,)
    samples: list[dict]  # this process's records of them, with the columns the functions log_extra'ed
    logged: dict[str, list[tuple]]  # the (value, completions) pairs they log_metric'ed
    failed: torch.Tensor | None = None  # (N,) bool: rollouts that failed, in global order
    failures: list[dict] = field(default_factory=list)  # this process's records of completions with a failure


def failures(samples: list[dict], batch: RolloutBatch) -> list[dict]:
    """Those of this process's `samples` (of `batch`) that record a failure: a rollout that failed, a
    reward function's call that gave no score (a log_extra record with an "error": the judge's),
    a tool call that failed (the conversation's count, or an agent's malformed tool call)."""
    failed = batch.failed().tolist()
    tools = None if batch.conversations is None else [c.failures for c in batch.conversations]
    return [sample for i, sample in enumerate(samples)
            if failed[i] or (tools is not None and tools[i]) or sample.get("tool_call_problems") or
            any(isinstance(v, dict) and v.get("error") for v in sample.values())]


class Scorer:
    def __init__(self, config: Config, tokenizer, rewards: RewardSet, rows: torch.Tensor, device: torch.device,
                 lockstep: bool, balanced: bool = False):
        """rows: the step's completions this process owns, in update order (distributed.shard_rows);
        lockstep: every process must make every forward call (sharded weights): every row runs;
        balanced: the loss has a load-balancing term (algorithm/load_balancing.py), of every sequence."""
        self.config, self.tokenizer, self.rewards = config, tokenizer, rewards
        self.rows, self.device, self.lockstep, self.balanced = rows, device, lockstep, balanced

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
        completions = decode_completions(self.tokenizer, batch, prompts, self.rewards.reasoning)
        log = RewardLog(len(completions))
        cut = [isinstance(c, list) and any(m.get("reasoning_cut") for m in c) for c in completions]
        if self.rewards.reasoning is not None and self.rewards.reasoning.kind != "none":  # cut inside its reasoning
            log.metrics["completions/reasoning_cut_ratio"] = [(sum(cut) / max(len(cut), 1), len(cut))]
        local_rewards, local_per_function = self.rewards(
            owned, completions, batch.finish_reasons, batch.completion_id_lists(), batch.environments(),
            prompts=prompts, state=state, log=log)  # (n,)
        failed = batch.failed()  # (n,)
        if failed.any():  # a failed rollout has no reward, whatever the functions made of its (empty) text
            local_rewards = local_rewards.masked_fill(failed, float("nan"))
            local_per_function = {k: v.masked_fill(failed, float("nan")) for k, v in local_per_function.items()}
        samples = [
            {"prompt": p, **({} if batch.images is None else {"images": list(batch.images[i])}), "completion": c,
             "finish_reason": f, "reward": r.item(),
             **{f"rewards/{name}": v[i].item() for name, v in local_per_function.items()}, **log.record(i)}
            for i, (p, c, f, r) in enumerate(zip(prompts, completions, batch.finish_reasons, local_rewards))
        ]
        rewards = distributed.gather_rows(local_rewards, N, U)  # (N,) in global order
        per_function = {k: distributed.gather_rows(v, N, U) for k, v in local_per_function.items()}
        failed = distributed.gather_rows(failed.to(torch.uint8), N, U).bool()  # (N,) (gloo gathers no bool)
        return Rewarded(rewards, per_function, samples, log.metrics, failed, failures(samples, batch))

    def advantages(self, batch: RolloutBatch, rewarded: Rewarded, rows: torch.Tensor | None = None) -> Scored:
        """The step's advantages (algorithm/advantages.py) from the whole step's rewards, kept for the
        completions `batch` (this process's rows, or `rows`), and which of them need a forward/backward pass."""
        a, G = self.config.algorithm, self.config.rollout.num_generations
        if rewarded.per_function:
            stacked = torch.stack(list(rewarded.per_function.values()), 1)  # (N, K)
            weights = torch.tensor(self.rewards.weights, dtype=stacked.dtype)
            advantages = compute_advantages(rewarded.rewards, stacked, weights, G, a.advantage_estimator,
                                            a.scale_rewards, a.reward_aggregation)
        else:  # no reward function: a teacher's per-token signal alone (distill.teacher)
            advantages = torch.zeros_like(rewarded.rewards)
        advantages = advantages[self.rows if rows is None else rows]  # (n,)
        # With no KL term (nor a per-token term), a completion with advantage exactly 0 adds exactly 0 to the loss, its
        # gradient and the clip metrics: it needs no forward/backward at all; a completion whose
        # tokens all leave the loss (a masked truncated one) adds 0 with any beta. Sharded weights
        # need every process in every forward (training/sharding.py), so there every row runs.
        active = torch.ones_like(advantages, dtype=torch.bool)  # (n,)
        if not self.lockstep:
            # (an entropy bonus, a teacher's signal and a load-balancing term: every row has a gradient)
            if a.beta == 0 and a.entropy_coef == 0 and self.config.distill.teacher is None and not self.balanced:
                active &= advantages != 0
            active &= loss_mask(batch.trained_mask, batch.finish_reasons, a.mask_truncated_completions).cpu().any(-1)
        return Scored(rewarded.rewards, rewarded.per_function, advantages.to(self.device), active, rewarded.samples,
                      rewarded.logged, rewarded.failed, rewarded.failures)
