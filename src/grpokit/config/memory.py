"""The peak memory of one training process, estimated from the model's config and the settings
before any weight loads (`grpokit config --check`, the start-up line), and whether a run fits a
memory size (`--memory 24GB` or a GPU's name) with the settings that would make it fit.

While its weights load, a process reads the checkpoint (in the dtype it was saved in) and, where
the model is in another dtype or quantized, builds it beside (on the CPU, where the file's pages are
the process's memory). Then it holds, all along: its weights (4-bit or int8 codes with their scales for a quantized
base's linear layers), a reference copy (a KL term without LoRA), a teacher, the trained weights'
gradients and AdamW's two moments, and on the CPU the process itself (Python, torch,
transformers). Then, one after the other: decoding (the key/value cache of every completion it
samples at its longest, and a step's logits) and the training pass (the activations autograd keeps
for one micro-batch at its longest, and the logits with their gradient, for every token at once or
for a chunk of train.logprob_chunk_size; both times WORKSPACE, what the backward adds; a quantized
base's weights dequantized for its matmuls, `_dequantized`). The peak is
the first sum plus the larger of the other two. Sharded weights (FSDP2, ZeRO-3) divide the first group by the processes.

The activations are what autograd saves per token in one decoder layer, measured by running the
model built on the meta device (no memory, no compute) with a hook on the saved tensors, its
attention replaced by one that keeps what a fused kernel keeps (queries, keys, values, output and
one float32 per head and token); a model whose forward cannot run on the meta device (a mixture of
experts routes on values) gets the formula of a dense layer, 10 x hidden + 4 x intermediate values
per token. Prompts are counted at data.max_prompt_length, else at the longest the data holds (the
start-up reads it), else at PROMPT_TOKENS.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass

import torch

GB = 1e9
PROMPT_TOKENS = 256  # a prompt's length where data.max_prompt_length does not say
# The training pass's peak over what autograd keeps, by device: on the CPU the process's resident
# memory, which keeps freed pages for reuse, measured 1.1x (full training) to 1.7x (LoRA) of it
# (benchmarks/memory.py); on a GPU what torch allocates (its caching allocator reserves more).
WORKSPACE = {"cpu": 1.4, "cuda": 1.0}
RUNTIME_CPU = 0.45 * GB  # the process itself on the CPU: Python, torch, transformers, the data (benchmarks/memory.py)
BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
# Bytes per value of a quantized linear layer's weight: NF4 / FP4 codes (4 bits) with one 8-bit scale
# per 64 values and, doubly quantized, one float32 per 256 scales; int8 codes with a float32 per row
# (counted per value at the smallest layer bitsandbytes is used on).
QUANTIZED_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "fp4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0 + 4 / 512}
# GPUs by name: their memory.
GPUS = {"H200": 141e9, "H100": 80e9, "A100-80GB": 80e9, "A100": 40e9, "A100-40GB": 40e9, "L40S": 48e9, "A6000": 48e9,
        "L4": 24e9, "A10": 24e9, "A10G": 24e9, "RTX4090": 24e9, "RTX3090": 24e9, "T4": 16e9, "V100": 16e9}


@dataclass(frozen=True)
class Shape:
    """What the estimate reads of a model, from its config (parameters counted on the meta device)."""

    parameters: int  # every weight, a tied one once
    linear: int  # the weights of the linear layers a quantized base quantizes (all but the output layer)
    adapters: int  # LoRA's adapters' values at rank 1 on model.lora_target_modules (x rank)
    layers: int
    hidden: int
    kv_per_token: int  # keys and values per token per layer (2 x key/value heads x head size)
    vocab: int


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    phase: str  # "held" all along, or "decoding" / "training", one after the other

    def __str__(self):
        return f"{self.name} {self.bytes / GB:.2f}"


@dataclass(frozen=True)
class Estimate:
    terms: tuple[Term, ...]
    assumed: tuple[str, ...]  # what the estimate had to assume

    def phase(self, name: str) -> float:
        return sum(t.bytes for t in self.terms if t.phase == name)

    @property
    def loading(self) -> float:
        """The peak while the weights load: the process, and the loading terms."""
        return sum(t.bytes for t in self.terms if t.name == "process") + self.phase("loading")

    @property
    def peak(self) -> float:
        return max(self.loading, self.phase("held") + max(self.phase("decoding"), self.phase("training")))

    def line(self) -> str:
        assumed = f" ({'; '.join(self.assumed)})" if self.assumed else ""
        start = f"peak memory per process: {self.peak / GB:.1f} GB (estimated), of which "
        if self.loading > self.phase("held") + max(self.phase("decoding"), self.phase("training")):
            parts = [t for t in self.terms if (t.phase == "loading" or t.name == "process") and t.bytes]
            return f"{start}{', '.join(map(str, parts))} while loading{assumed}"
        held = [t for t in self.terms if t.phase == "held" and t.bytes]
        phase = "training" if self.phase("training") >= self.phase("decoding") else "decoding"
        busy = [t for t in self.terms if t.phase == phase and t.bytes]
        return f"{start}{', '.join(map(str, held))} held; {', '.join(map(str, busy))} while {phase}{assumed}"


def estimate(config, model_config, world_size: int = 1, sharded: str | None = None, device: str = "cpu",
             prompt_tokens: int | None = None) -> Estimate:
    """The peak of one of `world_size` processes training `config` on the model of `model_config`
    (a transformers config); `sharded`: the launch's FSDP / DeepSpeed (ZeRO stage 3 assumed), None
    for whole copies; `device`: "cpu" counts the process itself, "cuda" does not (the CUDA context
    lies outside what torch allocates); `prompt_tokens`: the longest prompt where the data was read
    (data.max_prompt_length, or PROMPT_TOKENS assumed, where it was not)."""
    m, r = config.model, config.rollout
    shape = model_shape(model_config, m.lora_target_modules)
    b = BYTES[m.dtype]
    adapters = shape.adapters * m.lora_rank
    if m.quantization != "none":
        weights = shape.linear * QUANTIZED_BYTES[m.quantization] + (shape.parameters - shape.linear) * b
    else:
        weights = shape.parameters * b
    trained = adapters if m.lora_rank else shape.parameters
    trained_b = 4 if m.lora_rank else b  # (peft keeps adapters in float32)
    split = world_size if sharded else 1
    prompt = prompt_tokens or config.data.max_prompt_length or PROMPT_TOKENS
    assumed = () if prompt_tokens or config.data.max_prompt_length else (
        f"prompts of {PROMPT_TOKENS} tokens assumed where data.max_prompt_length is null",)
    sequence = prompt + r.max_completion_length

    # Decoding: every completion this process samples at once (or decode_slots of them), at its longest.
    rows = min(config.completions_per_step // world_size, r.decode_slots or config.completions_per_step)
    cache = rows * sequence * shape.layers * shape.kv_per_token * b
    decode_logits = rows * shape.vocab * 4 * 2

    activations, logits, chunk = _training_pass(config, model_config, shape, world_size, device, prompt)

    # Loading: the checkpoint's tensors read (in the dtype it was saved in) while the model is built
    # from them in another dtype or quantized; in its own dtype the model takes them as they are read.
    saved_as = str(getattr(model_config, "dtype", None) or "float32")
    file = shape.parameters * BYTES.get(saved_as.removeprefix("torch."), 4)
    converted = m.quantization != "none" or BYTES.get(saved_as.removeprefix("torch."), 4) != b

    terms = [
        Term("process", RUNTIME_CPU if device == "cpu" else 0, "held"),
        Term("checkpoint read", file / split if converted and device == "cpu" else 0, "loading"),
        Term("model built", weights / split if converted and device == "cpu" else 0, "loading"),
        Term("weights" if m.quantization == "none" else f"weights ({m.quantization})", weights / split, "held"),
        Term("reference", weights / split if config.algorithm.beta > 0 and not m.lora_rank else 0, "held"),
        Term("teacher", _teacher_bytes(config, b), "held"),
        Term("gradients", trained * trained_b / split, "held"),
        Term("AdamW state", 2 * trained * trained_b / split, "held"),
        Term("key/value cache", cache, "decoding"),
        Term("logits", decode_logits, "decoding"),
        Term("activations" + (" (checkpointed)" if m.gradient_checkpointing else ""), WORKSPACE[device] * activations, "training"),
        Term("log-prob logits" + (f" (chunks of {chunk})" if chunk else ""), WORKSPACE[device] * logits, "training"),
        Term("dequantized copies", _dequantized(shape, m.quantization, b, device), "training"),
    ]
    return Estimate(tuple(terms), assumed)


# Copies of a quantized base's linear weights in model.dtype that its training pass leaves in a CPU
# process (`_dequantized`), fitted to benchmarks/memory.py's QLoRA runs (135M shape in float32
# and bfloat16, 1.7B shape in float32).
DEQUANTIZED_COPIES_CPU = 1.75


def _dequantized(shape: Shape, quantization: str, b: int, device: str) -> float:
    """bitsandbytes computes each quantized layer's matmul on a copy of its weight dequantized to
    model.dtype, made anew in the forward and in the backward. On a GPU the caching allocator
    reuses one layer's two; on the CPU, freed between the activations that stay, their pages stay
    with the process (runtime/allocator.py), as DEQUANTIZED_COPIES_CPU copies of every layer's."""
    if quantization == "none":
        return 0.0
    copies = shape.linear * b
    return DEQUANTIZED_COPIES_CPU * copies if device == "cpu" else 2 * copies / shape.layers


def _training_pass(config, model_config, shape: Shape, world_size: int, device: str, prompt: int):
    """(activations, log-prob logits, their chunk or 0) of one micro-batch's pass, in bytes: its
    completions, each group's prompt computed once, but with activation checkpointing (completions
    run whole) and packed (the token budget)."""
    m, r, t = config.model, config.rollout, config.train
    b = BYTES[m.dtype]
    micro = config.micro_batch_size(world_size)
    if t.micro_batch_tokens:
        tokens = t.micro_batch_tokens
    elif m.gradient_checkpointing:
        tokens = micro * (prompt + r.max_completion_length)
    else:
        tokens = math.ceil(micro / r.num_generations) * prompt + micro * r.max_completion_length
    completion_tokens = min(tokens, micro * r.max_completion_length)
    saved = _saved_per_token(model_config, m.dtype)
    if m.gradient_checkpointing:  # each layer's input, and one layer's whole activations while it is recomputed
        activations = tokens * (shape.layers * shape.hidden * b + saved)
    else:
        activations = tokens * shape.layers * saved
    chunk = t.logprob_chunk_size if t.logprob_chunk_size is not None else (1024 if device == "cuda" else 0)
    # The logits in float32 (kept for the backward; a bfloat16 model's first in its dtype) and their
    # gradient, one tensor of their size (models/logprobs.py _TokenLogprobs).
    logits = min(completion_tokens, chunk or completion_tokens) * shape.vocab * (8 + (b if b < 4 else 0))
    return activations, logits, chunk


def _teacher_bytes(config, b: int) -> float:
    if config.distill.teacher is None or config.distill.teacher.startswith(("http://", "https://")):
        return 0
    from grpokit.models.loading import check_source, model_config, naming

    with naming("distill.teacher"):  # a folder that is missing or cannot be read, named as the teacher's
        check_source(config.distill.teacher)
        return _counts(model_config(config.distill.teacher))[0] * b


def refused(estimated: Estimate, memory: float) -> bool:
    """Whether a run of this estimate cannot fit `memory`: what it holds all along (counted exactly)
    and its larger phase at 80% (the estimate's 20% margin) exceed it."""
    return estimated.phase("held") + 0.8 * max(estimated.phase("decoding"), estimated.phase("training")) > memory


def parse_memory(text: str) -> tuple[float, str | None]:
    """`--memory`: a size ("24GB", "80 GiB", "512MB"; the device not said) or a GPU's name ("H100",
    "A100-80GB": its memory, on "cuda"). (bytes, device or None)"""
    gpu = {name.lower().replace("-", ""): size for name, size in GPUS.items()}.get(text.lower().replace("-", "").replace(" ", ""))
    if gpu:
        return gpu, "cuda"
    found = re.fullmatch(r"\s*([\d.]+)\s*(GB|GiB|MB|MiB|TB)\s*", text, re.IGNORECASE)
    if not found:
        raise ValueError(f"--memory {text}: give a size (24GB, 80GiB, 512MB) or a GPU ({', '.join(GPUS)})")
    unit = {"gb": 1e9, "gib": 2**30, "mb": 1e6, "mib": 2**20, "tb": 1e12}[found.group(2).lower()]
    return float(found.group(1)) * unit, None


# What a user can change to cut the peak, tried in this order, each kept once it helps.
REMEDIES = (
    ("train.logprob_chunk_size", 1024, lambda c: c.train.logprob_chunk_size in (None, 0)),
    ("model.gradient_checkpointing", True, lambda c: not c.model.gradient_checkpointing),
    ("train.micro_batch_size", 1, lambda c: c.train.micro_batch_size != 1),
    ("model.lora_rank", 16, lambda c: not c.model.lora_rank),
    ("model.quantization", "nf4", lambda c: c.model.quantization == "none" and c.model.dtype != "float64"),
    ("model.dtype", "bfloat16", lambda c: c.model.dtype == "float32"),
)


def fitting(config, model_config, memory: float, **launch) -> tuple[bool, list[str]]:
    """Whether the run fits `memory` per process (`launch`: estimate's other arguments); if not, the
    settings (in REMEDIES' order, each kept where it lowers the peak) that bring it under, with the
    peak they give, or none where they do not."""
    if estimate(config, model_config, **launch).peak <= memory:
        return True, []
    def peak_with(changes):
        attempt = copy.deepcopy(config)
        for key, value in changes:
            section, name = key.split(".")
            setattr(getattr(attempt, section), name, value)
        return estimate(attempt, model_config, **launch).peak

    changes: list = []
    for key, value, applies in REMEDIES:
        if key == "model.quantization" and launch.get("sharded"):
            continue  # (a quantized base is not sharded: config/checks.py)
        if applies(config) and peak_with([*changes, (key, value)]) < peak_with(changes):
            changes.append((key, value))
            if peak_with(changes) <= memory:
                break
    else:
        return False, []
    for change in list(changes[:-1]):  # those the later ones make unneeded
        if peak_with([c for c in changes if c != change]) <= memory:
            changes.remove(change)
    shown = [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in changes]
    return False, [*shown, f"(estimated peak then {peak_with(changes) / GB:.1f} GB)"]


def _cached(function):
    """`function` of a transformers config, computed once per config (they are not hashable: by their JSON)."""
    results: dict = {}

    @functools.wraps(function)
    def cached(model_config, *args):
        key = (model_config.to_json_string(), args)
        if key not in results:
            results[key] = function(model_config, *args)
        return results[key]

    return cached


@_cached
def _counts(model_config) -> tuple[int, int, object]:
    """(parameters, quantizable linear weights, the model on the meta device) of `model_config`."""
    model = _on_meta(model_config)
    parameters = sum(p.numel() for p in model.parameters())  # (a tied weight is one parameter)
    head = model.get_output_embeddings()
    linear = sum(module.weight.numel() for module in model.modules()
                 if isinstance(module, torch.nn.Linear) and module is not head)
    return parameters, linear, model


def _on_meta(model_config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kind = AutoModelForImageTextToText if getattr(model_config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):  # (a copy: the attention set on it must not reach the model that trains)
        return kind.from_config(copy.deepcopy(model_config))


def model_shape(model_config, lora_targets: str = "all-linear") -> Shape:
    from grpokit.models.loading import lora_modules

    parameters, linear, model = _counts(model_config)
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    targets = lora_modules(model, lora_targets)  # full names, or the names given (peft matches them as suffixes)
    adapters = sum(module.in_features + module.out_features for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))
    return Shape(parameters, linear, adapters, text.num_hidden_layers, text.hidden_size, 2 * kv_heads * head_dim,
                 text.vocab_size)


class _KeptByAFusedKernel(torch.autograd.Function):
    """An attention whose backward keeps what a fused kernel's does: q, k, v, the output, and the
    log-sum-exp (a float32 per head and query)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the estimate only counts what is saved
        raise NotImplementedError


def _fused_attention(module, query, key, value, attention_mask, **kwargs):  # (B, heads, T, D) each
    return _KeptByAFusedKernel.apply(query, key, value).transpose(1, 2), None


@_cached
def _saved_per_token(model_config, dtype: str, tokens: int = 32) -> float:
    """Bytes autograd keeps per token in one decoder layer of `model_config` in `dtype`, measured on the
    meta device (the formula of a dense layer when the forward cannot run there)."""
    from transformers import AttentionInterface

    text = model_config.get_text_config()
    AttentionInterface.register("grpokit_memory", _fused_attention)
    try:
        model = _on_meta(model_config).to(getattr(torch, dtype)).train()
        model.set_attn_implementation("grpokit_memory")
        params = {id(p) for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(tensor):
            base = tensor if tensor._base is None else tensor._base
            if id(base) not in params:
                kept[id(base)] = base.numel() * base.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.get_decoder()(input_ids=torch.zeros(1, tokens, dtype=torch.long, device="meta"))
        return sum(kept.values()) / tokens / text.num_hidden_layers
    except Exception:  # noqa: BLE001 - any op the meta device cannot run: the formula
        intermediate = (getattr(text, "moe_intermediate_size", None) or text.intermediate_size) * \
            max(1, getattr(text, "num_experts_per_tok", 1) or 1)
        return (10 * text.hidden_size + 4 * intermediate) * BYTES[dtype]


def fits_line(config, model_config, memory: float, **launch) -> str:
    ok, fixes = fitting(config, model_config, memory, **launch)
    peak = estimate(config, model_config, **launch).peak
    if ok:
        return f"fits in {memory / GB:.1f} GB per process (estimated peak {peak / GB:.1f} GB)"
    if fixes:
        return (f"does not fit in {memory / GB:.1f} GB per process (estimated peak {peak / GB:.1f} GB); it would with "
                + " ".join(fixes))
    return (f"does not fit in {memory / GB:.1f} GB per process (estimated peak {peak / GB:.1f} GB), nor with any of "
            f"{', '.join(key for key, _, _ in REMEDIES)}: a smaller model, shorter sequences or more processes with "
            "sharded weights")

