"""Vision-language models: prompts with images, and what the model needs of them in every pass.

A prompt of a vision-language model is its token ids, in which the processor has expanded each
image's placeholder into the image's tokens, and the images themselves. The images travel with the
prompt (Example.images, RolloutBatch.images) to every pass that runs the prompt through the model:
generation's prefill, the reference, old and policy log-probs, evaluation. Each pass asks `Vision`
for the model inputs of the rows it runs (`Vision.inputs`): the pixel inputs of those rows' images,
batched as the model takes them (the processor's image processor does it), the inputs aligned with
the ids (Gemma 3's token_type_ids, Qwen's mm_token_type_ids: 1 on image tokens, read from the ids
themselves, so they are padded and extended exactly as the ids are), and position ids (Qwen's 3-D
rotary positions, mRoPE, from the model's own get_rope_index). A pass over G completions of a
prompt either runs the prompt once (its images once) and shares its key/value cache, or runs each
completion whole with its prompt's images repeated: both give each sequence's log-probs alone.

A prompt's image tokens are never cut (a prompt too long is refused or left out: tasks/dataset.py)
and, as every prompt token, never trained. The image placeholder token is a stop token of
generation: a completion that samples it ends there (finish reason "image_token") and the token is
never fed back to the model, since no image stands behind it. Like any sampled token it is trained
by its completion's advantage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grpokit.models.logprobs import position_ids

# The finish reason of a completion that sampled an image placeholder token (it ends there).
IMAGE_TOKEN = "image_token"
# The ids-aligned inputs a processor may return, besides input_ids and attention_mask: 1 on image tokens.
_TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")


@dataclass
class ModelInputs:
    """What a forward over some rows of prompts (or whole sequences) takes besides ids and mask."""

    extra: dict  # pixel inputs of the rows' images and the ids-aligned inputs
    position_ids: torch.Tensor  # (B, L), or (3, B, L) for mRoPE
    next_position: torch.Tensor  # (B,) the position of the token after each row's last


def is_processor(obj) -> bool:
    """A multimodal processor (it holds an image processor), not a tokenizer."""
    return getattr(obj, "image_processor", None) is not None and getattr(obj, "tokenizer", None) is not None


def _image_token_id(processor, probe: dict) -> int:
    """The id of the token that stands for a piece of an image's features, read off the processor's
    output for a prompt with an image: where it marks image tokens (token types), the token it
    marks (a processor's named image token may be the one that opens an image, as Gemma 3's);
    else the processor's image token."""
    for key in _TOKEN_TYPES:
        if key in probe:
            marked = probe["input_ids"][probe[key] == 1].unique()
            if len(marked) != 1:
                raise ValueError(f"{type(processor).__name__}'s {key} marks {len(marked)} kinds of tokens as an "
                                 "image's, not one: not supported")
            return int(marked[0])
    value = getattr(processor, "image_token_id", None)
    if isinstance(value, int):
        return value
    token = getattr(processor, "image_token", None)
    if token is None:
        raise ValueError(f"{type(processor).__name__} names no image token (image_token_id, image_token)")
    return processor.tokenizer.convert_tokens_to_ids(token)


class Vision:
    """A vision-language model's processor, and the inputs its passes need (module docstring)."""

    def __init__(self, processor):
        """processor: the model's (AutoProcessor)."""
        from PIL import Image

        self.processor, self.tokenizer = processor, processor.tokenizer
        # Which inputs this processor gives, read off one prompt with one image.
        probe = self.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                            (Image.new("RGB", (32, 32), (255, 0, 0)),), returned=True)
        ids = probe["input_ids"]
        self.image_token_id = _image_token_id(processor, probe)
        self.token_types = [k for k in probe if k in _TOKEN_TYPES]
        for key in self.token_types:
            if not torch.equal(probe[key].long(), (ids == self.image_token_id).long()):
                raise ValueError(f"{type(processor).__name__}'s {key} is not 1 on the image tokens alone: not supported")
        self.pixel_keys = [k for k in probe if k not in ("input_ids", "attention_mask", *self.token_types)]
        if not (ids == self.image_token_id).any():
            raise ValueError(f"{type(processor).__name__} put no image token (id {self.image_token_id}) in a prompt "
                             "with an image")
        self.placeholder = self._placeholder()

    def _placeholder(self) -> str:
        """The text the chat template writes for an image part (what the processor expands): what
        an image part adds to a message."""
        text = {"type": "text", "text": "?"}
        with_image = self.render([{"role": "user", "content": [{"type": "image"}, text]}])
        without = self.render([{"role": "user", "content": [text]}])
        start = len(os.path.commonprefix([with_image, without]))
        end = len(os.path.commonprefix([with_image[start:][::-1], without[start:][::-1]]))
        placeholder = with_image[start:len(with_image) - end]
        if not placeholder:
            raise ValueError(f"{type(self.processor).__name__}'s chat template writes nothing for an image part")
        return placeholder

    # ------------------------------------------------------------------ prompts

    def render(self, prompt: list[dict] | str, tools: list[dict] | None = None) -> str:
        """A prompt's text: chat messages (their content a string or parts, {"type": "image"} among
        them) through the processor's chat template; plain text as it is."""
        if isinstance(prompt, str):
            return prompt
        return self.processor.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)

    def encode(self, prompt, images: tuple, tools: list[dict] | None = None, returned: bool = False):
        """The prompt's token ids, each image's placeholder expanded into the image's tokens (what the
        processor gives); `returned`: the processor's whole output (tensors of one row)."""
        out = self.processor(text=[self.render(prompt, tools)], images=[list(images)] if images else None,
                             add_special_tokens=False, return_tensors="pt")
        return dict(out) if returned else out["input_ids"][0].tolist()

    def image_tokens(self, ids: list[int]) -> int:
        return sum(1 for i in ids if i == self.image_token_id)

    def placeholder_ids(self, ids: list[int], images: tuple) -> list[int]:
        """An encoded prompt `ids` with each image's tokens folded back into the placeholder the chat
        template writes for an image: the prompt as the tokenizer alone encodes it, which is what
        vLLM takes beside the images (its own processor expands them again). Folded in text, since
        the tokens around an expansion may merge with it (Gemma 3's newlines)."""
        if not images:
            return list(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces, at = [], 0
        for k, image in enumerate(images):
            expanded = self.processor(text=[self.placeholder], images=[[image]], add_special_tokens=False)["input_ids"][0]
            expanded = self.tokenizer.decode(expanded, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            found = text.find(expanded, at)
            if found < 0:
                raise ValueError(f"image {k} of a prompt: its tokens are not in the prompt (was it encoded with "
                                 "these images?)")
            pieces += [text[at:found], self.placeholder]
            at = found + len(expanded)
        return self.tokenizer("".join([*pieces, text[at:]]), add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ passes

    def inputs(self, model, ids: torch.Tensor, mask: torch.Tensor, images: list[tuple]) -> ModelInputs:
        """The inputs of a forward of `model` over rows `ids`, `mask` (B, L), left-padded, whose
        images are images[b] (a tuple each, maybe empty): pixel inputs in row order, ids-aligned
        inputs, and position ids."""
        extra = {key: (ids == self.image_token_id).long() for key in self.token_types}  # (B, L) each
        if any(images):  # the rows with images, in order: each model places the features by its image tokens
            pixels = self.processor.image_processor(images=[list(row) for row in images if row], return_tensors="pt")
            extra.update({k: pixels[k].to(ids.device, model.dtype if pixels[k].is_floating_point() else None)
                          for k in self.pixel_keys if k in pixels})
        rope = _rope_index(model)
        if rope is None:
            return ModelInputs(extra, position_ids(mask), mask.sum(-1))
        types = (ids == self.image_token_id).int()  # (B, L): 1 on image tokens, 0 on text
        positions, deltas = rope(ids, types, image_grid_thw=extra.get("image_grid_thw"), attention_mask=mask)  # (3, B, L), (B, 1)
        return ModelInputs(extra, positions, mask.sum(-1) + deltas.view(-1).to(mask.device))

    @staticmethod
    def continued(model, start: torch.Tensor, length: int) -> torch.Tensor:
        """Position ids (B, length), or (3, B, length) under mRoPE, of `length` tokens after
        positions start (B,): text after the prompt advances every rotary axis together."""
        positions = start[:, None] + torch.arange(length, device=start.device)  # (B, length)
        return positions if _rope_index(model) is None else positions.unsqueeze(0).expand(3, -1, -1)

    def as_text(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` with every image token replaced by the pad id: what a sampled image token (the last
        token of its completion) is as an input, since it has no image behind it. The positions it
        feeds predict nothing trained."""
        return ids.masked_fill(ids == self.image_token_id, self.tokenizer.pad_token_id)


def _rope_index(model):
    """The model's get_rope_index (3-D rotary positions: Qwen2-VL, Qwen2.5-VL, ...), or None."""
    for module in model.modules():
        rope = getattr(module, "get_rope_index", None)
        if callable(rope):
            return rope
    return None


def processing(name: str, given=None) -> tuple:
    """The tokenizer of model.name `name` (or of `given`: a tokenizer, or a vision-language model's
    processor, TRL's processing_class), and for a vision-language model its Vision (else None)."""
    from grpokit.models.loading import is_vision_model, load_processor, load_tokenizer
    from grpokit.models.pad_token import with_pad_token

    if given is not None:
        return (with_pad_token(given.tokenizer), Vision(given)) if is_processor(given) else (with_pad_token(given), None)
    if is_vision_model(name):
        processor = load_processor(name)
        return processor.tokenizer, Vision(processor)
    return load_tokenizer(name), None


def check_vision(model, vision: Vision | None) -> None:
    """A vision-language model comes with its processor, a text model with a tokenizer, and the
    model's image token is the processor's."""
    from grpokit.runtime.errors import ConfigError

    config = model.config
    if (getattr(config, "vision_config", None) is not None) != (vision is not None):
        raise ConfigError("the model is a vision-language model but came with a tokenizer, not its processor "
                          "(give AutoProcessor's as the tokenizer / processing_class)" if vision is None else
                          "a processor with an image processor came with a text model: give its tokenizer")
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            if value != vision.image_token_id:
                raise ConfigError(f"the model's image token ({name}={value}) is not its processor's "
                                  f"({vision.image_token_id}): they do not belong together")
            return
