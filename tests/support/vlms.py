"""Tiny random-weight vision-language models built offline, with their processors, for tests:
Qwen2.5-VL (3-D rotary positions, image_grid_thw, patches flat over the batch), Idefics3 /
SmolVLM (the built-in tiny-random-vlm: images padded per row) and Gemma 3 (token_type_ids).
Each shares SmolLM2's tokenizer, with the model's image tokens added, and a ChatML template whose
user content may hold {"type": "image"} parts."""

from __future__ import annotations

import copy

import torch
from PIL import Image

from grpokit.models.bundled import TINY_VLM, bundled_tokenizer as _bundled_tokenizer
from grpokit.models.loading import load_model, load_processor

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


def _template(image: str) -> str:
    return ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image +
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _seeded(build):
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return build()
    finally:
        torch.random.set_rng_state(state)


def _ids(tokenizer):
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def qwen25_vl(dtype=torch.float32):
    """A Qwen2.5-VL model and processor: a 56x56 image is 4 tokens (2x2 merged patches of 14)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(Qwen2_5_VLProcessor):
        """Qwen's processor without its video processor, which needs torchvision."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = copy.deepcopy(_bundled_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                                "<|video_pad|>"]})
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56})
    processor = ImagesOnly(image_processor=images, tokenizer=tokenizer,
                           chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>"))
    token = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(**TEXT, vocab_size=len(tokenizer), **_ids(tokenizer),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=True)
    model = _seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype), processor


def gemma3(dtype=torch.float32):
    """A Gemma 3 model and processor: 64x64 images, 4 tokens each, attended both ways within an image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = copy.deepcopy(_bundled_tokenizer())
    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())})
    for name, token in names.items():  # what Gemma3Processor reads off its tokenizer
        setattr(tokenizer, name, token)
        setattr(tokenizer, name + "_id", tokenizer.convert_tokens_to_ids(token))
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 64, "width": 64}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=_template("<start_of_image>"))
    config = Gemma3Config(
        text_config=dict(**TEXT, vocab_size=len(tokenizer), **_ids(tokenizer), head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=16),
        mm_tokens_per_image=4, boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id, tie_word_embeddings=True)
    def build():
        model = Gemma3ForConditionalGeneration(config)
        # Gemma 3 starts its image projection at zero (a fresh model would see no image at all).
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
        return model

    model = _seeded(build)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype), processor


def idefics3(dtype=torch.float32):
    """The built-in tiny-random-vlm (Idefics3)."""
    return load_model(TINY_VLM, {torch.float32: "float32", torch.float64: "float64"}[dtype]), load_processor(TINY_VLM)


BUILDS = {"qwen2.5-vl": qwen25_vl, "idefics3": idefics3, "gemma3": gemma3}


def image(colour, size=(64, 64)) -> Image.Image:
    """A square of `colour` on a background of noise seeded by it (a plain image could reach a
    random model's features as nothing but a constant)."""
    generator = torch.Generator().manual_seed(hash(colour) % 2**31)
    noise = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    picture = Image.fromarray(noise.numpy())
    picture.paste(Image.new("RGB", (size[0] // 2, size[1] // 2), colour), (size[0] // 4, size[1] // 4))
    return picture


def messages(images: int, text: str) -> list[dict]:
    """One user message: `images` image parts, then the text."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}]
