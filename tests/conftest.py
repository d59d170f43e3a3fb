import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): one core for each worker
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and for the processes the tests start


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random policy and the real SmolLM2 tokenizer (converted once, then cached)."""
    from grpokit.models import load_model, load_tokenizer

    return load_model("tiny-random"), load_tokenizer("tiny-random")
