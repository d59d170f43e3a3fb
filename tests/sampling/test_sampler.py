"""The Sampler, which makes a step's batch: the step's prompts and this process's completions of
them, scored, whatever made them; the same seed gives the same step."""

import torch

from grpokit.config.loading import load_config
from grpokit.rundir.folder import release_run_dir
from grpokit.training import setup
from grpokit.training.state import Progress

RUN = ["model.name=tiny-random", "train.prompts_per_step=2", "rollout.num_generations=3",
       "rollout.max_completion_length=5", "data.eval_size=2"]


def first_step(tmp_path, name: str, *overrides):
    config = load_config(None, [*RUN, f"train.output_dir={tmp_path / name}", *overrides])
    parts = setup.build(config, "train")
    try:
        state = Progress().trainer_state(config, parts.prepared.task)
        return parts.sampler.step(1, parts.scorer, state), parts.sampler.rows
    finally:
        parts.sampler.close()
        release_run_dir(parts.run_dir)


def test_a_step_is_its_prompts_and_this_process_completions_scored(tmp_path):
    sampled, rows = first_step(tmp_path, "a")
    assert len(sampled.examples) == 2 and sampled.drawn == 2  # the step's prompts, drawn from the data stream
    assert sampled.batch.completion_ids.shape[0] == len(rows) == 6  # one process owns every completion
    assert sampled.scored.rewards.shape == (6,)
    again, _ = first_step(tmp_path, "b")
    assert [e.prompt for e in again.examples] == [e.prompt for e in sampled.examples]
    assert torch.equal(again.batch.completion_ids, sampled.batch.completion_ids)  # seeded per completion
    other, _ = first_step(tmp_path, "c", "train.seed=1")
    assert not torch.equal(other.batch.completion_ids, sampled.batch.completion_ids) or \
        [e.prompt for e in other.examples] != [e.prompt for e in sampled.examples]
