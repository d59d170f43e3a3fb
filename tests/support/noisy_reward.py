"""A reward that draws from Python's, NumPy's and torch's global random number generators, as
users' reward functions may: a resumed run repeats the uninterrupted one only if every RNG state
of every process was saved and restored."""

import random

import numpy as np
import torch


def noisy_length(completions, **columns):
    noise = [random.random() + np.random.rand() + torch.rand(()).item() for _ in completions]
    return [-float(len(c[0]["content"])) + 0.1 * n for c, n in zip(completions, noise)]


def noisy_parity(completions, answer, **columns):
    """noisy_length, except on prompts with an even answer, where every completion gets 0: about half
    the groups teach nothing, for dynamic sampling to drop (the RNGs are drawn from all the same)."""
    values = noisy_length(completions)
    return [0.0 if int(a) % 2 == 0 else v for a, v in zip(answer, values)]
