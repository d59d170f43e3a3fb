"""What the log-prob passes and the decoders need to know of a model's layers, and do with them.

A decoder layer is of one kind (transformers' `layer_types`): full attention, attention through a
sliding window of its last `window` tokens, or a layer that carries a state from token to token
(Gated DeltaNet linear attention, a short convolution: Qwen3.5, LFM2). Two things follow:

- **Masks.** A pass that hands the model a 4D attention mask (packed rows, an agent's rows of
  several sequences) bypasses the model's own mask making, so it must give each kind of layer
  the mask that layer sees in a plain forward of each sequence alone: the window on sliding
  layers, measured in each sequence's own positions (`masks`). A layer with a state takes no such
  mask at all: its state would flow from one sequence of a row into the next, so those passes are
  not chosen for such a model, and refused when asked for (`mask_problem`).
- **The cache.** A layer with a state keeps it in the cache beside the attention layers' keys and
  values (transformers' `DynamicCache(config=...)`); the passes that share a prompt's cache among
  its completions, and the decoder that drops and adds completions, select and append rows of
  every layer's entries, states included (`select_rows`, `rows`, `append_rows`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache as _once

import torch
from transformers import DynamicCache

from grpokit.runtime.errors import ConfigError

# The kinds of layer whose attention a 4D mask of grpokit's decides; the kinds that carry a state
# from token to token (linear attention, convolution, Mamba), which no mask stops at a sequence's
# end; any other kind (chunked attention masks by absolute position) takes no mask of grpokit's either.
ATTENTION = ("full_attention", "sliding_attention")
STATEFUL = ("linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding")


@dataclass(frozen=True)
class Layers:
    """A model's decoder layers as the passes see them: each one's kind, and the window of its
    sliding ones."""

    kinds: tuple[str, ...]  # per decoder layer, as the model's config names it (the keys of its per-kind masks)
    windows: tuple[int | None, ...]  # per decoder layer: its sliding window in tokens, None for any other kind

    @classmethod
    def of(cls, config) -> Layers:
        """The layers of a model of (transformers) `config`, or of a vision-language model's text part."""
        text = config.get_text_config(decoder=True)
        try:  # transformers' own reading, per layer (from sliding_window where layer_types is not given)
            from transformers.cache_utils import get_layer_types_and_kwargs

            inferred, kwargs = get_layer_types_and_kwargs(text)
        except ImportError:  # a transformers 5 before it: one window for the sliding layers
            window = getattr(text, "sliding_window", None)
            inferred = ["sliding_attention" if window else "full_attention"] * text.num_hidden_layers
            kwargs = [{"sliding_window": window}] * text.num_hidden_layers
        kinds = tuple(getattr(text, "layer_types", None) or inferred)
        windows = tuple(k.get("sliding_window") if kind == "sliding_attention" else None
                        for kind, k in zip(kinds, kwargs))
        return cls(kinds, windows)

    @property
    def stateful(self) -> bool:
        """Whether some layer carries a state from token to token (linear attention, convolution)."""
        return any(kind in STATEFUL for kind in self.kinds)

    @property
    def window(self) -> int | None:
        """The sliding layers' window (one for all: mask_problem says when it is not), or None."""
        return next((w for w in self.windows if w is not None), None)

    def mask_problem(self) -> str | None:
        """Why no 4D attention mask gives every layer of this model the mask it sees in a plain
        forward (packed rows, an agent's rows of several sequences), or None."""
        stateful = sorted({kind for kind in self.kinds if kind in STATEFUL})
        if stateful:
            return (f"its {', '.join(stateful)} layers carry a state from token to token, which would flow from one "
                    "sequence of a row into the next")
        other = sorted({kind for kind in self.kinds if kind not in ATTENTION})
        if other:
            return f"its {', '.join(other)} layers take no attention mask of grpokit's (only full and sliding attention)"
        if len({w for w in self.windows if w is not None}) > 1:
            return f"its sliding layers have windows of different sizes ({sorted({w for w in self.windows if w})})"
        return None


def layers_of(model) -> Layers:
    """Layers.of the config of the first transformers model inside `model` (under peft's, FSDP's
    or a test's wrappers)."""
    return Layers.of(_inner(model).config)


def _inner(model):
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


def masks(model, allowed: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor):
    """The `attention_mask` that gives each layer of `model` the 4D mask `allowed` (B, 1, Q, K),
    True where a query sees a key: full-attention layers `allowed` itself; sliding layers also only
    the keys less than the window before the query, in the sequences' own positions q_positions
    (B, Q) and k_positions (B, K) (a query sees keys of its own sequence only, so their positions
    measure the distance). One mask where every layer takes the same, else one per kind (as
    transformers' models take a mapping of layer kind to mask), each in the form attention_form
    gives. ValueError: a model whose layers take no such mask (Layers.mask_problem)."""
    layers = layers_of(model)
    problem = layers.mask_problem()
    if problem:
        raise ValueError(f"no attention mask of grpokit's is exact for this model: {problem}")
    per_kind = {}
    for kind in dict.fromkeys(layers.kinds):
        mask = allowed
        if kind == "sliding_attention":
            distance = q_positions[:, None, :, None] - k_positions[:, None, None, :]  # (B, 1, Q, K)
            mask = allowed & (distance < layers.window)
        per_kind[kind] = attention_form(model, mask)
    return next(iter(per_kind.values())) if len(per_kind) == 1 else per_kind


def attention_form(model, allowed: torch.Tensor) -> torch.Tensor:
    """A 4D attention mask (B, 1, Q, K), True where a query sees a key, in the form the model's
    attention takes it as given: boolean (sdpa), or additive (eager)."""
    implementation = getattr(model.config, "_attn_implementation", "sdpa")
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    if implementation != "sdpa":  # only the data tells: an agent that rewrote its history, at that step
        raise ConfigError(f"attention implementation {implementation!r} does not take the 4D attention mask that "
                          "rows of several sequences (an agent's) and the static decoder need: use sdpa or eager")
    return allowed


# ---------------------------------------------------------------------------------------------- the cache


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`'s passes: plain growing key/value layers for a model of attention
    layers only, and transformers' cache made from the model's config where some layer keeps a state,
    its attention layers plain growing ones too. A sliding layer's keys are all kept (the mask gives
    it its window), so that every attention layer's rows are as wide, as the decoder's joining and
    dropping of rows takes them."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    config = _inner(model).config
    if not Layers.of(config).stateful:
        return DynamicCache()
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
    return cache


def cache_inputs(model: torch.nn.Module, cache: DynamicCache) -> dict:
    """The keyword arguments that hand `model` (or its decoder) a key/value cache: `cache=` where its
    forward takes one (transformers' name from 5.2x on, which warns at the older name), else
    `past_key_values=`. Read from the first transformers model inside (under peft's or FSDP's
    wrappers), with `use_cache`."""
    return {_cache_keyword(type(_inner(model))): cache, "use_cache": True}


@_once
def _cache_keyword(model_class: type) -> str:
    """Read once per model class: every generation and log-prob pass asks."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _states(layer) -> list[dict]:
    """A layer's per-row state tensors other than keys and values: a linear-attention or
    convolution layer's conv and recurrent states (dicts by state index; None until made)."""
    return [layer.conv_states, layer.recurrent_states] if hasattr(layer, "conv_states") else []


def _has_keys(layer) -> bool:
    return getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep rows `index` (n,) of every layer's entries (keys and values, states), in that order.
    index_select, not Tensor[index] (what the cache's own batch_select_indices does): differentiable,
    and its backward sums the rows that share a source in a fixed order, where indexing's does not
    on several CPU threads, so a run is bit for bit repeatable (and resumable)."""
    for layer in cache.layers:
        if _has_keys(layer):
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        for states in _states(layer):
            for i, state in states.items():
                if state is not None:
                    states[i] = state.index_select(0, index)


def rows(cache: DynamicCache) -> list:
    """Every layer's entries as they are now (P rows each), for append_rows to take rows of later."""
    return [((layer.keys, layer.values) if _has_keys(layer) else None, [dict(s) for s in _states(layer)])
            for layer in cache.layers]


def append_rows(cache: DynamicCache, attn: torch.Tensor, saved: list, mask: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Append rows p (k,) of `saved` (rows(): the prefilled prompts, with their masks (k, Lp)) to the
    batch in `cache` and its attention mask `attn` (n, L): keys and values padded with zeros on the
    left to the longer of the two (masked there), states as they are. Returns the new mask."""
    for layer, (keys_values, states) in zip(cache.layers, saved):
        if keys_values is not None:
            keys, values = keys_values
            width = max(layer.keys.shape[-2], keys.shape[-2])
            layer.keys = torch.cat([padded_left(layer.keys, width, -2), padded_left(keys[p], width, -2)])
            layer.values = torch.cat([padded_left(layer.values, width, -2), padded_left(values[p], width, -2)])
        for now, then in zip(_states(layer), states):
            for i, state in then.items():
                if state is not None:
                    now[i] = torch.cat([now[i], state[p]])
    width = max(attn.shape[1], mask.shape[1])
    return torch.cat([padded_left(attn, width), padded_left(mask, width)])


def padded_left(x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """`x` with zeros before its entries along `dim`, to `width` of them (`x` itself when it has them)."""
    if x.shape[dim] == width:
        return x
    shape = list(x.shape)
    shape[dim] = width - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim=dim)
