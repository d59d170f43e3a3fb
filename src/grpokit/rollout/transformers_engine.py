"""The default engine: sampling with the policy itself, in the training process.

The engine holds the policy module, so it always generates with the current weights. Each prompt
is run through the model once; its key/value cache is then repeated for its n completions.
Completion i draws its tokens from its own random stream, seeded by seeds[i]: what it samples does
not depend on which other completions share its batch (or its process).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpokit.models.logprobs import cache_inputs, position_ids
from grpokit.models.vision import IMAGE_TOKEN
from grpokit.rollout.batch import RolloutBatch, SamplingParams
from grpokit.rollout.weights import checksum, named_weights
from grpokit.runtime import distributed


def sample_next(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row from logits (B, V), by inverse CDF of one uniform (B,) per row.

    The sampling distribution: softmax(logits / temperature), then top-k, top-p and min-p (in
    transformers' order), renormalised. Returns tokens (B,), their log-probs under it (B,), and the
    entropy of the tempered, unfiltered distribution (B,) (the policy's, as the trainer sees it).
    """
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), _entropy_of(logprobs)
    # Few (B, V) float32 temporaries at a time (in place where the arithmetic is the same): on a
    # GPU, with a large vocabulary, they are most of a decoding step's memory.
    logits = logits.float().div_(params.temperature) if logits.dtype != torch.float32 else logits / params.temperature
    unfiltered = torch.log_softmax(logits, dim=-1)  # (B, V)
    policy_entropy = _entropy_of(unfiltered)
    top_k = 0 < params.top_k < logits.shape[-1]
    if not (top_k or params.top_p < 1.0 or params.min_p > 0):  # no filter: the sampling distribution is the policy's
        del logits
        return _inverse_cdf(unfiltered, uniforms) + (policy_entropy,)
    del unfiltered
    if top_k:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        # Last, as transformers' MinPLogitsWarper: drop p < min_p * max p. The bound is relative to
        # the most likely token, so the renormalisation by top-k/top-p before does not move it.
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    del logits
    return _inverse_cdf(logprobs, uniforms) + (policy_entropy,)


def _entropy_of(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) of the distribution whose log-probs are `logprobs` (B, V)."""
    return -(logprobs.exp().mul_(logprobs)).sum(-1)


def _inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logprobs` (B, V), the first whose CDF exceeds its uniform (B,), and its log-prob."""
    cdf = logprobs.exp().cumsum_(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1), ~1
    # Strictly below the total, the first entry of the CDF above x is a token of positive probability.
    x = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (B, 1)
    tokens = torch.searchsorted(cdf, x, right=True).squeeze(-1)  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class TransformersEngine:
    """A RolloutEngine (the trainer's default), and the ServedEngine of `grpokit serve`."""

    exact_logprobs = True
    measures_entropies = True
    remote = False

    @classmethod
    def from_config(cls, rollout, model, tokenizer, eos_ids, model_name, lockstep, vision=None) -> TransformersEngine:
        return cls(model, pad_id=tokenizer.pad_token_id, eos_ids=eos_ids, lockstep=lockstep, vision=vision,
                   decoder=rollout.decoder, slots=rollout.decode_slots)

    def __init__(self, model, pad_id: int, eos_ids: list[int], lockstep: bool = False, vision=None,
                 decoder: str = "auto", slots: int | None = None):
        """vision: a vision-language model's vision.Vision (prompts come with their images);
        decoder: rollout.decoder (config.DECODERS); slots: rollout.decode_slots, the most
        completions decoded at once (None: all of a generation's)."""
        self.model = model
        self.lockstep = lockstep
        self.pad_id = pad_id
        self.eos_ids = torch.tensor(eos_ids)
        self.vision = vision
        self.decoder = decoder
        self.slots = slots
        if slots is not None and slots < 1:
            raise ValueError(f"rollout.decode_slots={slots}: must be at least 1 (or null: every completion at once)")
        if slots is not None and decoder == "static":
            raise ValueError(f"rollout.decode_slots: {SLOTS_NOT_STATIC}")
        # Since the engine was made: token positions decoding ran through the model (padding and
        # ended completions included) and completion tokens it kept; their ratio is decoding's waste.
        self.decoded_positions = self.decoded_tokens = 0
        if decoder == "static" and (problem := static_decoding_problem(model.config, vision is not None)):
            # (config/checks.py refuses such a run at start-up: this is an engine made by hand)
            raise ValueError(f"rollout.decoder=static: {problem}; use rollout.decoder=dynamic (or auto)")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # It samples with the policy module itself: every update is seen at once, a sharded module
    # gathers its weights in each forward, and there is nothing to free or release.
    def weights_updated(self) -> None:
        pass

    def needs_weights(self) -> bool:
        return False

    def use_weights(self, weights) -> None:
        raise RuntimeError("the transformers engine samples with the policy module itself: it takes no weights")

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass

    def weights_checksum(self) -> str:
        return checksum(named_weights(self.model))

    @torch.no_grad()
    def load_weights(self, pairs) -> str:
        """Copy each (name, tensor) of `pairs` into the model as it comes (one tensor in flight);
        return the checksum of the model's weights after."""
        params = dict(named_weights(self.model))
        for name, tensor in pairs:
            params[name].copy_(tensor)
        return self.weights_checksum()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int | Sequence[int],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        images: list[tuple] | None = None,
    ) -> RolloutBatch:
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            return self._generate(prompts, n, params, seeds, images)
        finally:
            model.train(was_training)

    def _generate(self, prompts, n, params, seeds, images) -> RolloutBatch:
        """Prefill each prompt once, share its key/value cache among its completions, then decode
        the completions together, one token a step."""
        device = self.device
        counts = _completion_counts(prompts, n)  # (P,)
        uniforms = _random_streams(params, seeds, int(counts.sum()), device)
        cache = DynamicCache()
        prompt_ids, prompt_mask, logits, next_pos = self._prefill(prompts, cache, device, images)
        prompt_index = torch.repeat_interleave(torch.arange(len(prompts)), counts)  # (N,)
        index = prompt_index.to(device)
        if self._decoder(device) == "static" and params.max_tokens > 1:
            cache.batch_select_indices(index)  # index the cache instead of recomputing
            decoded = StaticDecoder(self.model, self.pad_id, self.eos_ids, self.lockstep, cache, prompt_mask[index],
                                    next_pos[index], params, uniforms).run(logits[index])
        else:
            decoded = self._decode(logits, index, prompt_mask, next_pos, params, uniforms, cache, device)
        batch = decoded.batch(prompt_index, prompt_ids[index], prompt_mask[index])
        self.decoded_positions += decoded.positions
        self.decoded_tokens += int(batch.completion_mask.sum())
        if images is not None:
            batch.images = [images[i] for i in prompt_index.tolist()]
        return batch

    def _prefill(self, prompts, cache, device, images):
        """Run the prompts, left-padded, through the model once (with their `images`, a vision-
        language model's), into `cache`. Returns the prompt ids and mask (P, Lp), the logits (P, V)
        of each prompt's first completion token, and its position (P,)."""
        prompt_ids, prompt_mask = _left_padded(prompts, self.pad_id, device)
        if self.vision is None:
            extra, positions, next_pos = {}, position_ids(prompt_mask), prompt_mask.sum(-1)
        else:
            inputs = self.vision.inputs(self.model, prompt_ids, prompt_mask, images)
            extra, positions, next_pos = inputs.extra, inputs.position_ids, inputs.next_position
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            **extra,
            **cache_inputs(self.model, cache),
            logits_to_keep=1,
        )
        return prompt_ids, prompt_mask, out.logits[:, -1], next_pos

    def _decode(self, first, prompt_index, prompt_mask, next_pos, params, uniforms, cache, device) -> _Decoded:
        """Decode completion i (of N) of prompt prompt_index[i] (N,) from that prompt's row of the
        prefilled `cache`, its logits first[p] (P, V), mask prompt_mask[p] (P, Lp) and next position
        next_pos[p] (P,): sample a token, run it through the model for the logits of the next, until
        the completion has ended: an EOS (or a vision-language model's image token), or
        params.max_tokens tokens.

        A completion that ends leaves the batch at once: its rows of the key/value cache, its
        attention mask and its position are dropped, so each step computes only the completions
        still going. At most self.slots completions are in the batch (all N when None); the others
        wait, and take the places of those that end (continuous batching): a completion joins with
        its prompt's cache row, padded on the left to the batch's length and masked there, its first
        token sampled from its prompt's logits. With slots, the cache's leading columns that every
        row masks are cut off as rows leave, so it stays within the longest prompt plus max_tokens.
        (With sharded weights every process makes every forward call: one whose completions have
        all ended keeps one of them going, its outputs unused.)"""
        N, T, cached = len(prompt_index), params.max_tokens, cache_inputs(self.model, cache)
        slots = N if self.slots is None else min(self.slots, N)
        stops = None if self.vision is None else torch.tensor([self.vision.image_token_id], device=device)
        decoded = _Decoded(N, T, self.pad_id, self.eos_ids.to(device), device, stops)
        prompts = [(layer.keys, layer.values) for layer in cache.layers]  # each prompt's (P, H, Lp, D)
        cache.batch_select_indices(prompt_index[:0])  # an empty batch: completions join it below
        live = prompt_index[:0]  # (n,) the completions in the batch
        tok, attn, pos, logits = live, prompt_mask[:0], next_pos[:0], None  # (n,), (n, L), (n,), (n, V)
        waiting, changed = 0, False  # completions waiting..N - 1 have not joined yet; the batch's rows changed
        while True:
            if logits is not None:
                tok = decoded.add(*sample_next(logits, params, _draws(uniforms, live, decoded.count)), live)
            while True:  # drop the completions that ended; fill the free places with waiting ones
                going = ~decoded.done(live)  # (n,)
                keep = going.nonzero().view(-1)  # (n',)
                if waiting == N and len(keep) == 0 and self.lockstep:
                    keep = going.new_zeros(1, dtype=torch.long)  # a row for the forward calls still collective
                if len(keep) < len(live):
                    cache.batch_select_indices(keep)
                    live, tok, attn, pos = live[keep], tok[keep], attn[keep], pos[keep]
                    changed = True
                if waiting == N or len(live) >= slots:
                    break
                new = torch.arange(waiting, min(N, waiting + slots - len(live)), device=device)  # (k,)
                waiting += len(new)
                p = prompt_index[new]
                attn = _join(cache, attn, prompts, prompt_mask[p], p)
                live, pos = torch.cat([live, new]), torch.cat([pos, next_pos[p]])
                tok = torch.cat([tok, decoded.add(*sample_next(first[p], params, _draws(uniforms, new, decoded.count)),
                                                  new)])
            if changed and slots < N:
                attn, changed = _trimmed(cache, attn), False
            if waiting == N:
                prompts = None
            if _all_ended(int((~decoded.done(live)).sum()), self.lockstep, device):
                break
            attn = torch.cat([attn, torch.ones((len(live), 1), dtype=attn.dtype, device=device)], dim=1)
            logits = self._next_logits(tok, attn, pos, cached)
            decoded.positions += len(live)
            pos = pos + 1
        decoded.width = _longest(decoded.count, self.lockstep)
        return decoded

    def _decoder(self, device: torch.device) -> str:
        """The decoder this generation uses: rollout.decoder, "auto" being the one measured faster
        on the device (DEFAULT_DECODER) where the static decoder can run (static_decoding_problem)
        and no completion waits for a slot (SLOTS_NOT_STATIC)."""
        if self.decoder != "auto":
            return self.decoder
        static = DEFAULT_DECODER[device.type == "cuda"] == "static" and self.slots is None
        return "static" if static and static_decoding_problem(self.model.config, self.vision is not None) is None \
            else "dynamic"

    def _next_logits(self, tok: torch.Tensor, attn: torch.Tensor, next_pos: torch.Tensor, cached: dict) -> torch.Tensor:
        """One decoding step: the tokens just sampled (N,) through the model, at positions
        `next_pos` (N,) over the cache; the logits (N, V) of the tokens after them."""
        if self.vision is None:
            ids, positions = tok[:, None], next_pos[:, None]
        else:  # an image token just sampled ended its completion: fed as text (models/vision.py)
            ids, positions = self.vision.as_text(tok[:, None]), self.vision.continued(self.model, next_pos, 1)
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            **cached,
        )
        return out.logits[:, -1]


def _all_ended(left: int, lockstep: bool, device: torch.device) -> bool:
    """Whether no completion is `left` to decode; with sharded weights (lockstep), on every process:
    each decodes until all are done, since every forward call is a collective."""
    if lockstep:
        left = int(distributed.all_reduce(torch.tensor(left, device=device)))
    return left == 0


def _longest(count: torch.Tensor, lockstep: bool) -> int:
    """The most tokens any completion has (counts (N,)); with sharded weights, any process's."""
    longest = count.max()
    if lockstep:
        longest = distributed.all_reduce(longest, "max")
    return int(longest)


def _draws(uniforms: torch.Tensor | None, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor | None:
    """The uniforms (n,) that completions `rows` (n,) draw their next tokens with: the count[row]-th
    of each one's stream (a completion kept only for the collective forward draws its last again)."""
    if uniforms is None:
        return None
    return uniforms[rows, count[rows].clamp(max=uniforms.shape[1] - 1)]


def _join(cache: DynamicCache, attn: torch.Tensor, prompts: list[tuple], mask: torch.Tensor,
          p: torch.Tensor) -> torch.Tensor:
    """Append prompts p's rows (k,) of the prefilled `prompts` [(keys, values) (P, H, Lp, D) per
    layer], with their masks (k, Lp), to the batch in `cache` and its attention mask `attn` (n, L);
    whichever is shorter is padded with zeros on the left (masked there). Returns the new mask."""
    for layer, (keys, values) in zip(cache.layers, prompts):
        if keys is None or keys.numel() == 0:  # a layer that holds no cache of its own
            continue
        width = max(layer.keys.shape[-2], keys.shape[-2])
        layer.keys = torch.cat([_padded_left(layer.keys, width, -2), _padded_left(keys[p], width, -2)])
        layer.values = torch.cat([_padded_left(layer.values, width, -2), _padded_left(values[p], width, -2)])
    width = max(attn.shape[1], mask.shape[1])
    return torch.cat([_padded_left(attn, width), _padded_left(mask, width)])


def _padded_left(x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """`x` with zeros before its entries along `dim`, to `width` of them (`x` itself when it has them)."""
    if x.shape[dim] == width:
        return x
    shape = list(x.shape)
    shape[dim] = width - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _trimmed(cache: DynamicCache, attn: torch.Tensor) -> torch.Tensor:
    """Cut the leading columns that every row of the attention mask `attn` (n, L) masks off it and
    off the cache (each layer a plain growing one: a sliding window's keeps its own length)."""
    if len(attn) == 0 or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return attn
    start = int(attn.argmax(-1).min())  # the first column any row sees
    if start == 0:
        return attn
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
    return attn[:, start:]


def _completion_counts(prompts: list[list[int]], n: int | Sequence[int]) -> torch.Tensor:
    """The engine's `n` as one count per prompt (P,), each at least 1."""
    counts = torch.tensor([n] * len(prompts) if isinstance(n, int) else list(n))  # (P,)
    if counts.shape != (len(prompts),) or (counts < 1).any():
        raise ValueError(f"n must be a positive int or one positive count per prompt ({len(prompts)}), got {n}")
    return counts


def _random_streams(params: SamplingParams, seeds: Sequence[int] | None, N: int,
                    device: torch.device) -> torch.Tensor | None:
    """(N, max_tokens): completion i's uniforms, from its own generator seeded by seeds[i]; None
    when greedy (no randomness, no seeds needed)."""
    if not params.temperature > 0:
        return None
    if seeds is None or len(seeds) != N:
        raise ValueError(f"sampling needs one seed per completion ({N}), got {seeds if seeds is None else len(seeds)}")
    return torch.stack([
        torch.rand(params.max_tokens, generator=torch.Generator().manual_seed(int(s))) for s in seeds
    ]).to(device)


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids, padded on the left with `pad_id`, and their mask (1 on prompt tokens): (P, Lp) each."""
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = 1
    return prompt_ids.to(device), prompt_mask.to(device)


class _Decoded:
    """The completions being decoded: each one's tokens so far, their log-probs and the entropies
    they were sampled from, and whether it has ended."""

    def __init__(self, N: int, T: int, pad_id: int, eos_ids: torch.Tensor, device: torch.device,
                 image_ids: torch.Tensor | None = None):
        """T: the most tokens a completion has; image_ids: a vision-language model's image token,
        which ends a completion too."""
        self.pad_id, self.eos_ids, self.image_ids, self.T = pad_id, eos_ids, image_ids, T
        self.finished = torch.zeros(N, dtype=torch.bool, device=device)  # (N,) an EOS (or image token) was sampled
        self.imaged = torch.zeros(N, dtype=torch.bool, device=device)  # (N,) an image token was sampled
        self.count = torch.zeros(N, dtype=torch.long, device=device)  # (N,) tokens each completion has
        self.tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)  # (N, T), padding after the end
        self.logps = self.entropies = None  # (N, T) each, made with the first tokens (in their dtype)
        self.masks = torch.zeros((N, T), dtype=torch.bool, device=device)  # (N, T)
        self.positions = N  # token positions run through the model for these completions: the prompts' last, then each step's
        self.width = T  # the columns of the batch: the most tokens a completion has (the decoder sets it)

    def done(self, rows: torch.Tensor) -> torch.Tensor:
        """Whether completions `rows` (n,) have ended (n,): an EOS, an image token or T tokens."""
        return self.finished[rows] | (self.count[rows] >= self.T)

    def add(self, tok: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Record the next token (n,) of completions `rows` (n,), its log-prob and entropy; a
        completion that had ended records nothing. Returns the tokens, the pad id for those."""
        if self.logps is None:
            self.logps = torch.zeros(self.tokens.shape, dtype=lp.dtype, device=lp.device)
            self.entropies = torch.zeros(self.tokens.shape, dtype=ent.dtype, device=ent.device)
        alive = ~self.done(rows)  # (n,)
        tok = torch.where(alive, tok, torch.full_like(tok, self.pad_id))
        rows, at = rows[alive], self.count[rows][alive]  # (a,)
        self.tokens[rows, at], self.logps[rows, at], self.entropies[rows, at] = tok[alive], lp[alive], ent[alive]
        self.masks[rows, at] = True
        self.count[rows] += 1
        ended = torch.isin(tok[alive], self.eos_ids)
        if self.image_ids is not None:
            image = torch.isin(tok[alive], self.image_ids)
            self.imaged[rows] |= image
            ended |= image
        self.finished[rows] |= ended
        return tok

    def batch(self, prompt_index: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> RolloutBatch:
        """The completions decoded, (N, width) each, after their prompts."""
        w = self.width
        return RolloutBatch(
            prompt_index=prompt_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=self.tokens[:, :w],
            completion_mask=self.masks[:, :w].long(),
            sampling_logps=self.logps[:, :w],
            entropies=self.entropies[:, :w],
            finish_reasons=[IMAGE_TOKEN if i else "stop" if f else "length"
                            for f, i in zip(self.finished.tolist(), self.imaged.tolist())],
        )


# rollout.decoder=auto: the decoder measured faster on each device (docs/speed-and-memory.md),
# {on CUDA: decoder}. "dynamic" grows the key/value cache token by token (TransformersEngine._decode);
# "static" decodes at a fixed shape over a cache sized once (StaticDecoder).
DEFAULT_DECODER = {False: "dynamic", True: "static"}
# The static decoder asks whether every completion has ended once per this many tokens (a host
# synchronisation each time; a GPU's kernels run ahead of the host in between).
CHECK_EVERY = 8
SLOTS_NOT_STATIC = ("the static decoder's cache is sized once for the rows it starts with, so no completion can join "
                    "later; use rollout.decoder=dynamic (auto picks it when decode_slots is set)")


def static_decoding_problem(config, vision: bool = False) -> str | None:
    """Why the static decoder cannot decode with a model of (transformers) `config`, or None: it
    needs a text model (not `vision`) whose every layer attends to the whole cache (a sliding
    window's cache is the window's size) through an attention that takes a 4D mask (sdpa, eager;
    a model not loaded yet has none set, and loads with sdpa)."""
    if vision:
        return "a vision-language model decodes dynamically (its image tokens end a completion)"
    config = config.get_text_config(decoder=True)
    layers = getattr(config, "layer_types", None)
    if layers is not None and any(kind != "full_attention" for kind in layers):
        return f"this model has layers of other kinds than full attention ({sorted(set(layers))})"
    if layers is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"this model attends through a sliding window of {config.sliding_window} tokens"
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no 4D attention mask"
    return None


class StaticDecoder:
    """Decoding at a fixed shape (rollout.decoder=static): the key/value cache sized once, for the
    batch and the longest sequence (the prompts' width plus max_tokens), and every step the same
    shapes: the N tokens just sampled, at one cache slot, an attention mask over the whole cache,
    sampling on the device into preallocated (N, max_tokens) outputs. A completion that has ended
    goes on being computed, its tokens recorded as padding and masked out, so the batch keeps its
    shape; the host learns whether all have ended only every CHECK_EVERY tokens. When by then half
    the rows or more have ended, they are dropped (the cache and every buffer cut to the rows still
    going), so the shape at least halves each time it changes: at most log2(N) shapes. On CUDA, one
    step (sampling a token, then the model's forward on it) is captured as a CUDA graph, once per
    shape, and replayed: one launch a token instead of one a kernel. (With sharded weights every
    process keeps its rows: every forward is a collective.)

    It samples what the dynamic decoder samples: completion i from its own uniforms, the same
    tokens, log-probs equal to rounding (the attention runs over the whole cache, masked; in
    bfloat16 that rounding can move a token drawn at the edge of two). static_decoding_problem
    says which models it cannot decode."""

    def __init__(self, model, pad_id: int, eos_ids: torch.Tensor, lockstep: bool, prefilled: DynamicCache,
                 prompt_mask: torch.Tensor, next_pos: torch.Tensor, params: SamplingParams,
                 uniforms: torch.Tensor | None):
        """The engine's model, pad id, EOS ids and lockstep (TransformersEngine); prefilled: the
        prompts' cache, one row per completion (N); prompt_mask (N, Lp); next_pos (N,): each
        completion's first position; uniforms (N, max_tokens) or None (greedy)."""
        from transformers import StaticCache

        self.model, self.pad_id, self.lockstep, self.params, self.uniforms = model, pad_id, lockstep, params, uniforms
        device = prompt_mask.device
        (N, Lp), T = prompt_mask.shape, params.max_tokens
        length = Lp + T - 1  # the last token sampled is never fed
        self.cache = StaticCache(config=self.model.config, max_cache_len=length)
        for i, layer in enumerate(prefilled.layers):  # the prompts' keys and values in slots 0 .. Lp - 1
            self.cache.update(layer.keys, layer.values, i, {"cache_position": torch.arange(Lp, device=device)})
            layer.keys = layer.values = None  # not held twice while decoding
        self.cached = cache_inputs(self.model, self.cache)
        # A step's inputs, updated in place: the tokens fed (N, 1), their positions (N, 1), their
        # cache slot (1,), the slots each completion sees (N, 1, 1, length), the token index (1,).
        self.ids = torch.full((N, 1), pad_id, dtype=torch.long, device=device)
        self.positions = next_pos[:, None].clone()
        self.slot = torch.tensor([Lp], device=device)
        self.seen = torch.zeros((N, 1, 1, length), dtype=torch.bool, device=device)
        self.seen[:, 0, 0, :Lp] = prompt_mask.bool()
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.eos_ids = eos_ids.to(device)
        # What is sampled, (N, T) each, and which completions have ended (N,).
        self.tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)
        self.logps = torch.zeros((N, T), device=device)
        self.entropies = torch.zeros((N, T), device=device)
        self.alive = torch.zeros((N, T), dtype=torch.bool, device=device)
        self.finished = torch.zeros(N, dtype=torch.bool, device=device)
        self.logits = None  # (N, V) the logits the next token is sampled from (a graph's output)
        # Once rows are dropped (_compact): the original index of each row still decoded (n,), and
        # the (N, ...) outputs of every completion, the dropped ones' final.
        self.rows = torch.arange(N, device=device)
        self.whole = None

    def run(self, logits: torch.Tensor) -> _Decoded:
        """Decode from the prompts' last logits (N, V) until every completion has ended or
        max_tokens tokens; the outputs as the dynamic decoder gives them."""
        T, graph, capture_at = self.params.max_tokens, None, 1
        self.logits = logits.clone()  # read by a step's sampling, written by its forward
        self.positions_run = self.finished.shape[0]  # the prefill's last position, once per completion
        for t in range(T - 1):
            if graph is None and t == capture_at and logits.device.type == "cuda" and not self.lockstep:
                graph = self._capture()  # a step at this shape ran eagerly: every lazy allocation is made
            if graph:
                graph.replay()
            else:
                self._step()
            self.positions_run += len(self.rows)
            if (t + 1) % CHECK_EVERY == 0:
                if _all_ended(int((~self.finished).sum()), self.lockstep, self.finished.device):
                    break
                if not self.lockstep and 2 * int(self.finished.sum()) >= len(self.rows):
                    self._compact()
                    graph, capture_at = (None if graph is not False else False), t + 2
        else:
            self._sample()  # the last token: no logits after it
        return self._outputs()

    OUTPUTS = ("tokens", "logps", "entropies", "alive", "finished")

    def _compact(self) -> None:
        """Drop the rows whose completions have ended: from the cache, the step's inputs, the
        uniforms and the outputs (theirs kept, final, in `whole`)."""
        if self.whole is None:
            self.whole = {name: getattr(self, name) for name in self.OUTPUTS}  # every row, as written so far
        else:
            for name in self.OUTPUTS:
                self.whole[name].index_copy_(0, self.rows, getattr(self, name))
        keep = (~self.finished).nonzero().view(-1)  # (n',)
        self.rows = self.rows[keep]
        for name in ("ids", "positions", "seen", "logits", *self.OUTPUTS):
            setattr(self, name, getattr(self, name).index_select(0, keep))
        if self.uniforms is not None:
            self.uniforms = self.uniforms.index_select(0, keep)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)

    def _capture(self):
        """One step as a CUDA graph, on the step's buffers (captured, not run); False where the
        model's forward cannot be captured (one that synchronises with the host): the steps then
        run eagerly, at the same fixed shapes. Thread-local capture: work that other threads put
        on the GPU meanwhile (an agent's own) is not caught in it."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._step()
        except RuntimeError as e:
            warnings.warn(f"rollout.decoder=static: the decoding step could not be captured as a CUDA graph ({e}); "
                          "it runs eagerly", stacklevel=2)
            return False
        return graph

    def _step(self) -> None:
        """Sample token `step`, then run it through the model for the logits of the next."""
        self.logits.copy_(self._forward(self._sample()))

    def _sample(self) -> torch.Tensor:
        """Token `step` of every completion (N,), recorded; an ended completion's is padding."""
        uniforms = None if self.uniforms is None else self.uniforms.index_select(1, self.step).squeeze(1)
        tok, lp, ent = sample_next(self.logits, self.params, uniforms)
        alive = ~self.finished
        tok = torch.where(alive, tok, self.pad_id)
        self.tokens.index_copy_(1, self.step, tok[:, None])
        self.logps.index_copy_(1, self.step, torch.where(alive, lp, 0.0)[:, None])
        self.entropies.index_copy_(1, self.step, torch.where(alive, ent, 0.0)[:, None])
        self.alive.index_copy_(1, self.step, alive[:, None])
        self.finished.logical_or_(torch.isin(tok, self.eos_ids))
        return tok

    def _forward(self, tok: torch.Tensor) -> torch.Tensor:
        """The tokens just sampled (N,) through the model at their slot; the logits (N, V) after them."""
        from grpokit.models.logprobs import attention_form

        self.ids.copy_(tok[:, None])
        self.seen.index_fill_(3, self.slot, True)
        out = self.model(input_ids=self.ids, attention_mask=attention_form(self.model, self.seen),
                         position_ids=self.positions, cache_position=self.slot, **self.cached)
        self.positions.add_(1)
        self.slot.add_(1)
        self.step.add_(1)
        return out.logits[:, -1]

    def _outputs(self) -> _Decoded:
        """The decoded completions, cut after the last token any of them sampled (every process's,
        with sharded weights: they decode alike)."""
        if self.whole is not None:  # rows were dropped: the last ones' outputs join the others'
            for name in self.OUTPUTS:
                self.whole[name].index_copy_(0, self.rows, getattr(self, name))
            for name in self.OUTPUTS:
                setattr(self, name, self.whole[name])
        last = int(self.alive.any(0).nonzero().max())  # token 0 is always sampled
        if self.lockstep:
            last = int(distributed.all_reduce(torch.tensor(last), "max"))
        N, T = self.tokens.shape
        decoded = _Decoded(N, T, self.pad_id, self.eos_ids, self.finished.device)
        decoded.tokens, decoded.logps, decoded.entropies, decoded.masks = self.tokens, self.logps, self.entropies, self.alive
        decoded.finished, decoded.width, decoded.positions = self.finished, last + 1, self.positions_run
        return decoded
