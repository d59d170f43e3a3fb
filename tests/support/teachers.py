"""Teachers for on-policy distillation's tests (distill.teacher): tiny-random with its weights moved."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from grpokit.models.loading import load_model, load_tokenizer, save_model


def another_teacher(folder: Path, seed: int = 0, scale: float = 0.5, extra_token: str | None = None) -> str:
    """tiny-random, every weight plus seeded noise (`scale` times its own spread), saved as a model
    folder (with `extra_token` added to its tokenizer: another vocabulary). Its path."""
    model, tokenizer = load_model("tiny-random"), copy.deepcopy(load_tokenizer("tiny-random"))  # (a shared one)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))
    if extra_token is not None:
        tokenizer.add_tokens([extra_token])
    save_model(model, tokenizer, folder)
    return str(folder)
