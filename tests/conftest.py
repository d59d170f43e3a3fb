import pytest


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random policy and the real SmolLM2 tokenizer (converted once, then cached)."""
    from grpokit.models import load_model, load_tokenizer

    return load_model("tiny-random"), load_tokenizer("tiny-random")
