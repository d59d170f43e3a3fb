"""Run by tests/test_distributed.py under `torchrun --nproc_per_node {1,2}`.

Every process builds the same global rollout batch (same prompts, same sampling seed), keeps the
completions it owns (`trainer.rows`) and runs `Trainer.learn` on them: one step's updates on a fixed
rollout batch, computed by however many processes torchrun started. Each process saves its
parameters and the step's metrics to <out>/rank<r>.pt.
"""

import json
import sys
from pathlib import Path

import torch

from exact import float64_everywhere

from grpokit import distributed
from grpokit.config import load_config
from grpokit.rewards import REWARD_FUNCTIONS
from grpokit.trainer import Trainer


def shortness(completions, **columns):
    return [-float(len(c[0]["content"])) for c in completions]


def main(out: str, overrides: list[str]) -> None:
    float64_everywhere()
    REWARD_FUNCTIONS["shortness"] = shortness
    config = load_config(None, [
        "model.name=tiny-random", "model.dtype=float64", "reward.functions=[shortness]",
        "rollout.max_completion_length=6", "train.learning_rate=1e-3", "data.eval_size=0",
        f"train.output_dir={out}/run", *overrides,
    ])
    trainer = Trainer(config, progress=False)
    start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    examples = [next(trainer.stream) for _ in range(config.train.prompts_per_step)]
    whole = trainer.engine.generate(
        [trainer.encode(e) for e in examples], config.rollout.num_generations, trainer.sampling,
        torch.Generator().manual_seed(1234),
    )
    metrics = trainer.learn(examples, whole.select(trainer.rows))
    params = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    torch.save({"start": start, "params": params, "metrics": metrics, "rows": trainer.rows},
               Path(out) / f"rank{distributed.rank()}.pt")
    distributed.finish()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
