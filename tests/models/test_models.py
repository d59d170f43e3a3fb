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


def test_each_tokenizer_loaded_has_settings_of_its_own():
    """load_tokenizer gives each caller its own chat template and special tokens over one read of
    the vocabulary; tiny-random-vlm's image tokens stay out of the text model's."""
    from grpokit.models.bundled import tiny_vlm_processor

    first, second = load_tokenizer("tiny-random"), load_tokenizer("tiny-random")
    size = len(first)
    first.chat_template = "{{ messages[0]['content'] }}"
    first.pad_token = "<|im_start|>"
    assert second.chat_template != first.chat_template and second.pad_token_id == second.eos_token_id
    assert first("What is 6 * 7?")["input_ids"] == second("What is 6 * 7?")["input_ids"]
    vlm, other = tiny_vlm_processor().tokenizer, tiny_vlm_processor().tokenizer
    assert "<image>" in vlm.get_vocab() and "<end_of_utterance>" in vlm.get_vocab() and len(vlm) > size
    vlm.chat_template = "{{ messages[0]['content'] }}"
    assert other.chat_template != vlm.chat_template and len(other) == len(vlm)
    assert len(load_tokenizer("tiny-random")) == len(second) == size and "<image>" not in second.get_vocab()
