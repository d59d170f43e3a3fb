"""Per-token log-probabilities of completions under a causal LM, with the prompt run once per group.

The G completions of a prompt share its tokens (with the default task, ~90% of every sequence).
So the prompt goes through the model once, its key/value cache is indexed out to every completion
that continues it, and the completions run on top of it. Autograd sums the completions' gradients
into the shared prompt activations: the same math as running every sequence whole, a fraction of
the FLOPs. Only positions that predict completion tokens reach the output layer.

Two variants, the same values and gradients (tests/models/test_logprobs.py checks both in float64):

- `chunk_size` (train.logprob_chunk_size): the output layer and the log-softmax run over at most
  that many positions at a time, each chunk under activation checkpointing (its logits are
  recomputed in the backward pass), so the memory of this step grows with the chunk, not with
  completion tokens x vocabulary.
- `share_prompt=False`: each completion runs whole, prompt included. Activation checkpointing
  (model.gradient_checkpointing) drops the key/value cache in training mode, so the policy's
  forward takes this path when it is on; so does the policy's forward of a model with layers
  that carry a state (linear attention, convolution: transformers' cache updates it in place,
  which autograd cannot see through).

A row can hold several sequences (an agent's requests that did not extend the one before:
RolloutBatch.sequence_ids): each attends only to its own tokens, at positions from 0, through a
4D attention mask, or, for a model whose layers carry a state, as rows of its own (models/
sequences.py), so a token's log-prob is the one it was sampled with.

`LogProbs` runs a step's passes (reference, old, policy) through one method, `LogProbs.of`: the
one place where a batch's model inputs meet the model.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from grpokit.algorithm.load_balancing import sequence_balance
from grpokit.models.architecture import cache_inputs, layers_of, masks, new_cache, select_rows
from grpokit.models.packing import AUTO, AUTO_TOKENS, AUTO_WASTE, Packed, pack, padded_waste, plan, split_to
from grpokit.models.routers import RouterLogits
from grpokit.models.sequences import Split, position_ids, sequence_layout
from grpokit.runtime import distributed


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[target] with a backward pass that writes one tensor of logits' size:
    onehot(target) - softmax(logits), scaled by the incoming gradient. Autograd's own backward of
    logsumexp and gather makes five such tensors, and with a 49k vocabulary writing them is most
    of the cost. The same arithmetic, value for value (tests/models/test_logprobs.py)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logz = torch.logsumexp(logits, dim=-1)  # (...)
        ctx.save_for_backward(logits, targets, logz)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz

    @staticmethod
    @torch.autograd.function.once_differentiable  # its backward is not differentiable again
    def backward(ctx, grad: torch.Tensor):
        logits, targets, logz = ctx.saved_tensors
        g = grad.unsqueeze(-1)  # (..., 1)
        out = torch.sub(logits, logz.unsqueeze(-1)).exp_().mul_(-g)  # (..., V): -grad * softmax
        return out.scatter_add_(-1, targets.unsqueeze(-1), g), None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`: logits (..., V), targets (...) -> (...)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # log-softmax over a 49k vocabulary needs more than 8 mantissa bits
    if temperature != 1.0:
        logits = logits / temperature
    return _TokenLogprobs.apply(logits, targets)


def token_entropies(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The entropy of softmax(logits / temperature) at each position, with its gradient (the
    algorithm.entropy_coef bonus): logits (..., V) -> (...)."""
    logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    logprobs = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)  # (..., V)
    # A token of probability 0 (a logit of -inf) adds 0, not 0 * -inf.
    return -(logprobs.exp() * logprobs.clamp(min=torch.finfo(logprobs.dtype).min)).sum(-1)


def per_token(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropies: bool):
    """token_logprobs, and with `entropies` the token_entropies beside them (a pair)."""
    logps = token_logprobs(logits, targets, temperature)
    return (logps, token_entropies(logits, temperature)) if entropies else logps


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float,
                     chunk_size: int, entropies: bool = False):
    """per_token(head(hidden), targets) over at most `chunk_size` positions at a time, each
    recomputed in the backward pass: hidden (B, T, H), targets (B, T) -> (B, T) (a pair of them with
    `entropies`)."""
    B, T, H = hidden.shape
    flat, flat_targets = hidden.reshape(B * T, H), targets.reshape(B * T)

    def chunk(h, t):
        return per_token(head(h), t, temperature, entropies)

    # split(), not slicing: one backward for all the pieces (each slice's would be a full-size zero gradient).
    parts = [checkpoint(chunk, h, t, use_reentrant=False)
             for h, t in zip(flat.split(chunk_size), flat_targets.split(chunk_size))]
    if entropies:
        return tuple(torch.cat(values).view(B, T) for values in zip(*parts))
    return torch.cat(parts).view(B, T)


@torch.no_grad()
def _logits_two_ways(model, other) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own logits for a few tokens, and `other(ids)` for the same ids, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([[1, 2, 3, 4]], device=next(model.parameters()).device)
        return model(input_ids=ids).logits, other(ids)
    finally:
        model.train(was_training)


# train.logprob_chunk_size=null on a GPU: the training pass's logits chunked (docs/speed-and-memory.md:
# on an H100, 64 x 256 completion tokens, the step's peak went from 21.9 to 14.7 GB for 8% more time).
GPU_CHUNK = 1024


def chunk_size(setting: int | None, model, device: torch.device, vision=None) -> int | None:
    """The log-prob passes' chunk size for train.logprob_chunk_size = `setting` (None: all at once):
    0 is all at once; null is GPU_CHUNK on a GPU for a text model whose output layer allows it
    (check_chunkable), all at once otherwise."""
    if setting is not None:
        return setting or None
    if device.type != "cuda" or vision is not None:
        return None
    try:
        check_chunkable(model)
    except ValueError:
        return None
    return GPU_CHUNK


def check_chunkable(model) -> None:
    """The chunked path applies the output layer to the decoder's last hidden state itself; some
    models' heads do more (Gemma's soft-capping, Cohere's logit scaling, ...). Checked on the
    model's own output: the output layer alone must reproduce its logits."""
    logits, alone = _logits_two_ways(
        model, lambda ids: model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state))
    if not torch.allclose(alone.float(), logits.float(), rtol=1e-4, atol=1e-4):
        raise ValueError("train.logprob_chunk_size applies the output layer alone, but this model's head does more "
                         "(its logits differ from the output layer's): leave train.logprob_chunk_size null for it")


def check_inputs_embeds(model) -> bool:
    """Whether the model's logits from token embeddings (looked up by its input embedding module)
    equal those from the token ids: the shared pass gives the model embeddings it looked up itself,
    and some models use the ids for more than the lookup (Gemma 3n's per-layer inputs). Those get
    completion_logprobs(whole_model=True)."""
    from_ids, from_embeds = _logits_two_ways(
        model, lambda ids: model(inputs_embeds=model.get_input_embeddings()(ids)).logits)
    return torch.equal(from_ids, from_embeds)


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    prompt_index: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    share_prompt: bool = True,
    whole_model: bool = False,
    vision=None,
    images: list[tuple] | None = None,
    sequence_ids: torch.Tensor | None = None,
    entropies: bool = False,
    routers=None,
    sequence_prefix: torch.Tensor | None = None,
):
    """log pi(completion token t | prompt, tokens < t), shape (B, T); with `entropies`, the pair
    of those and the entropies (B, T) of the distributions they are drawn from (token_entropies).
    With `routers` (an open routers.RouterLogits), the pair of that and the router logits (layers,
    B, T, E) at the same positions.

    prompt_ids, prompt_mask: (P, Lp) left-padded, each prompt once.
    completion_ids: (B, T) right-padded; padding positions get values that the caller masks.
    prompt_index: (B,) the prompt row each completion continues; None means row i of both (P == B).
    Logits are divided by `temperature` so that log-probs are those of the sampling distribution
    (as TRL does). `chunk_size`, `share_prompt`: see the module docstring. `whole_model`: every
    pass calls the whole model with token ids: its weights are sharded (training/sharding.py) and only a
    call of the whole model gathers all of them, or the model uses token ids for more than the
    embedding lookup (check_inputs_embeds).
    vision, images: a vision-language model's vision.Vision, and each prompt row's images (a tuple
    each): the passes that run a prompt get its images' inputs and the model's position ids. Its
    prompts run through the whole model (which merges the image features into the embeddings).
    sequence_ids, sequence_prefix: (B, T) rows that hold several sequences (sequence_layout), or None.
    """
    if sequence_ids is not None and vision is not None:
        raise ValueError("rows of several sequences are text rows")
    if share_prompt and torch.is_grad_enabled() and layers_of(model).stateful:
        raise ValueError("a layer with a state (linear attention, a convolution) updates it in place in the cache, "
                         "which autograd cannot see through: pass share_prompt=False for a pass with gradients")
    targets = completion_ids
    if vision is not None:
        whole_model = True
        completion_ids = vision.as_text(completion_ids)  # inputs: a sampled image token ends its completion
    run = _runner(model, chunk_size, whole_model)
    seen = None if vision is None else _Seen(model, vision, images)
    layout = None if sequence_ids is None else functools.partial(_layout, model, sequence_ids=sequence_ids,
                                                                   prefix=sequence_prefix)
    if share_prompt:
        out, routed = _shared_prompt_pass(model, run, prompt_ids, prompt_mask, completion_ids, prompt_index,
                                          whole_model, seen, layout, routers)
    else:
        out, routed = _whole_sequence_pass(run, prompt_ids, prompt_mask, completion_ids, prompt_index, seen, layout,
                                           routers)  # (B, T, V) or (B, T, H)
    if chunk_size is None:
        values = per_token(out, targets, temperature, entropies)  # (B, T)
    else:
        values = chunked_logprobs(out, model.get_output_embeddings(), targets, temperature, chunk_size, entropies)
    return values if routers is None else (values, routed)


def _runner(model, chunk_size: int | None, whole_model: bool):
    """run(keep, **inputs): the model's outputs at the last `keep` positions (0: all) of a call on
    `inputs`: its logits from its own head, or with `chunk_size`, the hidden states the output layer
    is then applied to chunk by chunk."""
    if chunk_size is None:
        return lambda keep, **inputs: model(**inputs, logits_to_keep=keep).logits
    decoder = model.get_decoder()

    def run(keep: int, **inputs) -> torch.Tensor:
        if whole_model:  # for one position's logits; its last hidden state is the decoder's
            return model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1][:, -keep:]
        return decoder(**inputs).last_hidden_state[:, -keep:]  # -0: every position

    return run


class _Seen:
    """A vision-language model's pass inputs for prompt rows and their images (vision.Vision);
    a text model's passes have none (None in their place)."""

    def __init__(self, model, vision, images: list[tuple]):
        self.model, self.vision, self.images = model, vision, images

    def inputs(self, ids: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None):
        """vision.ModelInputs of rows `ids`, `mask`, whose images are those of prompt rows `index` (default: each its own)."""
        images = self.images if index is None else [self.images[i] for i in index.tolist()]
        return self.vision.inputs(self.model, ids, mask, images)

    def continued(self, start: torch.Tensor, length: int) -> torch.Tensor:
        return self.vision.continued(self.model, start, length)


def _layout(model, prompt_mask: torch.Tensor, sequence_ids: torch.Tensor, prefix: torch.Tensor | None = None,
            queries_from: int = 0):
    """The attention mask each of `model`'s layers takes (architecture.masks) for the rows of
    sequence_layout, for its queries from `queries_from` on (every key), and their positions."""
    allowed, positions = sequence_layout(prompt_mask, sequence_ids, prefix)  # (B, 1, L, L), (B, L)
    queries = positions[:, queries_from:]
    return masks(model, allowed[:, :, queries_from:], queries, positions), queries


def _whole_sequence_pass(run, prompt_ids, prompt_mask, completion_ids, prompt_index, seen=None,
                         layout=None, routers=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`run`'s outputs (B, T, ...) at the positions that predict each completion token, every
    completion run whole: its prompt (with its images, `seen`) and its tokens but the last, no cache;
    and with `routers`, the router logits (layers, B, T, E) there (else None).
    run(keep, **inputs): the model's outputs at the last `keep` positions (0: all). layout(prompt_mask):
    rows of several sequences' attention mask and positions (_layout), or None."""
    B, T = completion_ids.shape
    if prompt_index is None:
        prompt_index = torch.arange(B, device=completion_ids.device)
    prompt_ids, prompt_mask = prompt_ids.index_select(0, prompt_index), prompt_mask.index_select(0, prompt_index)
    ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)  # (B, Lp + T - 1)
    attention = torch.cat([prompt_mask, prompt_mask.new_ones(B, T - 1)], dim=1)
    if layout is not None:
        extra, (attention, positions) = {}, layout(prompt_mask)
    elif seen is None:
        extra, positions = {}, position_ids(attention)
    else:  # each completion's prompt images, repeated
        inputs = seen.inputs(ids, attention, prompt_index)
        extra, positions = inputs.extra, inputs.position_ids
    # The last T positions, Lp - 1 .. Lp + T - 2, predict the T completion tokens.
    out = run(T, input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False, **extra)
    return out, None if routers is None else routers.take(T)


def _shared_prompt_pass(model, run, prompt_ids, prompt_mask, completion_ids, prompt_index, whole_model,
                        seen=None, layout=None, routers=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As _whole_sequence_pass, with each prompt run once and its key/value cache shared by the
    completions that continue it (the module docstring).

    By default the prompt but its last token fills the cache and needs no output; the last token
    and the completion's tokens but the last then run on top, and their T outputs are all the
    outputs needed: the output layer runs once, over B x T positions, and all the tokens'
    embeddings are looked up in one call, so the embedding table gets one gradient, not two (each
    is a dense vocabulary x hidden tensor). With `whole_model`, both passes are calls of the whole
    model on token ids, and the whole prompt runs first with its last position's output (which
    predicts completion token 0) used: under FSDP2 a layer gathers its weights for the backward
    pass when the gradient reaches its output, so a gradient must reach every layer's output in
    both passes."""
    B, T = completion_ids.shape
    if prompt_index is None:
        prompt_index = torch.arange(B, device=completion_ids.device)
    last = 0 if whole_model else 1  # prompt tokens that run with the completions
    Lp = prompt_ids.shape[1]
    prefix_ids, prefix_mask = prompt_ids[:, :Lp - last], prompt_mask[:, :Lp - last]  # (P, Lp - last)
    # Left padding: every prompt's last token is in the last column.
    rest_ids = torch.cat([prompt_ids[:, Lp - last:].index_select(0, prompt_index), completion_ids[:, :-1]], dim=1)  # (B, T - 1 + last)
    cache = new_cache(model)
    cached = cache_inputs(model, cache)
    prefix_inputs = dict(attention_mask=prefix_mask, position_ids=position_ids(prefix_mask), **cached)
    if seen is not None:  # whole_model: the prompts with their images, once each
        inputs = seen.inputs(prefix_ids, prefix_mask)
        prefix_inputs.update(position_ids=inputs.position_ids, **inputs.extra)
    routed = []  # with routers: the router logits (layers, B, ., E) of the positions kept
    if whole_model:
        first = run(1, input_ids=prefix_ids, **prefix_inputs).index_select(0, prompt_index)  # (B, 1, ...)
        if routers is not None:
            routed.append(routers.take(1).index_select(1, prompt_index))
        rest = {"input_ids": rest_ids}
    else:
        embeds = model.get_input_embeddings()(torch.cat([prefix_ids.reshape(-1), rest_ids.reshape(-1)]))  # (P*(Lp-1) + B*T, H)
        prefix_embeds, rest_embeds = embeds.split([prefix_ids.numel(), rest_ids.numel()])
        if Lp > 1:
            model.get_decoder()(inputs_embeds=prefix_embeds.view(*prefix_ids.shape, -1), **prefix_inputs)
        rest = {"inputs_embeds": rest_embeds.view(B, T, -1)}
    select_rows(cache, prompt_index)  # (P, ...) -> (B, ...), differentiable, summed in a fixed order
    if rest_ids.shape[1] == 0:  # whole_model, one token per completion: the prompt's output is all
        return first, routed[0] if routed else None
    prompt_mask = prompt_mask.index_select(0, prompt_index)  # (B, Lp)
    # The prompt's last token, at position len(prompt) - 1, predicts completion token 0; completion
    # token t-1 at position len(prompt) + t - 1 predicts token t. Padding after an EOS is attended
    # only by later padding (causal), so a mask of ones changes no real token.
    attention = torch.cat([prompt_mask, prompt_mask.new_ones(B, T - 1)], dim=1)  # (B, Lp + T - 1)
    if layout is not None:  # rest's queries' rows of the mask (every key: the cached prefix's, then rest's)
        attention, positions = layout(prompt_mask, queries_from=Lp - last)  # (B, 1, L', L), (B, L')
    elif seen is None:
        start = prompt_mask.sum(-1, keepdim=True) - last  # (B, 1): the position of rest's first token
        positions = start + torch.arange(rest_ids.shape[1], device=start.device)  # (B, T - 1 + last)
    else:  # last == 0: rest starts after the prompt, where the model's positions say
        positions = seen.continued(inputs.next_position.index_select(0, prompt_index), rest_ids.shape[1])
    out = run(0, **rest, attention_mask=attention, position_ids=positions, **cached)  # (B, T - 1 + last, ...)
    if routers is not None:
        routed.append(routers.take(0))
    return torch.cat([first, out], dim=1) if whole_model else out, torch.cat(routed, 2) if routed else None  # (B, T, ...)


@dataclass
class TrainPass:
    """What the policy's training pass gives the loss (LogProbs.train), all with gradient."""

    logps: torch.Tensor  # (M, T)
    entropies: torch.Tensor | None = None  # (M, T) with algorithm.entropy_coef
    balance: torch.Tensor | None = None  # (M,) each sequence's load-balancing term, with router_aux_loss_coef
    expert_counts: torch.Tensor | None = None  # (E,) the experts' choices at the trained tokens (detached)


class LogProbs:
    """The reference, old and policy passes of a step: log-probs (n, T) of a batch's completions,
    each pass through `of`, the one place where a batch's model inputs meet the model, on the
    micro-batches of `micro_batches`."""

    def __init__(self, policy, reference, temperature: float, chunk_size: int | None, checkpointing: bool,
                 whole_model: bool, micro_batch: int, device: torch.device, vision=None,
                 micro_batch_tokens: int | str | None = None, lockstep: bool = False, routed: tuple[int, int] | None = None):
        """reference: the frozen reference model, or None (with LoRA, the policy without its
        adapters is the reference); checkpointing: the policy recomputes its activations in the
        backward pass; whole_model: see completion_logprobs; micro_batch: completions per micro-batch
        (train.micro_batch_size); micro_batch_tokens: packed micro-batches of at most that many
        tokens instead (train.micro_batch_tokens, models/packing.py), or packing.AUTO: packed in
        batches where padding would be most of the positions, padded in the others; vision: a vision-language
        model's vision.Vision (the batches carry their prompts' images); lockstep: every process
        makes every forward call (sharded weights), so packed micro-batches are as many on each;
        routed: (experts, experts each token is routed to) when the training pass computes the
        load-balancing loss (algorithm.router_aux_loss_coef > 0), else None."""
        self.policy, self.reference, self.vision = policy, reference, vision
        self.temperature, self.chunk_size, self.checkpointing = temperature, chunk_size, checkpointing
        self.whole_model, self.micro_batch, self.device = whole_model, micro_batch, device
        self.micro_batch_tokens, self.lockstep, self.routed = micro_batch_tokens, lockstep, routed
        self._picked = (None, None)  # with AUTO: the last batch and its budget, kept for all its passes
        # Each model's layers (architecture.Layers), by id: a model no 4D mask is exact for is never
        # packed (the policy's decides the micro-batches), and its agents' rows of several sequences
        # are split into rows of one; a teacher may be of another architecture than the policy.
        self._layers = {}
        self.mask_problem = self.layers(policy).mask_problem()
        if isinstance(micro_batch_tokens, int) and self.mask_problem:  # (config/checks.py says so at start-up)
            raise ValueError(f"train.micro_batch_tokens packs completions into rows under one attention mask, but "
                             f"{self.mask_problem}: use train.micro_batch_size")
        # Token positions the passes ran through the model, and those they needed (each
        # micro-batch's prompts once, each completion's tokens but its last): their ratio is the
        # passes' waste (padding). Counts since the start, read by training/metrics.py Waste.
        self.computed = self.needed = 0

    def micro_batches(self, batch, rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` (in order) split into micro-batches: of micro_batch completions, or packed up to
        micro_batch_tokens tokens."""
        if not len(rows):
            return []
        budget = self.budget(batch)
        if budget is None:
            return list(rows.split(self.micro_batch))
        lengths, prompt_lengths, groups = _sizes(batch, rows)
        parts = plan(lengths, prompt_lengths, groups, budget)
        if self.lockstep:  # every process holds as many rows, so the most micro-batches can be made everywhere
            parts = split_to(parts, int(distributed.all_reduce(torch.tensor(len(parts)), "max")))
        return [rows[part] for part in parts]

    def layers(self, model):
        """architecture.Layers of `model`, read once."""
        if id(model) not in self._layers:
            self._layers[id(model)] = layers_of(model)
        return self._layers[id(model)]

    def budget(self, batch) -> int | None:
        """The token budget of `batch`'s packed micro-batches, or None: padded ones. With AUTO,
        decided once per batch from its lengths, the same for all its passes; under sharded
        weights the same on every process (all pack if one does), as their forward calls pair up."""
        if self.micro_batch_tokens != AUTO or self.mask_problem:
            return None if self.mask_problem else self.micro_batch_tokens
        if self._picked[0] is not batch:
            ragged = padded_waste(batch.prompt_mask, batch.completion_mask, batch.prompt_index) > AUTO_WASTE
            if self.lockstep:
                ragged = bool(distributed.all_reduce(torch.tensor(int(ragged)), "max"))
            self._picked = (batch, AUTO_TOKENS if ragged else None)
        return self._picked[1]

    def of(self, model, batch, rows: torch.Tensor, entropies: bool = False, routers=None):
        """Log-probs (len(rows), T) under `model` of the completions `rows` of `batch` (a
        rollout.RolloutBatch), each distinct prompt run once; with `entropies`, the pair of those
        and the entropies (len(rows), T) of the distributions they are drawn from, from the same
        logits (algorithm.entropy_coef); with `routers` (a routers.RouterLogits, opened here), the
        pair of that and the router logits (layers, len(rows), T, E) at the same positions."""
        groups, prompt_index = torch.unique(batch.prompt_index[rows], return_inverse=True)
        # One row per distinct prompt; which one does not matter, they hold the same prompt tokens.
        first = torch.empty_like(groups)
        first[prompt_index] = rows
        prompt_ids, prompt_mask = batch.prompt_ids[first], batch.prompt_mask[first]
        completion_ids, prompt_index = batch.completion_ids[rows], prompt_index.to(self.device)
        completion_mask = batch.completion_mask[rows].to(self.device)
        sequence_ids = None if batch.sequence_ids is None or not batch.sequence_ids[rows].any() \
            else batch.sequence_ids[rows].to(self.device)
        prefix = None if sequence_ids is None or batch.sequence_prefix is None else batch.sequence_prefix[rows].to(self.device)
        # Summed on the device, read by the trainer once a step: no host synchronisation per pass.
        self.needed += prompt_mask.sum() + completion_mask.sum() - len(rows)
        problem = self.layers(model).mask_problem()
        with routers or contextlib.nullcontext():
            if self.budget(batch) is not None and not problem:  # (a teacher's may be refused: padded then)
                packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index, sequence_ids, prefix)
                self.computed += packed.input_ids.shape[1]
                return packed_logprobs(model, packed, completion_ids.shape, self.temperature, self.chunk_size,
                                       self.whole_model, entropies, routers)
            images = None if batch.images is None else [batch.images[i] for i in first.tolist()]
            if sequence_ids is None or problem is None:
                return self._padded(model, prompt_ids, prompt_mask, completion_ids, prompt_index, images,
                                    (sequence_ids, prefix), entropies, routers)
            # No mask keeps this model's sequences apart (a layer with a state): each one a row of its own.
            split = Split.of(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index, sequence_ids, prefix)
            out = self._padded(model, split.prompt_ids, split.prompt_mask, split.completion_ids, split.prompt_index,
                               None, (None, None), entropies, routers)
        values, routed = out if routers is not None else (out, None)
        values = tuple(map(split.back, values)) if entropies else split.back(values)
        return values if routers is None else (values, split.back(routed.permute(1, 2, 0, 3)).permute(2, 0, 1, 3))

    def train(self, batch, rows: torch.Tensor, mask: torch.Tensor, entropies: bool) -> TrainPass:
        """The policy's training pass over completions `rows` of `batch`, with gradient: their
        log-probs, with `entropies` their entropies, and with `routed` the load-balancing
        loss's per-sequence terms over the trained tokens `mask` (len(rows), T) (algorithm/load_balancing.py)."""
        routers = None if self.routed is None else RouterLogits(self.policy)
        out = self.of(self.policy, batch, rows, entropies, routers)
        values, routed = out if routers is not None else (out, None)
        logps, entropy = values if entropies else (values, None)
        if routers is None:
            return TrainPass(logps, entropy)
        balance, counts = sequence_balance(routed, mask, self.routed[1])
        return TrainPass(logps, entropy, balance, counts)

    def _padded(self, model, prompt_ids, prompt_mask, completion_ids, prompt_index, images, sequences, entropies,
                routers=None):
        """completion_logprobs of one padded micro-batch, its positions counted; sequences: its rows'
        (sequence_ids, sequence_prefix), or Nones."""
        # Checkpointed layers drop the key/value cache in training mode, and a layer with a state
        # updates it in place in the cache, which autograd cannot see through: run completions whole.
        share_prompt = not (self.checkpointing and model.training) and not (self.layers(model).stateful
                                                                            and torch.is_grad_enabled())
        (P, Lp), (B, T) = prompt_ids.shape, completion_ids.shape
        last = 0 if self.whole_model or self.vision is not None else 1  # as _shared_prompt_pass splits a row
        self.computed += P * (Lp - last) + B * (T - 1 + last) if share_prompt else B * (Lp + T - 1)
        return completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, prompt_index, self.temperature,
            chunk_size=self.chunk_size,
            share_prompt=share_prompt,
            whole_model=self.whole_model,
            vision=self.vision, images=images,
            # Only rows of several sequences need the 4D mask (L x L per row).
            sequence_ids=sequences[0],
            sequence_prefix=sequences[1],
            entropies=entropies,
            routers=routers,
        )

    def old(self, batch, active: torch.Tensor) -> torch.Tensor:
        """The policy's log-probs (n, T) before the step's first update."""
        return self.frozen(self.policy, batch, active)

    def ref(self, batch, active: torch.Tensor) -> torch.Tensor:
        """The reference model's log-probs (n, T): its own copy, or, with LoRA, the policy without adapters."""
        if self.reference is not None:
            return self.frozen(self.reference, batch, active)
        with self.policy.disable_adapter():
            return self.frozen(self.policy, batch, active)

    @torch.no_grad()
    def frozen(self, model, batch, active: torch.Tensor) -> torch.Tensor:
        """Log-probs (n, T) under `model` of the `active` completions, in micro-batches, no gradient;
        the inactive rows (never used) are 0."""
        was_training = model.training
        model.eval()
        try:
            # completion_logprobs returns float32 for 16-bit models, the model's dtype otherwise.
            dtype = torch.promote_types(model.dtype, torch.float32)
            out = torch.zeros(batch.completion_ids.shape, dtype=dtype, device=self.device)  # (n, T)
            for mb in self.micro_batches(batch, torch.nonzero(active).view(-1)):
                out[mb] = self.of(model, batch, mb)  # (M, T)
            return out
        finally:
            model.train(was_training)
            if hasattr(model, "reshard"):  # FSDP2: no backward follows to free the gathered outer weights
                model.reshard()


def _sizes(batch, rows: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """Of completions `rows` of `batch`: their lengths, their prompts' lengths and their prompts."""
    return (batch.completion_mask[rows].sum(-1).tolist(), batch.prompt_mask[rows].sum(-1).tolist(),
            batch.prompt_index[rows].tolist())


def packed_logprobs(model, packed: Packed, shape: torch.Size, temperature: float, chunk_size: int | None,
                    whole_model: bool, entropies: bool = False, routers=None):
    """Log-probs (B, T) = `shape` of a packed row's completions (models/packing.py); 0 on padding
    (with `entropies`, the pair of those and their distributions' entropies, and with `routers`
    the pair of that and the router logits (layers, B, T, E), as completion_logprobs).
    One call of the model on the row; only the positions that predict a completion token reach the
    output layer (the model's own head, or chunk by chunk, as completion_logprobs)."""
    inputs = dict(input_ids=packed.input_ids, attention_mask=masks(model, packed.allowed, packed.position_ids,
                                                                   packed.position_ids),
                  position_ids=packed.position_ids, use_cache=False)
    if chunk_size is None:
        logits = model(**inputs, logits_to_keep=packed.predictors).logits[0]  # (K, V)
        values = per_token(logits, packed.targets, temperature, entropies)  # (K,)
    else:
        if whole_model:  # its last hidden state is the decoder's
            hidden = model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
        else:
            hidden = model.get_decoder()(**inputs).last_hidden_state  # (1, L, H)
        values = chunked_logprobs(hidden[:, packed.predictors], model.get_output_embeddings(), packed.targets[None],
                                  temperature, chunk_size, entropies)
        values = tuple(v[0] for v in values) if entropies else values[0]  # (K,)
    B, T = shape

    def unpacked(v: torch.Tensor) -> torch.Tensor:  # (K, ...) -> (B, T, ...)
        return v.new_zeros(B * T, *v.shape[1:]).index_put((packed.slots,), v).view(B, T, *v.shape[1:])

    values = tuple(unpacked(v) for v in values) if entropies else unpacked(values)
    if routers is None:
        return values
    routed = routers.take(0)[:, 0, packed.predictors]  # (layers, K, E)
    return values, unpacked(routed.transpose(0, 1)).permute(2, 0, 1, 3)
