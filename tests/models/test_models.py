"""The bundled model: converted once from GGUF, cached, and savable as a plain HF folder."""

import pytest
import torch

from grpokit.models.bundled import BUNDLED
from grpokit.models.loading import load_model, load_tokenizer, save_model


@pytest.fixture(scope="module")
def bundled():
    return load_model(BUNDLED), load_tokenizer(BUNDLED)


def test_bundled_model_loads_with_chat_template(bundled):
    model, tokenizer = bundled
    assert model.dtype == torch.float32 and model.training
    assert tokenizer.chat_template and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_bundled_model_saves_and_reloads(bundled, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = bundled
    save_model(model, tokenizer, tmp_path / "final")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert getattr(reloaded.config, "quantization_config", None) is None
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
