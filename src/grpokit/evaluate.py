"""Scoring a model on held-out prompts: during training (greedy, every `eval_every` steps) and with
`grpokit eval` (greedy, or k samples per prompt with pass@k).

pass@k is reported for each reward function whose values are all 0 or 1 (a verifiable "right or
wrong"): the fraction of prompts with at least one of their k samples scored 1. With exactly k
samples per prompt this is the unbiased estimator of Chen et al. (2021) for n = k.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from grpokit import distributed
from grpokit.errors import ConfigError
from grpokit.rewards import RewardLog, RewardSet, merge_metrics, trainer_state
from grpokit.rollout import SamplingParams, decode_completions, images_of, prompt_ids
from grpokit.tasks import Example


def score(engine, tokenizer, rewards: RewardSet, examples: list[Example], params: SamplingParams,
          num_samples: int = 1, seed: int = 0, first_index: int = 0, max_prompt_length: int | None = None,
          batch_size: int = 64, multi_turn=None, state=None, logged: dict | None = None,
          vision=None) -> list[dict]:
    """One record per completion: example index, sample number, completion (its text, or with
    tools the conversation's messages), rewards, and the columns the reward functions log_extra'ed.
    multi_turn: a conversation.MultiTurn, with tools; state: the reward functions' trainer_state;
    logged: filled with the values they log_metric'ed (name -> values); vision: a vision-language
    model's vision.Vision."""
    records = []
    logged = {} if logged is None else logged
    per_call = max(1, batch_size // num_samples)
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        seeds = None
        if params.temperature > 0:  # completion (example i, sample j) has its own seed
            seeds = [seed * 1_000_003 + (first_index + start + i) * num_samples + j
                     for i in range(len(chunk)) for j in range(num_samples)]
        if multi_turn is not None:
            batch = multi_turn.generate(engine, chunk, [num_samples] * len(chunk), params, seeds)
        else:
            prompts = [prompt_ids(tokenizer, None, e, max_prompt_length, vision) for e in chunk]
            batch = engine.generate(prompts, num_samples, params, seeds, **images_of(chunk, vision))
        grouped = [e for e in chunk for _ in range(num_samples)]
        prompts = batch.prompts(grouped)
        completions = decode_completions(tokenizer, batch, prompts)
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


def _steps_trained(model: Path, config) -> int:
    """The steps of training behind a model folder, for reward functions' trainer_state: a run's
    checkpoints/step-N has N, its final/ the run's train.max_steps, any other model 0."""
    if model.parent.name == "checkpoints" and model.name.startswith("step-") and model.name[5:].isdigit():
        return int(model.name[5:])
    return config.train.max_steps if model.name == "final" and (model.parent / "config.yaml").is_file() else 0


def evaluate_model(config, model_path: str, num_samples: int = 1, output: str | None = None) -> dict:
    """`grpokit eval`: score the model in `model_path` on the held-out prompts of `config`'s data."""
    from grpokit.config import reward_specs
    from grpokit.models import eos_token_ids, load_model
    from grpokit.vision import processing
    from grpokit.rollout import make_engine
    from grpokit.rollout.agents import Agents
    from grpokit.rollout.conversation import MultiTurn
    from grpokit.rollout.tools import Tools
    from grpokit.tasks import make_task

    tokenizer, vision = processing(model_path)
    tools = Tools.from_config(config, tokenizer, model_path)
    task = make_task(config.data, seed=config.train.seed,
                     prompt_length=lambda e: len(prompt_ids(tokenizer, tools, e, vision=vision)))
    if not task.eval_examples:
        raise ConfigError(f"no held-out prompts to score: data.eval_size={config.data.eval_size} (a run trained "
                          "with data.eval_size=0 keeps that in its config): add data.eval_size=100, or data.eval_path")
    rewards = RewardSet(reward_specs(config, task.reward_functions), config.reward.timeout,
                        extra=Tools.rewards(tools) + Agents.rewards(config))
    for note in getattr(task, "notes", ()):
        print(note)
    model = load_model(model_path, config.model.dtype).to("cuda" if torch.cuda.is_available() else "cpu")
    engine = make_engine(config.rollout, model, tokenizer, eos_token_ids(model, tokenizer), model_path, vision=vision)
    multi_turn = Agents.from_config(config, tokenizer, eos_token_ids(model, tokenizer)) if config.rollout.agent else \
        None if tools is None else MultiTurn(tokenizer, tools, config.rollout.max_turns, eos_token_ids(model, tokenizer),
                                             config.data.max_prompt_length)
    r = config.rollout
    params = (SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k, r.min_p) if num_samples > 1
              else SamplingParams(r.max_completion_length, temperature=0.0))
    logged = {}
    with torch.no_grad():
        records = score(engine, tokenizer, rewards, task.eval_examples, params, num_samples, seed=config.train.seed,
                        max_prompt_length=config.data.max_prompt_length, multi_turn=multi_turn, logged=logged,
                        state=trainer_state(config, _steps_trained(Path(model_path), config)), vision=vision)
    if output:
        with Path(output).open("w") as f:
            for record in records:
                prompt = task.eval_examples[record["index"]].prompt
                f.write(json.dumps({"prompt": prompt, **record}, default=str) + "\n")
    return {**summarize(records, rewards.names, num_samples, prefix=""), **distributed.means(logged)}
