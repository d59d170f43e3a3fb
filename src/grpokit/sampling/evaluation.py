"""Scoring a model on held-out prompts: during training (greedy, every `eval_every` steps) and with
`grpokit eval` (api.evaluate: greedy, or k samples per prompt with pass@k).

pass@k is reported for each reward function whose values are all 0 or 1 (a verifiable "right or
wrong"): the fraction of prompts with at least one of their k samples scored 1. With exactly k
samples per prompt this is the unbiased estimator of Chen et al. (2021) for n = k.
"""

from __future__ import annotations

import math

from grpokit.engines.batch import SamplingParams, decode_completions
from grpokit.rewards.reward_set import RewardLog, RewardSet, merge_metrics
from grpokit.rollouts.kinds import RolloutKind
from grpokit.tasks.task import Example


def score(kind: RolloutKind, engine, tokenizer, rewards: RewardSet, examples: list[Example], params: SamplingParams,
          num_samples: int = 1, seed: int = 0, first_index: int = 0, batch_size: int = 64, state=None,
          logged: dict | None = None) -> list[dict]:
    """One record per completion of `examples`, sampled by `engine` as the rollout `kind` does:
    example index, sample number, completion (its text, or with tools the conversation's
    messages), rewards, and the columns the reward functions log_extra'ed. state: the reward
    functions' trainer_state; logged: filled with the values they log_metric'ed (name -> values)."""
    records = []
    logged = {} if logged is None else logged
    per_call = max(1, batch_size // num_samples)
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        seeds = None
        if params.temperature > 0:  # completion (example i, sample j) has its own seed
            seeds = [seed * 1_000_003 + (first_index + start + i) * num_samples + j
                     for i in range(len(chunk)) for j in range(num_samples)]
        batch = kind.generate(engine, chunk, [num_samples] * len(chunk), params, seeds)
        grouped = [e for e in chunk for _ in range(num_samples)]
        prompts = batch.prompts(grouped)
        completions = decode_completions(tokenizer, batch, prompts, rewards.reasoning)
        log = RewardLog(len(completions))
        total, by_name = rewards(grouped, completions, batch.finish_reasons, batch.completion_id_lists(),
                                 batch.environments(), prompts=prompts, state=state, log=log)
        logged.update(merge_metrics(logged, log.metrics))
        lengths = batch.trained_mask.sum(-1).tolist()
        for row in range(len(grouped)):
            records.append({
                "index": first_index + start + row // num_samples,
                "sample": row % num_samples,
                "completion": (completions[row] if batch.conversations is not None
                               else completions[row][0]["content"] if isinstance(completions[row], list)
                               else completions[row]),
                "reward": _plain(total[row].item()),
                "rewards": {name: _plain(values[row].item()) for name, values in by_name.items()},
                "length": lengths[row],
                "truncated": batch.finish_reasons[row] == "length",
                **log.record(row),
            })
    return records


def _plain(value: float) -> float | None:
    return None if math.isnan(value) else value


def _mean(values: list) -> float:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else math.nan


def summarize(records: list[dict], names: list[str], num_samples: int = 1, prefix: str = "eval/") -> dict:
    """Mean reward (total and per function, over scored completions), length, truncation, pass@k."""
    metrics = {
        f"{prefix}reward": _mean([r["reward"] for r in records]),
        **{f"{prefix}rewards/{n}/mean": _mean([r["rewards"][n] for r in records]) for n in names},
        f"{prefix}completions/mean_length": _mean([r["length"] for r in records]),
        f"{prefix}completions/clipped_ratio": _mean([float(r["truncated"]) for r in records]),
    }
    if num_samples > 1:
        for n in names:
            values = [r["rewards"][n] for r in records]
            if all(v in (0.0, 1.0, None) for v in values):
                solved: dict[int, bool] = {}  # prompts with at least one scored sample
                for r in records:
                    if r["rewards"][n] is not None:
                        solved[r["index"]] = solved.get(r["index"], False) or r["rewards"][n] == 1.0
                metrics[f"{prefix}rewards/{n}/pass@{num_samples}"] = (
                    sum(solved.values()) / len(solved) if solved else math.nan)
    return metrics
