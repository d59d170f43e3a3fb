"""Helpers for exactness tests: float64 all the way through, so that any difference between two
ways of computing the same update is a bug and not float rounding."""

import torch
from transformers.models.llama import modeling_llama


def rmsnorm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_everywhere() -> None:
    """transformers' LlamaRMSNorm rounds to float32 even in a float64 model; make it keep float64.

    With float32 rounding inside the norm, two batch layouts that differ by 1e-16 can round apart by
    1e-7, and AdamW's first step (about lr * sign(grad)) can turn that into a full lr on an
    element whose gradient is near 0. With this patch the whole model is float64.
    """
    modeling_llama.LlamaRMSNorm.forward = rmsnorm_in_input_dtype


def update_difference(start: dict, a: dict, b: dict) -> float:
    """max |delta_a - delta_b| / ||delta_a||, deltas being the parameter changes from `start`."""
    norm = torch.sqrt(sum(((a[k] - start[k]).double() ** 2).sum() for k in start))
    worst = max((a[k].double() - b[k].double()).abs().max() for k in start)
    return (worst / norm).item()


def step_on(trainer, examples, batch) -> dict:
    """One training step of `trainer` on a fixed rollout `batch` (this process's completions of
    `examples`): its sampling phase handed `batch`, every other phase as in training. Its metrics row."""
    trainer.sample = lambda _: batch
    return trainer.train_step(trainer.progress.step + 1, examples)
