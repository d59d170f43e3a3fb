"""Run by tests/test_distributed.py under `torchrun --nproc_per_node {1,2}`, in float64 (exact.py).

    update_worker.py OUT MODE OVERRIDES_JSON

MODE "learn": every process builds the same global rollout batch (same prompts, same per-completion
seeds), keeps the completions it owns (`trainer.rows`) and runs a training step on them (exact.step_on):
one step's updates on a fixed rollout batch. MODE "train": `Trainer.train()`, a whole (short) run.
Each process saves its starting and final parameters and the metrics to OUT/rank<r>.pt.

The reward is "shortness" (shorter completions score higher), except on the prompts listed in the
config's last prompts_per_step/2 prompts of a step, where it is 0 for every completion when
`half_constant` is in the overrides: those groups have no signal, so with beta 0 a process that
owns only them has no completion to back-propagate. With `multi_turn`, each completion gets a tool
result between two model turns (exact.with_tool_turns).
"""

import json
import sys
from pathlib import Path

import torch

from exact import float64_everywhere, step_on, with_tool_turns

from grpokit import distributed
from grpokit.config import load_config
from grpokit.rewards import REWARD_FUNCTIONS
from grpokit.trainer import Trainer

SILENT_PROMPTS: set = set()


def shortness(prompts, completions, **columns):
    return [0.0 if str(p) in SILENT_PROMPTS else -float(len(c[0]["content"])) for p, c in zip(prompts, completions)]


def main(out: str, mode: str, overrides: list[str]) -> None:
    float64_everywhere()
    REWARD_FUNCTIONS["shortness"] = shortness
    half_constant, multi_turn = "half_constant" in overrides, "multi_turn" in overrides
    overrides = [o for o in overrides if o not in ("half_constant", "multi_turn")]
    config = load_config(None, [
        "model.name=tiny-random", "model.dtype=float64", "reward.functions=[shortness]",
        "rollout.max_completion_length=6", "train.learning_rate=1e-3", "data.eval_size=0",
        f"train.output_dir={out}/run", *overrides,
    ])
    trainer = Trainer(config, progress=False)
    start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    if mode == "learn":
        P = config.train.prompts_per_step
        examples = [next(trainer.stream) for _ in range(P)]
        if half_constant:
            SILENT_PROMPTS.update(str(e.prompt) for e in examples[P // 2 :])
        whole = trainer.engine.generate(
            [trainer.encode(e) for e in examples], config.rollout.num_generations, trainer.sampling,
            seeds=range(config.completions_per_step),
        )
        if multi_turn:
            whole = with_tool_turns(whole, trainer.tokenizer("<tool_response>\n42\n</tool_response>")["input_ids"])
        metrics = step_on(trainer, examples, whole.select(trainer.rows))
    else:
        trainer.train()
        metrics = None
    params = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    torch.save({"start": start, "params": params, "metrics": metrics, "rows": trainer.rows},
               Path(out) / f"rank{distributed.rank()}.pt")
    distributed.finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
