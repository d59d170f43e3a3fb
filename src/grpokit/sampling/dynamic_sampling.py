"""Dynamic sampling (DAPO, Yu et al. 2025): train only on groups whose rewards differ.

A group whose scored rewards are all equal has advantage 0 for every member: it teaches nothing,
yet it takes a place in the batch (and dilutes the normalizers). With `rollout.dynamic_sampling`,
a step samples rounds of `prompts_per_step` prompts, keeps the informative groups, and stops once
it holds `prompts_per_step` of them, or after `rollout.max_sampling_rounds` rounds. The batch is
then the first `prompts_per_step` informative groups in sampling order (the surplus of the last
round is dropped, as DAPO does); when too few were found, it is filled with the equal-reward
groups sampled first, whose advantage is 0: they add no policy gradient, and the step trains on
what it found.

Everything here works on whole rounds (every process's completions, in global order), and what it
keeps depends only on the round's advantages (a group is informative when they are not all 0:
with several reward functions aggregated by normalize_then_sum, that is not the same as "its
summed rewards differ"): the batch is the same on any number of processes. The prompts
drawn and the sampling seeds come from the data stream and seed stream of the run's Sampler
(rollouts.py, which runs the rounds), which the checkpoint holds, so a resumed run samples
the same rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpokit.engines.batch import RolloutBatch


@dataclass
class Round:
    """One round of sampling, whole: `examples` (P), their completions (P * G, global order), their
    rewards and each function's, and the completions' records for monitor.log_completions."""

    examples: list
    batch: RolloutBatch
    rewards: torch.Tensor  # (P * G,)
    per_function: dict[str, torch.Tensor]  # name -> (P * G,)
    samples: list[dict]


@dataclass
class Collector:
    """The rounds of one step, and the batch they make."""

    prompts_per_step: int
    group_size: int
    kept: list[tuple[Round, int]] = field(default_factory=list)  # (round, group) informative, in sampling order
    spare: list[tuple[Round, int]] = field(default_factory=list)  # (round, group) equal rewards
    rounds: int = 0
    prompts: int = 0

    def add(self, r: Round, informative: torch.Tensor) -> None:
        """A round, and which of its groups are informative ((P,) bool: those whose advantages are
        not all 0, however the run computes advantages)."""
        for group, useful in enumerate(informative.tolist()):
            (self.kept if useful else self.spare).append((r, group))
        self.rounds += 1
        self.prompts += len(r.examples)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.prompts_per_step

    def batch(self) -> tuple[list, RolloutBatch, torch.Tensor, dict[str, torch.Tensor], list[dict]]:
        """(examples, completions, rewards, per-function rewards, records) of the step's batch:
        prompts_per_step groups, the informative first."""
        P, G = self.prompts_per_step, self.group_size
        chosen = (self.kept + self.spare)[:P]
        parts = []
        for r, group in chosen:
            part = r.batch.select(torch.arange(group * G, (group + 1) * G))
            part.prompt_index = torch.full((G,), len(parts), dtype=torch.long)
            parts.append(part)

        def rows(values: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([v[group * G:(group + 1) * G] for v, (_, group) in zip(values, chosen)])

        rewards = rows([r.rewards for r, _ in chosen])  # (P * G,)
        per_function = {name: rows([r.per_function[name] for r, _ in chosen]) for name in chosen[0][0].per_function}
        samples = [s for r, group in chosen for s in r.samples[group * G:(group + 1) * G]]
        return [r.examples[group] for r, group in chosen], RolloutBatch.concat(parts), rewards, per_function, samples

    def metrics(self) -> dict[str, float]:
        """dynamic_sampling/*: rounds, prompts sampled, informative groups found and kept (the rest
        of the batch is filled with equal-reward groups)."""
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/prompts_sampled": float(self.prompts),
            "dynamic_sampling/groups_found": float(len(self.kept)),
            "dynamic_sampling/groups_kept": float(min(len(self.kept), self.prompts_per_step)),
        }
