"""Partial rollouts (rollout.partial): a step never waits for its longest completion.

A step's completions decode in rounds of at most rollout.partial_tokens tokens each. The step
trains train.prompts_per_step (P) groups whose G completions have all ended, those begun earliest
first. When a round leaves fewer than P ended, rollout.partial_spare new groups start beside the
others (once a step) and another round decodes every unfinished completion, until P have ended;
where the engine can be stopped (the in-process engine's `until`), that second round runs until P
have ended rather than partial_tokens, so a step makes at most two.
What the step does not train is carried into the next: ended groups wait there, unfinished
completions go on under the new weights. A continuation is a generation whose prompt is the
prompt and the completion's tokens so far, so the engine recomputes that prefix under the new
weights and each token is sampled from the policy of its own step given everything before it; any
engine that generates from token ids continues a completion so. Every token keeps its sampling
log-prob and the weights version that sampled it (the step whose weights they were: a step
samples with the weights after the one before it); the trainer's importance weights
(rollout.is_correction, algorithm/loss.py) are per token, between the policy before the update
and the one that sampled that token. A group begun more than rollout.partial_max_lag versions ago
is dropped and counted.

Generated ahead (rollout.max_staleness, sampling/sampler.py), a step's rounds run in the
pipeline's thread with the weights the schedule gives that step, which tag its tokens.

A step with nothing carried whose groups all end in the first round (rollout.partial_tokens at
least rollout.max_completion_length) draws the same prompts and seeds and makes the same engine
call as a step without partial rollouts: the same step, bit for bit.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# (Completion, here before it served a server's segments too: checkpoints name it here)
from grpokit.engines.batch import Completion, RolloutBatch, SamplingParams
from grpokit.tasks.task import Example

# A checkpoint's carried groups (pickled: their examples' columns are the task's own values).
PARTIAL_FILE = "partial_rollouts.pkl"


@dataclass
class Group:
    example: Example
    prompt: list[int]  # the prompt's token ids
    completions: list[Completion]
    begun: int  # the weights version of its first tokens

    @property
    def ended(self) -> bool:
        return all(c.finish is not None for c in self.completions)

    @property
    def fresh(self) -> bool:
        return all(not c.tokens and c.finish is None for c in self.completions)


@dataclass
class Step:
    """What a step of partial rollouts gives the trainer."""

    examples: list[Example]  # the P trained groups' prompts
    batch: RolloutBatch  # their completions, grouped by prompt
    drawn: int  # prompts drawn from the data stream in this step
    metrics: dict[str, float]
    versions: list[list[int]]  # each trained completion's tokens' weights versions
    lagged: bool  # some trained token was sampled by older weights than the step's


class Partial:
    def __init__(self, config, pad_id: int, device: torch.device):
        r = config.rollout
        self.P, self.G = config.train.prompts_per_step, r.num_generations
        self.budget, self.longest = r.partial_tokens, r.max_completion_length
        self.spare, self.max_lag = r.partial_spare or self.P, r.partial_max_lag
        self.pad_id, self.device = pad_id, device
        # The groups carried into the next step. A step works on copies, so that the list a
        # checkpoint captured is the state from before that step.
        self.carried: list[Group] = []
        self.dtypes = (torch.float32, torch.float32)  # the engine's sampling log-probs' and entropies' (None: none)

    def step(self, version: int, engine, encode: Callable[[Example], list[int]], draw: Callable[[int], list[Example]],
             seeds: Callable[[int], torch.Tensor], params: SamplingParams, stops: bool = False) -> Step:
        """A step sampling with weights `version`: encode(example) gives a prompt's token ids,
        draw(k) the data stream's next k examples, seeds(n) n sampling seeds from the seed stream;
        `stops`: the engine's generate takes `until` (the in-process engine), so the rounds after
        the first run until enough groups have ended rather than partial_tokens each."""
        pool = copy.deepcopy(self.carried)
        dropped = [g for g in pool if version - g.begun > self.max_lag]
        pool = [g for g in pool if not any(g is d for d in dropped)]
        drawn = max(0, self.P - len(pool))
        pool += self._start(draw(drawn), encode, version)
        rounds, spared, batch = 0, False, None
        while len(ended := [g for g in pool if g.ended]) < self.P:
            if rounds and not spared:  # the first round left too few ended: more groups beside them
                pool += self._start(draw(self.spare), encode, version)
                drawn, spared = drawn + self.spare, True
            batch = self._round(engine, pool, version, seeds, params, stops and spared)
            self.dtypes = (batch.sampling_logps.dtype, None if batch.entropies is None else batch.entropies.dtype)
            rounds += 1
        trained = sorted(ended, key=lambda g: g.begun)[:self.P]  # (stable: in the pool's order)
        self.carried = [g for g in pool if not any(g is t for t in trained)]
        whole = rounds == 1 and len(trained) == len(pool) and all(g.begun == version for g in trained)
        versions = [c.versions for g in trained for c in g.completions]
        lags = torch.tensor([version - v for row in versions for v in row], dtype=torch.float64)
        metrics = {"partial/rounds": rounds, "partial/carried_groups": len(self.carried),
                   "partial/dropped_groups": len(dropped),
                   "partial/lag_mean": lags.mean().item() if lags.numel() else 0.0,
                   "partial/lag_max": lags.max().item() if lags.numel() else 0.0}
        # A step as it would be without partial rollouts: the engine's own batch, as it came.
        out = batch if whole else assemble(trained, self.pad_id, *self.dtypes).to(self.device)
        return Step([g.example for g in trained], out, drawn, metrics, versions,
                    bool(lags.numel()) and lags.max().item() > 0)

    def _start(self, examples: list[Example], encode, version: int) -> list[Group]:
        return [Group(e, encode(e), [Completion([], [], [], []) for _ in range(self.G)], version) for e in examples]

    def _round(self, engine, pool: list[Group], version: int, seeds, params: SamplingParams,
               until_enough: bool = False) -> RolloutBatch:
        """Decode every unfinished completion of `pool`: a fresh group from its prompt (one prefill
        for its G completions), a begun one from its prompt and tokens so far; by at most
        partial_tokens tokens, or, `until_enough`, until train.prompts_per_step groups of the pool
        have ended (the engine asked after every token). The engine's batch of this round."""
        prompts, counts, targets, owners = [], [], [], []
        for g in pool:
            if g.fresh:
                prompts.append(g.prompt)
                counts.append(self.G)
                targets += g.completions
                owners.append(list(range(len(targets) - self.G, len(targets))))
            else:
                mine = []
                for c in g.completions:
                    if c.finish is None:
                        prompts.append(g.prompt + c.tokens)
                        counts.append(1)
                        targets.append(c)
                        mine.append(len(targets) - 1)
                if mine:
                    owners.append(mine)
        rooms = [self.longest - len(c.tokens) for c in targets]
        extra = {}
        if until_enough:
            ended_before, room = sum(g.ended for g in pool), torch.tensor(rooms)

            def enough(stopped: torch.Tensor, count: torch.Tensor) -> bool:
                done = (stopped.cpu() | (count.cpu() >= room)).tolist()  # (N,) each row ended, in its room
                return ended_before + sum(all(done[r] for r in rows) for rows in owners) >= self.P

            extra = {"until": enough}
        batch = engine.generate(prompts, counts, replace(params, max_tokens=max(rooms) if until_enough else
                                                         min(self.budget, max(rooms))), seeds(len(targets)).tolist(),
                                **extra)
        for i, (c, n) in enumerate(zip(targets, batch.completion_mask.sum(-1).tolist())):
            c.extend(batch, i, n, self.longest, version)
        return batch

    # ---------------------------------------------------------------- checkpoints

    def save(self, folder: Path, carried: list[Group] | dict) -> None:
        """Write `carried` (the groups carried at the moment captured; generating ahead, the sampling
        state after the last step queued: rollouts.py) into checkpoint `folder`."""
        saved = carried if isinstance(carried, dict) else {"carried": carried, "dtypes": self.dtypes}
        (folder / PARTIAL_FILE).write_bytes(pickle.dumps(saved))

    def restore(self, folder: Path) -> dict | None:
        """Take back the groups a checkpoint carried; what it saved (None: nothing)."""
        from grpokit.sampling.pipeline import _Unpickler

        path = folder / PARTIAL_FILE
        if not path.is_file():  # (a checkpoint of a run without partial rollouts carries nothing)
            return None
        saved = _Unpickler(io.BytesIO(path.read_bytes())).load()
        self.carried, self.dtypes = saved["carried"], saved["dtypes"]
        return saved


def assemble(groups: list[Group], pad_id: int, logp_dtype: torch.dtype, entropy_dtype: torch.dtype | None) -> RolloutBatch:
    """The RolloutBatch of `groups`' completions, grouped by prompt, in their order."""
    rows = [(i, g.prompt, c) for i, g in enumerate(groups) for c in g.completions]
    width, T = max(len(p) for _, p, _ in rows), max(1, max(len(c.tokens) for *_, c in rows))
    N = len(rows)
    prompt_ids, prompt_mask = torch.full((N, width), pad_id, dtype=torch.long), torch.zeros((N, width), dtype=torch.long)
    completion_ids, completion_mask = torch.full((N, T), pad_id, dtype=torch.long), torch.zeros((N, T), dtype=torch.long)
    logps = torch.zeros((N, T), dtype=logp_dtype)
    measured = entropy_dtype is not None and all(c.entropies is not None for *_, c in rows)
    entropies = torch.zeros((N, T), dtype=entropy_dtype) if measured else None
    for r, (_, prompt, c) in enumerate(rows):
        k = len(c.tokens)
        prompt_ids[r, width - len(prompt):], prompt_mask[r, width - len(prompt):] = torch.tensor(prompt), 1
        completion_ids[r, :k], completion_mask[r, :k] = torch.tensor(c.tokens, dtype=torch.long), 1
        logps[r, :k] = torch.tensor(c.logps, dtype=logp_dtype)
        if measured:
            entropies[r, :k] = torch.tensor(c.entropies, dtype=entropy_dtype)
    return RolloutBatch(prompt_index=torch.tensor([i for i, *_ in rows]), prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                        completion_ids=completion_ids, completion_mask=completion_mask, sampling_logps=logps,
                        entropies=entropies, finish_reasons=[c.finish for *_, c in rows])
