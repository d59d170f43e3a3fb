"""Helpers for exactness tests: float64 all the way through, so that any difference between two
ways of computing the same update is a bug and not float rounding."""

import torch
from transformers.models.llama import modeling_llama


def rmsnorm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotary_in_input_dtype(q, k, cos, sin):
    """Qwen2.5-VL's vision rotary embedding, without its rounding to float32."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import rotate_half

    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def float64_everywhere() -> None:
    """transformers' LlamaRMSNorm rounds to float32 even in a float64 model; make it keep float64
    (and Qwen2.5-VL's norm and vision rotary embedding, which do the same).

    With float32 rounding inside the norm, two batch layouts that differ by 1e-16 can round apart by
    1e-7, and AdamW's first step (about lr * sign(grad)) can turn that into a full lr on an
    element whose gradient is near 0. With this patch the whole model is float64.
    """
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    modeling_llama.LlamaRMSNorm.forward = rmsnorm_in_input_dtype
    modeling_qwen2_5_vl.Qwen2_5_VLRMSNorm.forward = rmsnorm_in_input_dtype
    modeling_qwen2_5_vl.apply_rotary_pos_emb_vision = rotary_in_input_dtype


def update_difference(start: dict, a: dict, b: dict) -> float:
    """max |delta_a - delta_b| / ||delta_a||, deltas being the parameter changes from `start`."""
    norm = torch.sqrt(sum(((a[k] - start[k]).double() ** 2).sum() for k in start))
    worst = max((a[k].double() - b[k].double()).abs().max() for k in start)
    return (worst / norm).item()


def step_on(trainer, examples, batch) -> dict:
    """One training step of `trainer` on a fixed rollout `batch` (this process's completions of
    `examples`): its sampling phase handed `batch`, every other phase as in training. Its metrics row."""
    trainer.sampler.next_prompts = lambda: examples
    trainer.sampler.sample = lambda _: batch
    return trainer.train_step(trainer.progress.step + 1)


def with_tool_turns(batch, tool_ids: list[int]):
    """`batch` made multi-turn by hand: each completion's tokens split in two model turns with
    `tool_ids` (a tool result, in context, never trained) between them. The model tokens keep their
    sampled values; a completion of one token gets the tool result after it."""
    import torch

    from grpokit.engines.batch import RolloutBatch
    from grpokit.rollouts.conversation import Conversation

    N = len(batch.finish_reasons)
    lengths = batch.completion_mask.sum(-1).tolist()
    T = max(lengths) + len(tool_ids)
    ids = torch.full((N, T), int(batch.completion_ids[0, -1]), dtype=torch.long)
    context, trained = torch.zeros((N, T), dtype=torch.long), torch.zeros((N, T), dtype=torch.long)
    logps, entropies = torch.zeros((N, T), dtype=batch.sampling_logps.dtype), torch.zeros((N, T))
    conversations = []
    for i, n in enumerate(lengths):
        k = max(1, n // 2)  # the first turn's tokens
        model = batch.completion_ids[i, :n]
        ids[i, : n + len(tool_ids)] = torch.cat([model[:k], torch.tensor(tool_ids), model[k:]])
        context[i, : n + len(tool_ids)] = 1
        trained[i, :k], trained[i, k + len(tool_ids): n + len(tool_ids)] = 1, 1
        for out, src in ((logps, batch.sampling_logps), (entropies, batch.entropies)):
            out[i, :k], out[i, k + len(tool_ids): n + len(tool_ids)] = src[i, :k], src[i, k:n]
        text = " ".join(map(str, model.tolist()))  # what a reward reads: it differs between completions
        conversations.append(Conversation([{"role": "assistant", "content": text}], turns=2, calls=1))
    return RolloutBatch(batch.prompt_index, batch.prompt_ids, batch.prompt_mask, ids, context, logps, entropies,
                        list(batch.finish_reasons), trained, conversations)


def off_the_sampler(trainer, batch):
    """`batch` as if sampled by other kernels than the trainer's (as vLLM's): a copy with its
    sampling log-probs moved by a fixed pseudo-random amount per token; and the trainer's rollout
    importance weight turned on."""
    import copy

    g = torch.Generator().manual_seed(5)
    moved = copy.copy(batch)
    moved.sampling_logps = batch.sampling_logps + 0.3 * torch.randn(batch.sampling_logps.shape, generator=g,
                                                                    dtype=batch.sampling_logps.dtype)
    trainer.sampler.is_correction = True
    return moved


def cut_ragged(batch, eos: int):
    """`batch` with its completions cut to ragged lengths, ending in EOS (a random model never
    samples it), for the normalizers to matter; some stay whole, with finish reason "length"."""
    T = batch.completion_ids.shape[1]
    for i in range(len(batch.finish_reasons)):
        n = 1 + (3 * i) % (T + 2)
        if n < T:
            batch.completion_ids[i, n - 1 :] = eos  # EOS, then padding (SmolLM2 pads with EOS)
            batch.completion_mask[i, n:] = 0
            batch.finish_reasons[i] = "stop"
    return batch
