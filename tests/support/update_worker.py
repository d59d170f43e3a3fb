"""Run by tests/training/test_distributed.py (and the vision and agent tests) on 1 and 2 processes of one
run (support/processes.py: `run_worker`, as torchrun starts them), in float64 (exact.py).

    update_worker.py OUT MODE OVERRIDES_JSON

MODE "learn": every process builds the same global rollout batch (same prompts, same per-completion
seeds), keeps the completions it owns (`trainer.sampler.rows`) and runs a training step on them (exact.step_on):
one step's updates on a fixed rollout batch. MODE "learn-each": "learn" for each of a list of
override lists, one after the other in the same processes. MODE "train": `Trainer.train()`, a whole
(short) run. Each process saves its starting and final parameters and the metrics to OUT/rank<r>.pt
(a list of those with "learn-each").

The reward is "shortness" (shorter completions score higher), except on the prompts listed in the
config's last prompts_per_step/2 prompts of a step, where it is 0 for every completion when
`half_constant` is in the overrides: those groups have no signal, so with beta 0 a process that
owns only them has no completion to back-propagate. With `multi_turn`, each completion gets a tool
result between two model turns (exact.with_tool_turns). With `ragged`, completions are cut to
ragged lengths (exact.cut_ragged). With `off_sampler`, the sampling log-probs
are moved off the trainer's (as vLLM's would be) and the rollout importance weight is on. "oddness"
is a second reward (the completion's length is odd) and "parity" is shortness on prompts with an odd
answer and 0 on the others (about half the groups teach nothing, for dynamic sampling). With
`vision:<build>` the model is that tiny vision-language build (vlms.py), its prompts with images
(data.path names them).
"""

import json
import sys
from pathlib import Path

import torch

from support.exact import cut_ragged, float64_everywhere, off_the_sampler, step_on, with_tool_turns
from support.vlms import BUILDS

from grpokit.config.loading import load_config
from grpokit.engines.prompts import images_of
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.rewards.reward_set import REWARD_FUNCTIONS
from grpokit.runtime import distributed
from grpokit.training.trainer import Trainer

SILENT_PROMPTS: set = set()


def shortness(prompts, completions, **columns):
    return [0.0 if str(p) in SILENT_PROMPTS else -float(len(c[0]["content"])) for p, c in zip(prompts, completions)]


def oddness(completions, **columns):
    return [float(len(c[0]["content"]) % 2) for c in completions]


def parity(completions, answer, **columns):
    return [-float(len(c[0]["content"])) if int(a) % 2 else 0.0 for c, a in zip(completions, answer)]


def main(out: str, mode: str, overrides: list) -> None:
    float64_everywhere()
    REWARD_FUNCTIONS.update(shortness=shortness, oddness=oddness, parity=parity)
    if mode == "learn-each":
        results = [run(f"{out}/{i}", "learn", each) for i, each in enumerate(overrides)]
    else:
        results = run(out, mode, overrides)
    torch.save(results, Path(out) / f"rank{distributed.rank()}.pt")
    distributed.finish()


def run(out: str, mode: str, overrides: list[str]) -> dict:
    flags = ("half_constant", "multi_turn", "off_sampler", "ragged")
    half_constant, multi_turn, off_sampler, ragged = (flag in overrides for flag in flags)
    vision = next((o.removeprefix("vision:") for o in overrides if o.startswith("vision:")), None)
    overrides = [o for o in overrides if o not in flags and not o.startswith("vision:")]
    model, processor = (None, None) if vision is None else BUILDS[vision](torch.float64)
    # off_sampler: sampled by other kernels than the trainer's, as vLLM's (exact.off_the_sampler).
    TransformersEngine.exact_logprobs = not off_sampler
    config = load_config(None, [
        f"model.name={vision or 'tiny-random'}", "model.dtype=float64", "reward.functions=[shortness]",
        "rollout.max_completion_length=6", "train.learning_rate=1e-3", "data.eval_size=0",
        f"train.output_dir={out}/run", *overrides,
    ])
    trainer = Trainer(config, progress=False, model=model, tokenizer=processor)
    start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    if mode == "learn":
        P = config.train.prompts_per_step
        examples = [next(trainer.sampler.stream) for _ in range(P)]
        if half_constant:
            SILENT_PROMPTS.update(str(e.prompt) for e in examples[P // 2 :])
        whole = trainer.sampler.engine.generate(
            [trainer.sampler.kind.encoder(e) for e in examples], config.rollout.num_generations, trainer.sampler.sampling,
            seeds=range(config.completions_per_step), **images_of(examples, trainer.vision),
        )
        if ragged:
            whole = cut_ragged(whole, trainer.tokenizer.eos_token_id)
        if multi_turn:
            whole = with_tool_turns(whole, trainer.tokenizer("<tool_response>\n42\n</tool_response>")["input_ids"])
        if off_sampler:
            whole = off_the_sampler(trainer, whole)
        metrics = step_on(trainer, examples, whole.select(trainer.sampler.rows))
    else:
        trainer.train()
        metrics = None
    params = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    return {"start": start, "params": params, "metrics": metrics, "rows": trainer.sampler.rows}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
