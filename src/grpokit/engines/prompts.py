"""Prompts as the engines see them: token ids through the chat template (with the tools' schemas),
or for a vision-language model through its processor, each image's tokens in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpokit.runtime.errors import ConfigError


def encode_prompt(tokenizer, prompt: list[dict] | str, max_length: int | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids: chat messages through the chat template (with the `tools` schemas), plain
    text as it is; longer than `max_length` keeps the end (where the question and the generation
    prompt are)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_length:] if max_length is not None and len(ids) > max_length else ids


@dataclass(frozen=True)
class PromptEncoder:
    """How a run's prompts become the token ids the engines see: chat messages through the chat
    template, with the tools' JSON schemas when the run has tools; for a vision-language model
    (`vision`: a models.vision.Vision) through its processor, each image's tokens in place. Longer
    than `max_length` (data.max_prompt_length) keeps the end (data.long_prompts=truncate; with
    "drop" no longer one is left); a prompt whose images' tokens would be cut is refused (the
    dataset refuses such rows first, naming them)."""

    tokenizer: Any
    schemas: list[dict] | None = None  # the tools' (rollouts/tools.py), with tools
    max_length: int | None = None
    vision: Any = None

    def __call__(self, example) -> list[int]:
        """The token ids of `example`'s prompt (a tasks.Example), cut to max_length."""
        return self.ids(example, self.max_length)

    def length(self, example) -> int:
        """How many tokens `example`'s prompt has, uncut (what data.max_prompt_length is compared with)."""
        return len(self.ids(example, None))

    def image_tokens(self, example) -> int:
        """How many of `example`'s prompt tokens are its images'."""
        return 0 if self.vision is None else self.vision.image_tokens(self.ids(example, None))

    def messages(self, prompt: list[dict] | str) -> list[int]:
        """The token ids of a prompt given as messages (or plain text): a conversation's, with the
        text an environment's reset() appended."""
        return encode_prompt(self.tokenizer, prompt, self.max_length, self.schemas)

    def ids(self, example, max_length: int | None) -> list[int]:
        where = f"{example.where}: " if getattr(example, "where", None) else ""  # a dataset row's file and line
        if self.vision is None:
            parts = not isinstance(example.prompt, str) and any(isinstance(m["content"], list) for m in example.prompt)
            if example.images or parts:  # only the row tells (a dataset's rows are all read at start-up)
                what = f"{len(example.images)} image(s) (data column image / images)" if example.images else \
                    "messages whose content is a list of parts"
                raise ConfigError(f"{where}a prompt has {what}, and the model is a text model: train a vision-language model "
                                  "on it (docs/vision.md), or give text content and no images "
                                  f"(the prompt: {str(example.prompt)[:120]!r})")
            return encode_prompt(self.tokenizer, example.prompt, max_length, self.schemas)
        try:
            ids = self.vision.encode(example.prompt, example.images, self.schemas)
        except ValueError as e:  # e.g. the processor's image token written in the text: a place for a missing image
            raise ConfigError(f"{where}the model's processor cannot encode the prompt: {e} (the prompt: "
                              f"{str(example.prompt)[:120]!r}). An image token written in a prompt's text is a place "
                              "for an image: remove it from the text, or give the row its image (data column image / "
                              "images)") from None
        if max_length is not None and len(ids) > max_length:
            if self.vision.image_tokens(ids[:-max_length]):
                raise ValueError(f"a prompt of {len(ids)} tokens with {len(example.images)} image(s) is over "
                                 f"data.max_prompt_length={max_length}, and an image's tokens are never cut")
            ids = ids[-max_length:]
        return ids


def check_images(images: list[tuple] | None, vision) -> None:
    """An engine of a vision-language model (its `vision`) is given each prompt's images, one of a
    text model none."""
    if (images is None) != (vision is None):
        raise ValueError("a vision-language model's engine takes each prompt's images (an empty tuple for none)"
                         if vision is not None else "a text model's engine takes no images")


def images_of(examples, vision) -> dict:
    """The `images` argument of an engine's generate for `examples` (tasks.Example): none for a
    text model, each prompt's images (a tuple, maybe empty) for a vision-language model."""
    return {} if vision is None else {"images": [e.images for e in examples]}

