"""The configuration: its tree of sections and fields (settings/schema.py), reading it from YAML, overrides
and Python (loading.py), the settings each variant alone reads (variants.py), and every rule about
settings that cannot go together (checks.py)."""

from grpokit.config.checks import Facts, ModelFacts, check, choices, facts, problems
from grpokit.config.loading import describe, flatten, load_config, parse_override, save_config, settle
from grpokit.config.variants import VARIANT_SETTINGS, Variant, reset_unused, unused_settings
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.settings.schema import (DECODERS, AlgorithmConfig, Config, DataConfig, ModelConfig, MonitorConfig,
                                     RewardConfig, RolloutConfig, TrainConfig, reward_specs, setting)

__all__ = ["DECODERS", "VARIANT_SETTINGS", "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "Facts",
           "ModelConfig", "ModelFacts", "MonitorConfig", "RewardConfig", "RolloutConfig", "StartupError", "TrainConfig",
           "Variant", "check", "choices", "describe", "facts", "flatten", "load_config", "parse_override", "problems",
           "reset_unused", "reward_specs", "save_config", "setting", "settle", "unused_settings"]
