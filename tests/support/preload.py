"""What the processes of support/processes.py find imported when they start: grpokit and the
libraries its commands import, and the bundled tokenizer read once. Imported once per pytest
worker, in its multiprocessing forkserver (never in a test's own process)."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed, where installed, says nothing on import

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401 - the model card's plot
import transformers.models.idefics3.modeling_idefics3  # noqa: E402,F401
import transformers.models.llama.modeling_llama  # noqa: E402,F401

import grpokit.api  # noqa: E402,F401
import grpokit.cli  # noqa: E402,F401
import grpokit.engines.client  # noqa: E402,F401
from grpokit.models.bundled import bundled_tokenizer  # noqa: E402
import grpokit.rollouts.kinds  # noqa: E402,F401
import grpokit.server  # noqa: E402,F401
import grpokit.training.trainer  # noqa: E402,F401

try:
    import deepspeed  # noqa: E402,F401 - the sharding tests' ZeRO runs
except ImportError:
    pass

bundled_tokenizer()  # read from its JSON files; never used to encode here (no tokenizer threads before a fork)
