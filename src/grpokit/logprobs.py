"""Per-token log-probabilities of completions under a causal LM, with the prompt run once per group.

The G completions of a prompt share its tokens (with the default task, ~90% of every sequence).
So the prompt goes through the model once, its key/value cache is indexed out to every completion
that continues it, and the completions run on top of it. Autograd sums the completions' gradients
into the shared prompt activations: the same math as running every sequence whole, a fraction of
the FLOPs. Only positions that predict completion tokens reach the output layer.

Two variants, the same values and gradients (tests/test_logprobs.py checks both in float64):

- `chunk_size` (train.logprob_chunk_size): the output layer and the log-softmax run over at most
  that many positions at a time, each chunk under activation checkpointing (its logits are
  recomputed in the backward pass), so the memory of this step grows with the chunk, not with
  completion tokens x vocabulary.
- `share_prompt=False`: each completion runs whole, prompt included. Activation checkpointing
  (model.gradient_checkpointing) drops the key/value cache in training mode, so the trainer uses
  this path for the policy's forward when it is on.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache



def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token of every row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`: logits (..., V), targets (...) -> (...)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # log-softmax over a 49k vocabulary needs more than 8 mantissa bits
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                     chunk_size: int) -> torch.Tensor:
    """token_logprobs(head(hidden), targets) over at most `chunk_size` positions at a time, each
    recomputed in the backward pass: hidden (B, T, H), targets (B, T) -> (B, T)."""
    B, T, H = hidden.shape
    flat, flat_targets = hidden.reshape(B * T, H), targets.reshape(B * T)

    def chunk(h, t):
        return token_logprobs(head(h), t, temperature)

    # split(), not slicing: one backward for all the pieces (each slice's would be a full-size zero gradient).
    parts = [checkpoint(chunk, h, t, use_reentrant=False)
             for h, t in zip(flat.split(chunk_size), flat_targets.split(chunk_size))]
    return torch.cat(parts).view(B, T)


@torch.no_grad()
def check_chunkable(model) -> None:
    """The chunked path applies the output layer to the decoder's last hidden state itself; some
    models' heads do more (Gemma's soft-capping, Cohere's logit scaling, ...). Checked on the
    model's own output: the output layer alone must reproduce its logits."""
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([[1, 2, 3, 4]], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits
        alone = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state)
    finally:
        model.train(was_training)
    if not torch.allclose(alone.float(), logits.float(), rtol=1e-4, atol=1e-4):
        raise ValueError("train.logprob_chunk_size applies the output layer alone, but this model's head does more "
                         "(its logits differ from the output layer's): leave train.logprob_chunk_size null for it")


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    prompt_index: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    share_prompt: bool = True,
    sharded: bool = False,
) -> torch.Tensor:
    """log pi(completion token t | prompt, tokens < t), shape (B, T).

    prompt_ids, prompt_mask: (P, Lp) left-padded, each prompt once.
    completion_ids: (B, T) right-padded; padding positions get values that the caller masks.
    prompt_index: (B,) the prompt row each completion continues; None means row i of both (P == B).
    Logits are divided by `temperature` so that log-probs are those of the sampling distribution
    (as TRL does). `chunk_size`, `share_prompt`: see the module docstring. `sharded`: the model's
    weights are sharded (sharding.py), and only a call of the whole model gathers all of them.
    """
    if chunk_size is None:  # logits from the model's own head
        def run(keep: int, **inputs) -> torch.Tensor:
            return model(**inputs, logits_to_keep=keep).logits
    else:  # hidden states, for the output layer to be applied chunk by chunk
        decoder = model.get_decoder()

        def run(keep: int, **inputs) -> torch.Tensor:
            if sharded:  # the whole model, for one position's logits; its last hidden state is the decoder's
                return model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1][:, -keep:]
            return decoder(**inputs).last_hidden_state[:, -keep:]  # -0: every position
    passes = _shared_prompt_pass if share_prompt else _whole_sequence_pass
    out = passes(run, prompt_ids, prompt_mask, completion_ids, prompt_index)  # (B, T, V) or (B, T, H)
    if chunk_size is None:
        return token_logprobs(out, completion_ids, temperature)  # (B, T)
    return chunked_logprobs(out, model.get_output_embeddings(), completion_ids, temperature, chunk_size)


def _whole_sequence_pass(run, prompt_ids, prompt_mask, completion_ids, prompt_index) -> torch.Tensor:
    """`run`'s outputs (B, T, ...) at the positions that predict each completion token, every
    completion run whole: its prompt and its tokens but the last, no cache.
    run(keep, **inputs): the model's outputs at the last `keep` positions (0: all)."""
    if prompt_index is not None:
        prompt_ids, prompt_mask = prompt_ids.index_select(0, prompt_index), prompt_mask.index_select(0, prompt_index)
    B, T = completion_ids.shape
    ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)  # (B, Lp + T - 1)
    attention = torch.cat([prompt_mask, prompt_mask.new_ones(B, T - 1)], dim=1)
    # The last T positions, Lp - 1 .. Lp + T - 2, predict the T completion tokens.
    return run(T, input_ids=ids, attention_mask=attention, position_ids=position_ids(attention), use_cache=False)


def _shared_prompt_pass(run, prompt_ids, prompt_mask, completion_ids, prompt_index) -> torch.Tensor:
    """As _whole_sequence_pass, with each prompt run once and its key/value cache shared by the
    completions that continue it (the module docstring)."""
    B, T = completion_ids.shape
    cache = DynamicCache()
    # (P, 1, ...): the prompt's last position predicts completion token 0.
    first = run(1, input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                past_key_values=cache, use_cache=True)
    if prompt_index is not None:
        # (P, ...) -> (B, ...), differentiable. index_select, not Tensor[index] (what the cache's
        # own batch_select_indices does): the backward of indexing sums the rows that share a
        # prompt in an order that varies from run to run on several CPU threads; index_select's
        # sums in a fixed order, so a run is bit for bit repeatable (and resumable).
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, prompt_index), layer.values.index_select(0, prompt_index)
        first, prompt_mask = first.index_select(0, prompt_index), prompt_mask.index_select(0, prompt_index)
    if T == 1:
        return first  # (B, 1, ...)
    # Completion token t-1 at position len(prompt) + t - 1 predicts token t. Padding after an EOS
    # is attended only by later padding (causal), so a mask of ones changes no real token.
    attention = torch.cat([prompt_mask, prompt_mask.new_ones(B, T - 1)], dim=1)  # (B, Lp + T - 1)
    start = prompt_mask.sum(-1, keepdim=True)  # (B, 1)
    rest = run(0, input_ids=completion_ids[:, :-1], attention_mask=attention,
               position_ids=start + torch.arange(T - 1, device=start.device), past_key_values=cache, use_cache=True)
    return torch.cat([first, rest], dim=1)  # (B, T, ...)
