"""grpokit: GRPO training for language models, correct by construction and fast on a laptop."""

__version__ = "0.1.0"
