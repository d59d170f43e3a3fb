"""grpokit: GRPO training for language models, correct by construction and fast on a laptop.

From Python: `grpokit.train(...)` (api.py) and `grpokit.from_trl(...)` (trl_config.py).
"""

__version__ = "0.1.0"
__all__ = ["train", "TrainResult", "from_trl"]


def __getattr__(name):  # imported on first use: `import grpokit` (and the CLI) stays light
    if name in ("train", "TrainResult"):
        from grpokit import api

        return getattr(api, name)
    if name == "from_trl":
        from grpokit.trl_config import from_trl

        return from_trl
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")
