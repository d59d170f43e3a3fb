"""A learned reward: a local `AutoModelForSequenceClassification` folder scores prompt + completion.

The conversation (prompt messages, then the completion as the assistant's message) is rendered with
the reward model's own chat template when it has one, else prompt and completion are concatenated.
The score is the model's first logit. The model is loaded once per folder and kept.
"""

from __future__ import annotations

import functools

import torch

from grpokit.rewards.reward_set import completion_text


@functools.lru_cache(maxsize=2)
def _load(path: str):
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"reward_model: path={path!r} is not a folder with a sequence-classification model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _conversation(prompt, completion) -> list[dict]:
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return messages + [{"role": "assistant", "content": completion_text(completion)}]


@torch.no_grad()
def reward_model(prompts, completions, path: str | None = None, batch_size: int = 16, **columns) -> list[float]:
    """The reward model's score (first logit) of each prompt + completion."""
    if path is None:
        raise ValueError("reward_model needs the model folder: {name: reward_model, path: /path/to/folder}")
    model, tokenizer = _load(str(path))
    if tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template(_conversation(p, c), tokenize=False) for p, c in zip(prompts, completions)]
    else:
        texts = [completion_text(p) + completion_text(c) for p, c in zip(prompts, completions)]
    scores = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        scores += model(**batch).logits[:, 0].float().tolist()
    return scores
