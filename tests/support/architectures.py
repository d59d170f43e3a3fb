"""Tiny random builds of the architecture families people train, made offline from transformers'
own config classes, each with what sets it apart switched on: a short sliding window beside global
layers, attention sinks, q/k norms, layers without RoPE, experts with top-k routing, linear-attention
(Gated DeltaNet) or convolution layers. Shared by the architecture matrix (tests/models/
test_architectures.py) and the command that writes docs/models.md (benchmarks/architectures.py)."""

from __future__ import annotations

import torch

from grpokit.models.loading import fit_for_passes

WINDOW = 8  # tokens: shorter than a test's sequences, so a pass that ignores the window is caught

# hidden 32, 4 layers, 4 heads of 8 (2 key/value heads): small enough that every pass of every
# family runs in float64 in seconds.
_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_SLIDING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# family -> (config class name, its settings beyond _BASE, what it brings)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "llama": ("LlamaConfig", {}, "dense, RoPE"),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
              "sliding-window layers above max_window_layers"),
    "qwen3": ("Qwen3Config", {}, "q/k norms"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, decoder_sparse_step=1, norm_topk_prob=True), "experts, top-k routing"),
    "qwen3_5": ("Qwen3_5TextConfig", dict(layer_types=["linear_attention", "full_attention"] * 2,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                          linear_value_head_dim=8, linear_conv_kernel_dim=4),
                "Gated DeltaNet linear-attention layers beside full attention"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(layer_types=["linear_attention", "full_attention"] * 2,
                                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=8, linear_value_head_dim=8,
                                                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=16, shared_expert_intermediate_size=16),
                    "linear attention, and experts with a shared expert"),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=_SLIDING),
               "sliding-window layers beside global ones"),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), "a sliding window on every layer"),
    "olmo3": ("Olmo3Config", dict(sliding_window=WINDOW, layer_types=_SLIDING), "sliding-window layers, q/k norms"),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 1, 1, 0]), "a layer without RoPE"),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW), "fused projections, a sliding window on every layer"),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=WINDOW, layer_types=_SLIDING, num_local_experts=4,
                                     num_experts_per_tok=2, intermediate_size=16),
                "attention sinks, sliding-window layers, experts"),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                             moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                                             topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                             qk_rope_head_dim=8, v_head_dim=8, head_dim=8),
                    "latent attention, shared and routed experts, a dense first layer"),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                                block_ff_dim=64, block_auto_adjust_ff_dim=False),
             "short convolution layers beside attention"),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0,
                                      attention_multiplier=0.2), "scaled logits and residuals"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
                "experts, a sliding window on every layer"),
}


def build(family: str, vocab_size: int = 96, dtype: torch.dtype = torch.float64, seed: int = 0, layers: int = 4, **ids):
    """The tiny random causal LM of `family` (FAMILIES), in `dtype`, from `seed`, as grpokit loads
    it (a float64 model's experts on the eager loop); `ids`: the tokenizer's bos/eos/pad token ids
    where a run needs them (default 1, 2 and 0); `layers`: the first that many of its layers (2: one
    of each kind, the layer kinds alternating)."""
    import transformers

    name, settings, _ = FAMILIES[family]
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **ids}
    settings = {**settings, "num_hidden_layers": layers}
    for key in ("layer_types", "no_rope_layers"):
        if key in settings:
            settings[key] = settings[key][:layers]
    if "max_window_layers" in settings:
        settings["max_window_layers"] = layers // 2
    config = getattr(transformers, name)(**{**_BASE, **settings, "vocab_size": vocab_size, **ids})
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    fit_for_passes(model)  # as grpokit's loading does
    return model.eval()


def with_tokenizer(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The tiny random model of `family` over the bundled SmolLM2 tokenizer (its vocabulary, ids and
    ChatML template), and that tokenizer: what a training run of the family takes."""
    from grpokit.models.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny-random")
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    model = build(family, len(tokenizer), dtype, seed, **ids)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
