"""The default engine: sampling with the policy itself, in the training process.

The engine holds the policy module, so it always generates with the current weights. Each prompt
is run through the model once; its key/value cache is then repeated for its n completions.
Completion i draws its tokens from its own random stream, seeded by seeds[i]: what it samples does
not depend on which other completions share its batch (or its process). It decodes dynamically
(here: a cache grown token by token, completions leaving as they end and, with rollout.decode_slots,
joining as places free) or at a static shape (static_decoder.py); decoding.py is what both share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpokit.engines.batch import RolloutBatch, SamplingParams
from grpokit.engines.decoding import Decoded, all_ended, longest, sample_next
from grpokit.engines.static_decoder import StaticDecoder, static_decoding_problem
from grpokit.engines.weights import adapter_tensors, checksum, is_lora, layout, named_weights
from grpokit.models.architecture import append_rows, cache_inputs, new_cache, rows, select_rows
from grpokit.models.logprobs import position_ids
from grpokit.settings.schema import ModelConfig, RolloutConfig


class TransformersEngine:
    """A RolloutEngine (the trainer's default), and the ServedEngine of `grpokit serve`."""

    exact_logprobs = True
    measures_entropies = True
    remote = False
    takes_adapters = True  # served: a LoRA trainer pushes its adapters alone (load_adapters)
    stops_between_tokens = True  # generate's until and offsets: served, it takes pushes in flight

    @classmethod
    def from_config(cls, rollout: RolloutConfig, model, tokenizer, eos_ids, model_name, lockstep, vision=None) -> TransformersEngine:
        return cls(model, pad_id=tokenizer.pad_token_id, eos_ids=eos_ids, lockstep=lockstep, vision=vision,
                   decoder=rollout.decoder, slots=rollout.decode_slots)

    @classmethod
    def served(cls, m: ModelConfig, rollout: RolloutConfig, tokenizer, vision=None, tensor_parallel_size: int = 1,
               data_parallel_size: int = 1) -> tuple:
        """What `grpokit serve` serves (training/setup.py `build`): (the engine, its model, EOS ids),
        model.name in model.dtype (model.quantization: the base a QLoRA trainer pushes its adapters to)
        on the GPU where there is one, decoding at most rollout.decode_slots completions at once
        (the parallel sizes are vLLM's)."""
        from grpokit.models.loading import eos_token_ids, fit_for_passes, load_model

        # requires_grad stays on, as on the trainer's policy: PyTorch runs other CPU kernels for
        # parameters without it (measured: log-probs differ in the last bits), and the server must
        # sample exactly as the trainer's own engine would. Generation runs under no_grad anyway.
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(m.name, m.dtype, m.quantization, device)
        model = (model if m.quantization != "none" else model.to(device)).eval()  # (a quantized one loads in place)
        fit_for_passes(model)  # the passes the trainer's policy runs, kernel for kernel
        eos = eos_token_ids(model, tokenizer)
        return cls(model, tokenizer.pad_token_id, eos, vision=vision, slots=rollout.decode_slots), model, eos

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
        """The checksum of what it samples with: the weights, or, under pushed adapters, theirs."""
        return checksum(adapter_tensors(self.model) if is_lora(self.model) else named_weights(self.model))

    @torch.no_grad()
    def load_weights(self, pairs) -> str:
        """Copy each (name, tensor) of `pairs` into the model as it comes (one tensor in flight);
        return the checksum of the model's weights after. Adapters pushed before are dropped."""
        if is_lora(self.model):
            # The base as it was (adapters were never merged into it), trainable again as served
            # (TransformersEngine.served: the CPU kernels follow requires_grad).
            self.model = self.model.unload().requires_grad_(True)
        params = dict(named_weights(self.model))
        for name, tensor in pairs:
            params[name].copy_(tensor)
        return self.weights_checksum()

    def adapter_layout(self, settings: dict) -> list[list]:
        """The layout (weights.layout) of the adapters `settings` (models/loading.py adapter_settings)
        make on this base: what an adapter push of them must announce. The adapters are made now,
        or kept when the same settings made them before."""
        from grpokit.models.loading import with_adapters

        if getattr(self.model, "grpokit_adapters", None) != settings:
            self.model = self.model.unload() if is_lora(self.model) else self.model  # the base alone, should peft refuse
            self.model = with_adapters(self.model, settings)
            self.model.grpokit_adapters = settings
        return layout(adapter_tensors(self.model))

    @torch.no_grad()
    def load_adapters(self, pairs) -> str:
        """Copy each (name, tensor) of an adapter push into the adapters `adapter_layout` made; the
        model samples with base + adapters (not merged, as the trainer's own forward computes);
        return their checksum."""
        params = dict(adapter_tensors(self.model))
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
        until: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
        offsets: Sequence[int] | None = None,
        abandoned: threading.Event | None = None,
    ) -> RolloutBatch:
        """As RolloutEngine.generate; `until(stopped, count)`, given, is asked after every token with
        which completions (N,) have sampled an EOS and how many tokens each has (N,), and stops the
        generation when it answers true: the others end there, finish reason "length" (partial
        rollouts, sampling/partial.py; a server's in-flight weight updates). It decodes dynamically
        then. `offsets` (N,): where in its seed's stream of uniforms each completion starts, so that
        a completion continued from its tokens so far draws what it would have drawn going on.
        `abandoned`, once set (a served request whose client went away, runtime/abandoned.py), ends
        the generation at the next token the decoder looks at (the static decoder: every
        CHECK_EVERY), the completions cut there."""
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            return self._generate(prompts, n, params, seeds, images, until, offsets, abandoned)
        finally:
            model.train(was_training)

    def _generate(self, prompts, n, params, seeds, images, until=None, offsets=None, abandoned=None) -> RolloutBatch:
        """Prefill each prompt once, share its key/value cache among its completions, then decode
        the completions together, one token a step."""
        device = self.device
        counts = _completion_counts(prompts, n)  # (P,)
        uniforms = _random_streams(params, seeds, int(counts.sum()), device, offsets)
        cache = new_cache(self.model)
        prompt_ids, prompt_mask, logits, next_pos = self._prefill(prompts, cache, device, images)
        prompt_index = torch.repeat_interleave(torch.arange(len(prompts)), counts)  # (N,)
        index = prompt_index.to(device)
        if self._decoder(device) == "static" and params.max_tokens > 1 and until is None:
            select_rows(cache, index)  # index the cache instead of recomputing
            decoded = StaticDecoder(self.model, self.pad_id, self.eos_ids, self.lockstep, cache, prompt_mask[index],
                                    next_pos[index], params, uniforms, abandoned).run(logits[index])
        else:
            if abandoned is not None:
                until = _or_abandoned(until, abandoned)
            decoded = self._decode(logits, index, prompt_mask, next_pos, params, uniforms, cache, device, until)
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

    def _decode(self, first, prompt_index, prompt_mask, next_pos, params, uniforms, cache, device,
                until=None) -> Decoded:
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
        decoded = Decoded(N, T, self.pad_id, self.eos_ids.to(device), device, stops)
        prompts = rows(cache)  # each prompt's entries: keys and values (P, H, Lp, D), states
        select_rows(cache, prompt_index[:0])  # an empty batch: completions join it below
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
                    select_rows(cache, keep)
                    live, tok, attn, pos = live[keep], tok[keep], attn[keep], pos[keep]
                    changed = True
                if waiting == N or len(live) >= slots:
                    break
                new = torch.arange(waiting, min(N, waiting + slots - len(live)), device=device)  # (k,)
                waiting += len(new)
                p = prompt_index[new]
                attn = append_rows(cache, attn, prompts, prompt_mask[p], p)
                live, pos = torch.cat([live, new]), torch.cat([pos, next_pos[p]])
                tok = torch.cat([tok, decoded.add(*sample_next(first[p], params, _draws(uniforms, new, decoded.count)),
                                                  new)])
            if changed and slots < N:
                attn, changed = _trimmed(cache, attn), False
            if waiting == N:
                prompts = None
            if all_ended(int((~decoded.done(live)).sum()), self.lockstep, device) or \
                    until is not None and waiting == N and until(decoded.finished, decoded.count):
                break
            attn = torch.cat([attn, torch.ones((len(live), 1), dtype=attn.dtype, device=device)], dim=1)
            logits = self._next_logits(tok, attn, pos, cached)
            decoded.positions += len(live)
            pos = pos + 1
        decoded.width = longest(decoded.count, self.lockstep)
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


def _or_abandoned(until: Callable | None, abandoned: threading.Event) -> Callable:
    """`until`, or the request abandoned (generate's arguments)."""
    return lambda stopped, count: abandoned.is_set() or until is not None and until(stopped, count)


def _draws(uniforms: torch.Tensor | None, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor | None:
    """The uniforms (n,) that completions `rows` (n,) draw their next tokens with: the count[row]-th
    of each one's stream (a completion kept only for the collective forward draws its last again)."""
    if uniforms is None:
        return None
    return uniforms[rows, count[rows].clamp(max=uniforms.shape[1] - 1)]


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


def _random_streams(params: SamplingParams, seeds: Sequence[int] | None, N: int, device: torch.device,
                    offsets: Sequence[int] | None = None) -> torch.Tensor | None:
    """(N, max_tokens): completion i's uniforms, from its own generator seeded by seeds[i], from the
    offsets[i]-th on (0: the first); None when greedy (no randomness, no seeds needed)."""
    if not params.temperature > 0:
        return None
    if seeds is None or len(seeds) != N:
        raise ValueError(f"sampling needs one seed per completion ({N}), got {seeds if seeds is None else len(seeds)}")
    offsets = [0] * N if offsets is None else [int(o) for o in offsets]
    return torch.stack([
        torch.rand(o + params.max_tokens, generator=torch.Generator().manual_seed(int(s)))[o:]
        for s, o in zip(seeds, offsets)
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


# rollout.decoder=auto: the decoder measured faster on each device (docs/speed-and-memory.md),
# {on CUDA: decoder}. "dynamic" grows the key/value cache token by token (TransformersEngine._decode);
# "static" decodes at a fixed shape over a cache sized once (StaticDecoder).
DEFAULT_DECODER = {False: "dynamic", True: "static"}
SLOTS_NOT_STATIC = ("the static decoder's cache is sized once for the rows it starts with, so no completion can join "
                    "later; use rollout.decoder=dynamic (auto picks it when decode_slots is set)")


