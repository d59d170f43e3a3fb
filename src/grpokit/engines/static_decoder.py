"""The static decoder (rollout.decoder=static): decoding at a fixed shape over a key/value cache
sized once, one CUDA graph per shape on a GPU (StaticDecoder), and the models it cannot decode
(static_decoding_problem)."""

from __future__ import annotations

import threading
import warnings

import torch
from transformers import DynamicCache

from grpokit.engines.batch import SamplingParams
from grpokit.engines.decoding import Decoded, all_ended, sample_next
from grpokit.models.architecture import attention_form, cache_inputs
from grpokit.runtime import distributed

# The static decoder asks whether every completion has ended once per this many tokens (a host
# synchronisation each time; a GPU's kernels run ahead of the host in between).
CHECK_EVERY = 8


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
                 uniforms: torch.Tensor | None, abandoned: threading.Event | None = None):
        """The engine's model, pad id, EOS ids and lockstep (TransformersEngine); prefilled: the
        prompts' cache, one row per completion (N); prompt_mask (N, Lp); next_pos (N,): each
        completion's first position; uniforms (N, max_tokens) or None (greedy); `abandoned`, once
        set, ends the decoding at the next look (TransformersEngine.generate)."""
        from transformers import StaticCache

        self.model, self.pad_id, self.lockstep, self.params, self.uniforms = model, pad_id, lockstep, params, uniforms
        self.abandoned = abandoned
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
        self.recorded = self.OUTPUTS
        if params.top_logprobs:  # (N, T, k) each: the alternatives an agent's request asked for
            self.top_logps = torch.full((N, T, params.top_logprobs), float("-inf"), device=device)
            self.top_ids = torch.zeros((N, T, params.top_logprobs), dtype=torch.long, device=device)
            self.recorded += ("top_logps", "top_ids")
        self.logits = None  # (N, V) the logits the next token is sampled from (a graph's output)
        # Once rows are dropped (_compact): the original index of each row still decoded (n,), and
        # the (N, ...) outputs of every completion, the dropped ones' final.
        self.rows = torch.arange(N, device=device)
        self.whole = None

    def run(self, logits: torch.Tensor) -> Decoded:
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
                if all_ended(int((~self.finished).sum()), self.lockstep, self.finished.device) or \
                        self.abandoned is not None and self.abandoned.is_set():
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
            self.whole = {name: getattr(self, name) for name in self.recorded}  # every row, as written so far
        else:
            for name in self.recorded:
                self.whole[name].index_copy_(0, self.rows, getattr(self, name))
        keep = (~self.finished).nonzero().view(-1)  # (n',)
        self.rows = self.rows[keep]
        for name in ("ids", "positions", "seen", "logits", *self.recorded):
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
        tok, lp, ent, top = sample_next(self.logits, self.params, uniforms)
        alive = ~self.finished
        if top is not None:
            self.top_logps.index_copy_(1, self.step, top[0][:, None])
            self.top_ids.index_copy_(1, self.step, top[1][:, None])
        tok = torch.where(alive, tok, self.pad_id)
        self.tokens.index_copy_(1, self.step, tok[:, None])
        self.logps.index_copy_(1, self.step, torch.where(alive, lp, 0.0)[:, None])
        self.entropies.index_copy_(1, self.step, torch.where(alive, ent, 0.0)[:, None])
        self.alive.index_copy_(1, self.step, alive[:, None])
        self.finished.logical_or_(torch.isin(tok, self.eos_ids))
        return tok

    def _forward(self, tok: torch.Tensor) -> torch.Tensor:
        """The tokens just sampled (N,) through the model at their slot; the logits (N, V) after them."""
        self.ids.copy_(tok[:, None])
        self.seen.index_fill_(3, self.slot, True)
        out = self.model(input_ids=self.ids, attention_mask=attention_form(self.model, self.seen),
                         position_ids=self.positions, cache_position=self.slot, **self.cached)
        self.positions.add_(1)
        self.slot.add_(1)
        self.step.add_(1)
        return out.logits[:, -1]

    def _outputs(self) -> Decoded:
        """The decoded completions, cut after the last token any of them sampled (every process's,
        with sharded weights: they decode alike)."""
        if self.whole is not None:  # rows were dropped: the last ones' outputs join the others'
            for name in self.recorded:
                self.whole[name].index_copy_(0, self.rows, getattr(self, name))
            for name in self.recorded:
                setattr(self, name, self.whole[name])
        last = int(self.alive.any(0).nonzero().max())  # token 0 is always sampled
        if self.lockstep:
            last = int(distributed.all_reduce(torch.tensor(last), "max"))
        N, T = self.tokens.shape
        decoded = Decoded(N, T, self.pad_id, self.eos_ids, self.finished.device)
        decoded.tokens, decoded.logps, decoded.entropies, decoded.masks = self.tokens, self.logps, self.entropies, self.alive
        decoded.finished, decoded.width, decoded.positions = self.finished, last + 1, self.positions_run
        if self.params.top_logprobs:
            decoded.top_logps, decoded.top_ids = self.top_logps, self.top_ids
        return decoded
