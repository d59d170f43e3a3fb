"""Models: loading one by model.name, LoRA, freezing, saving (loading.py); the models grpokit brings
(bundled.py); chat templates (templates.py); a vision-language model's processor and the image
inputs of a pass (vision.py); the per-token log-prob passes (logprobs.py)."""

from grpokit.models.bundled import BUNDLED, BUNDLED_VLM, TINY, TINY_VLM, bundled_model_path, bundled_vlm_path
from grpokit.models.loading import DTYPES, eos_token_ids, load_model, load_processor, load_tokenizer, save_model

__all__ = ["BUNDLED", "BUNDLED_VLM", "DTYPES", "TINY", "TINY_VLM", "bundled_model_path", "bundled_vlm_path",
           "eos_token_ids", "load_model", "load_processor", "load_tokenizer", "save_model"]
