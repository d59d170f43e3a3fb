"""The config's sections as plain typed values: every field with its help, the derived sizes
computed from the fields and nowhere else, and a section usable alone (a part below config/ takes
the one it reads)."""

import dataclasses

from grpokit.settings.schema import Config, ModelConfig, RolloutConfig


def test_every_field_of_every_section_says_what_it_does():
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            assert f.metadata.get("help", "").strip(), f"{section.name}.{f.name} has no help"


def test_derived_sizes_come_from_the_fields():
    config = Config()
    config.train.prompts_per_step, config.rollout.num_generations = 4, 8
    config.train.updates_per_step, config.algorithm.num_iterations = 2, 3
    assert (config.completions_per_step, config.completions_per_update) == (32, 16)
    assert config.updates_per_step == 6  # optimizer updates a step: what trainer_state and the schedule count
    assert config.micro_batch_size(world_size=2) == 8  # a process's share of an update, by default
    config.train.micro_batch_size = 3
    assert config.micro_batch_size(world_size=2) == 3


def test_a_section_is_a_value_of_its_own():
    model, rollout = ModelConfig(name="tiny-random", dtype="float64"), RolloutConfig(engine="server", decode_slots=2)
    config = Config(model=model, rollout=rollout)
    assert config.model is model and config.rollout.decode_slots == 2
    assert config.given == set() and config.checked is None  # neither loaded nor checked: nothing recorded
    assert dataclasses.asdict(config)["model"]["dtype"] == "float64"
