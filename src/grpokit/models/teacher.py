"""On-policy distillation's teacher (distill.teacher): a frozen model that scores the tokens the
policy sampled. The trainer runs it through the same log-prob passes as the reference model
(models/logprobs.py LogProbs.frozen); the loss turns its log-probs into a per-token advantage
(algorithm/loss.py).

The teacher must read token ids as the policy writes them: its tokenizer's vocabulary is the
policy's, checked at start-up, since a teacher of another vocabulary would score other tokens
than those sampled.
"""

from __future__ import annotations

import torch

from grpokit.models.loading import load_model, load_tokenizer
from grpokit.runtime import distributed
from grpokit.runtime.errors import StartupError


def load_teacher(name: str, policy_name: str, policy_tokenizer, dtype: str, device: torch.device):
    """The teacher `name` (a model name or folder) on `device`, frozen, in eval mode; refused
    (StartupError, both names) when its vocabulary is not the policy's `policy_name`'s."""
    check_vocabulary(name, load_tokenizer(name), policy_name, policy_tokenizer)
    teacher = load_model(name, dtype).to(device).eval().requires_grad_(False)
    distributed.broadcast_parameters(teacher)
    vocabulary = len(getattr(policy_tokenizer, "tokenizer", policy_tokenizer))
    if teacher.get_output_embeddings().weight.shape[0] < vocabulary:
        raise StartupError(f"distill.teacher={name}: its output layer scores {teacher.get_output_embeddings().weight.shape[0]} "
                           f"tokens, fewer than the {vocabulary} of the policy {policy_name}'s tokenizer")
    return teacher


def check_vocabulary(name: str, tokenizer, policy_name: str, policy_tokenizer) -> None:
    """The same token for every id in both tokenizers, or a StartupError naming both models."""
    theirs = getattr(tokenizer, "tokenizer", tokenizer).get_vocab()
    ours = getattr(policy_tokenizer, "tokenizer", policy_tokenizer).get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise StartupError(f"distill.teacher={name} has another vocabulary than the policy model.name={policy_name} "
                           f"({len(theirs)} tokens against {len(ours)}; e.g. {differ}): a teacher scores the policy's "
                           "token ids, so it must share its tokenizer")
