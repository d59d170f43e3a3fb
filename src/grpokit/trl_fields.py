"""Every field of TRL 1.16's GRPOConfig (its own and those it inherits from transformers'
TrainingArguments) and what becomes of it in grpokit (FIELDS), read by `from_trl` (trl_config.py)
and written out as docs/from-trl.md's table; TRL's defaults for the fields that matter, so that a
dict converts without TRL (tests/top/test_from_trl.py checks them against TRL's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from grpokit.algorithm.schedule import SCHEDULES
from grpokit.runtime.errors import ConfigError


class FromTRLError(ConfigError):
    """A TRL setting that would change what is trained, and that grpokit cannot carry over."""


@dataclass(frozen=True)
class Field:
    key: str | None  # the grpokit key, "batch", or None
    default: Any = None  # TRL 1.16's default (for fields whose value is read)
    why: str = ""  # the reason a field is not carried, or a note on how it is
    math: bool = False  # not carried, and changes the math: an error when set
    convert: Callable | None = None  # TRL value -> grpokit value


def _listed(names, last_word: str = "and") -> str:
    """'a, b and c'."""
    *first, last = names
    return f"{', '.join(first)} {last_word} {last}" if first else last


def _scheduler(value):
    value = str(getattr(value, "value", value))
    # transformers' schedules of grpokit's names are grpokit's (schedule.SCHEDULES); its constant with a warm-up is
    # grpokit's constant, which always has one.
    allowed = {**{name: name for name in SCHEDULES}, "constant_with_warmup": "constant"}
    if value not in allowed:
        raise FromTRLError(f"lr_scheduler_type={value!r}: grpokit's train.lr_scheduler is {_listed(SCHEDULES, 'or')} "
                           "(each after train.warmup_steps)")
    return allowed[value]


def _scale(value):
    return {True: "group", False: "none"}.get(value, value)


def _losses() -> dict:
    """grpokit's losses (loss.LOSSES): TRL's of the same names are grpokit's."""
    from grpokit.algorithm.loss import LOSSES

    return LOSSES


def _normalized_by_update_tokens(loss_type: str) -> bool:
    """Whether grpokit's loss `loss_type` divides by the tokens of each optimizer update (dapo, cispo)."""
    from grpokit.algorithm.loss import token_mean

    return getattr(_losses().get(loss_type), "normalize", None) is token_mean


def _loss(value):
    if value == "bnpo":  # carried as dapo, and listed among the settings not carried (from_trl)
        return "dapo"
    if value in _losses():
        return value
    raise FromTRLError(f"loss_type={value!r}: grpokit has {_listed(_losses())} (and bnpo as dapo)")


def _min_p(value):
    return 0.0 if value is None else value


TA = "a setting of how transformers' Trainer runs"
LOGGING = "grpokit logs every step to metrics.jsonl (and the trackers of monitor.*), prints evaluations and alerts"
HUB = "grpokit writes final/ with a model card; upload it with `hf upload <repo> <run>/final`"
DATALOADER = "grpokit draws prompts itself: a stream seeded by train.seed, one epoch after another, resumable anywhere"
DEVICES = "grpokit picks the device itself (CUDA when there is one) and its processes from the launcher (torchrun, accelerate launch)"
SPEED = "a speed or memory setting of TRL's; it does not change what is trained"
EVAL = "grpokit evaluates greedily on held-out prompts at train.eval_every; see data.eval_size and data.eval_path"

FIELDS: dict[str, Field] = {
    # -------- the model
    "model_init_kwargs": Field(None, None, "only its dtype is carried (model.dtype); other loading arguments are not"),
    "trust_remote_code": Field(None, False, "grpokit loads models with transformers' own code only"),
    "router_aux_loss_coef": Field("algorithm.router_aux_loss_coef", None,
                                  "null takes the model's own, as TRL's; grpokit's term is per sequence over the "
                                  "update's sequences (TRL's: over each micro-batch's tokens), so micro-batches never "
                                  "change it"),
    "disable_dropout": Field(None, False, "grpokit trains with the model's own dropout (0 in most LLMs)", math=True),
    "cast_lm_head_to_fp32": Field(None, False, "grpokit computes log-probs in model.dtype (float32 on CPU)"),
    "gradient_checkpointing": Field("model.gradient_checkpointing", True, "TRL turns it on unless told not to"),
    "activation_checkpointing": Field("model.gradient_checkpointing", None, "TRL's newer name for gradient_checkpointing"),
    "gradient_checkpointing_kwargs": Field(None, None, "grpokit checkpoints without re-entrant autograd, always"),
    "activation_checkpointing_kwargs": Field(None, None, "grpokit checkpoints without re-entrant autograd, always"),
    "bf16": Field(None, None, "TRL's bf16 is mixed precision over float32 weights; grpokit trains in model.dtype "
                  "(float32, the default, keeps float32 weights; bfloat16 would be pure bf16): set model.dtype yourself"),
    "fp16": Field(None, False, "TRL's fp16 is mixed precision; grpokit trains in model.dtype: set it yourself"),
    "tf32": Field(None, None, SPEED),
    # -------- data
    "shuffle_dataset": Field(None, True, DATALOADER),
    "pad_to_multiple_of": Field(None, None, SPEED),
    "remove_unused_columns": Field(None, False, "grpokit passes every column to the reward functions"),
    "chat_template_kwargs": Field("model.chat_template_kwargs", None, "every rendering of the template gets them, "
                                  "as TRL's prompts do", convert=lambda value: dict(value or {})),
    # -------- generation
    "num_generations": Field("rollout.num_generations", 8),
    "num_generations_eval": Field(None, None, "grpokit evaluates greedily, one completion per prompt (grpokit eval "
                                  "--num-samples k samples k)"),
    "max_completion_length": Field("rollout.max_completion_length", 512),
    "temperature": Field("rollout.temperature", 1.0),
    "top_p": Field("rollout.top_p", 1.0),
    "top_k": Field("rollout.top_k", 0),
    "min_p": Field("rollout.min_p", None, convert=_min_p),
    "repetition_penalty": Field(None, 1.0, "grpokit samples from the policy's own distribution (at rollout.temperature)",
                                math=True),
    "generation_kwargs": Field(None, None, "grpokit's sampling settings are rollout.temperature, top_p, top_k and min_p",
                               math=True),
    "cache_implementation": Field(None, None, SPEED),
    "use_transformers_paged": Field(None, False, SPEED),
    "use_transformers_continuous_batching": Field(None, False, SPEED),
    "transformers_continuous_batching_config": Field(None, None, SPEED),
    "ds3_gather_for_generation": Field(None, True, "grpokit gathers sharded weights for generation, always"),
    "max_tool_calling_iterations": Field("rollout.max_turns", None, "a limit of k tool-calling rounds is k + 1 model "
                                         "turns; TRL's None (no limit) is not carried: grpokit needs a limit"),
    # -------- vLLM
    "use_vllm": Field("rollout.engine", False, "vllm_mode colocate: rollout.engine=vllm; server: rollout.engine=server"),
    "vllm_mode": Field("rollout.engine", "colocate"),
    "vllm_server_base_url": Field("rollout.server_url", None, "a `grpokit serve --engine vllm` server, not `trl vllm-serve`"),
    "vllm_server_host": Field("rollout.server_url", "0.0.0.0"),
    "vllm_server_port": Field("rollout.server_url", 8000),
    "vllm_server_timeout": Field("rollout.server_timeout", 240.0),
    "vllm_gpu_memory_utilization": Field("rollout.vllm_gpu_memory_utilization", 0.3),
    "vllm_enable_sleep_mode": Field("rollout.vllm_sleep", False),
    "vllm_tensor_parallel_size": Field(None, 1, "grpokit runs vLLM on one GPU (tensor parallelism is not there yet)"),
    "vllm_model_impl": Field(None, "vllm", "grpokit lets vLLM choose its model implementation"),
    "vllm_group_port": Field(None, 51216, "grpokit's server moves weights over its own HTTP endpoint"),
    "vllm_max_model_length": Field(None, None, "grpokit sizes vLLM's context from the model"),
    "vllm_structured_outputs_regex": Field(None, None, "grpokit does not constrain sampling", math=True),
    "vllm_importance_sampling_correction": Field("rollout.is_correction", True),
    "vllm_importance_sampling_mode": Field("rollout.is_level", "sequence_mask", "token_/sequence_ -> rollout.is_level, "
                                           "_truncate/_mask -> rollout.is_mode"),
    "vllm_importance_sampling_clip_max": Field("rollout.is_cap", 3.0, "None (no upper bound) is an error: grpokit's "
                                               "weight always has one"),
    "vllm_importance_sampling_clip_min": Field("rollout.is_min", None),
    "vllm_importance_sampling_cap": Field("rollout.is_cap", None, "TRL's older name for vllm_importance_sampling_clip_max"),
    "off_policy_mask_threshold": Field(None, None, "grpokit has no off-policy sequence mask (rollout.is_mode=mask bounds "
                                       "the sampling ratio instead)", math=True),
    # -------- the objective
    "beta": Field("algorithm.beta", 0.0),
    "num_iterations": Field("algorithm.num_iterations", 1),
    "epsilon": Field("algorithm.epsilon", 0.2),
    "epsilon_high": Field("algorithm.epsilon_high", None, "with loss_type=cispo, TRL's is the cap itself and grpokit's "
                          "the cap minus 1 (and TRL's cap without it, epsilon, is an error)"),
    "delta": Field("algorithm.delta", None),
    "sapo_temperature_pos": Field("algorithm.sapo_temperature_pos", 1.0),
    "sapo_temperature_neg": Field("algorithm.sapo_temperature_neg", 1.05),
    "vespo_k_pos": Field(None, 2.0, "read only by loss_type=vespo, which grpokit does not have"),
    "vespo_lambda_pos": Field(None, 3.0, "read only by loss_type=vespo, which grpokit does not have"),
    "vespo_k_neg": Field(None, 3.0, "read only by loss_type=vespo, which grpokit does not have"),
    "vespo_lambda_neg": Field(None, 2.0, "read only by loss_type=vespo, which grpokit does not have"),
    "importance_sampling_level": Field("algorithm.importance_sampling_level", "token"),
    "reward_weights": Field(None, None, "grpokit takes each reward function's weight with the function: "
                            "reward_functions=[{'name': f, 'weight': w}, ...]", math=True),
    "multi_objective_aggregation": Field("algorithm.reward_aggregation", "sum_then_normalize"),
    "scale_rewards": Field("algorithm.scale_rewards", "group", convert=_scale),
    "loss_type": Field("algorithm.loss_type", "dapo", "bnpo is carried as dapo, with a note; so is dapo or cispo with "
                       "several updates per generation batch (each update's own tokens normalize it)", convert=_loss),
    "mask_truncated_completions": Field("algorithm.mask_truncated_completions", False),
    "sync_ref_model": Field("algorithm.sync_ref_model", False),
    "ref_model_mixup_alpha": Field("algorithm.ref_model_mixup_alpha", 0.6),
    "ref_model_sync_steps": Field("algorithm.ref_model_sync_steps", 512),
    "top_entropy_quantile": Field("algorithm.top_entropy_quantile", 1.0, "below 1, listed: grpokit picks the tokens "
                                  "once per update from the sampler's entropies, TRL per micro-batch from the "
                                  "policy's"),
    "entropy_coef": Field("algorithm.entropy_coef", 0.0, "per token, normalized as the rest of the loss"),
    "use_adaptive_entropy": Field(None, False, "grpokit's entropy bonus has a fixed weight (algorithm.entropy_coef)",
                                  math=True),
    "entropy_coef_min": Field(None, 0.0, "read only with use_adaptive_entropy"),
    "entropy_coef_max": Field(None, 1.0, "read only with use_adaptive_entropy"),
    "entropy_coef_delta": Field(None, 0.005, "read only with use_adaptive_entropy"),
    "entropy_target": Field(None, 0.2, "read only with use_adaptive_entropy"),
    "use_bias_correction_kl": Field(None, True, "TRL's True multiplies the KL term by the policy ratio (with its "
                                    "gradient); grpokit's KL term is not: with beta > 0, True is an error and False "
                                    "is carried"),
    # -------- the optimizer and the schedule
    "learning_rate": Field("train.learning_rate", 1e-6),
    "lr_scheduler_type": Field("train.lr_scheduler", "linear", "transformers' constant ignores warmup_steps: carried "
                               "with train.warmup_steps=0", convert=_scheduler),
    "lr_scheduler_kwargs": Field(None, None, "grpokit's schedules take no arguments", math=True),
    "warmup_steps": Field("train.warmup_steps", 0, "a value below 1 is a share of the updates, as in transformers; "
                          "listed when set: grpokit's warm-up starts at 1/W of the learning rate, transformers' at 0"),
    "weight_decay": Field("train.weight_decay", 0.0),
    "max_grad_norm": Field("train.max_grad_norm", 1.0),
    "adam_beta1": Field(None, 0.9, "grpokit's AdamW uses torch's betas (0.9, 0.999)", math=True),
    "adam_beta2": Field(None, 0.999, "grpokit's AdamW uses torch's betas (0.9, 0.999)", math=True),
    "adam_epsilon": Field(None, 1e-8, "grpokit's AdamW uses torch's eps (1e-8)", math=True),
    "optim": Field(None, "adamw_torch_fused", "grpokit's optimizer is torch's AdamW (fused where it can be): "
                   "adamw_torch and adamw_torch_fused are carried, any other is an error"),
    "optim_args": Field(None, None, "grpokit's optimizer is torch's AdamW (fused where it can be)", math=True),
    "optim_target_modules": Field(None, None, "grpokit's optimizer is torch's AdamW over every trained weight", math=True),
    "seed": Field("train.seed", 42),
    "data_seed": Field(None, None, "train.seed seeds the data order too"),
    "full_determinism": Field(None, False, "grpokit's runs are reproducible from train.seed; cuDNN's deterministic mode "
                              "is not set"),
    # -------- batch and length of training
    "per_device_train_batch_size": Field("batch", 8),
    "gradient_accumulation_steps": Field("batch", 1),
    "generation_batch_size": Field("batch", None),
    "steps_per_generation": Field("batch", None),
    "max_steps": Field("train.max_steps", -1, "TRL counts optimizer updates, grpokit steps of generation: divided by "
                       "updates_per_step x num_iterations; -1 (epochs) needs the dataset's size: set train.max_steps"),
    "num_train_epochs": Field(None, 3.0, "read only when max_steps=-1: grpokit counts steps (train.max_steps)"),
    "average_tokens_across_devices": Field(None, True, "grpokit normalizes over the whole update batch on every "
                                           "process, always"),
    "auto_find_batch_size": Field(None, False, "train.micro_batch_size is a memory knob that never changes the result: "
                                  "set it yourself"),
    # -------- saving, evaluating, resuming
    "output_dir": Field("train.output_dir", None),
    "save_strategy": Field("train.save_every", "steps", "no: train.save_every=0; epoch is not carried"),
    "save_steps": Field("train.save_every", 500, "divided by updates_per_step x num_iterations; below 1, a share of "
                        "max_steps, as in transformers"),
    "save_total_limit": Field("train.keep_checkpoints", None),
    "save_only_model": Field(None, False, "a grpokit checkpoint always holds the optimizer, RNGs and data position "
                             "(exact resume)"),
    "save_on_each_node": Field(None, False, "process 0 alone writes the run folder"),
    "resume_from_checkpoint": Field(None, None, "grpokit resumes from the newest checkpoint in train.output_dir itself"),
    "restore_callback_states_from_checkpoint": Field(None, False, TA),
    "ignore_data_skip": Field(None, False, "the data position is in the checkpoint; resuming never replays data"),
    "enable_jit_checkpoint": Field(None, False, "grpokit saves on SIGTERM / Ctrl-C, always"),
    "eval_strategy": Field("train.eval_every", "no", "no: train.eval_every=0 and data.eval_size=0 (no evaluation, and "
                           "no prompts held out of the training data)"),
    "eval_steps": Field("train.eval_every", None, "divided by updates_per_step x num_iterations; below 1, a share of "
                        "max_steps, as in transformers"),
    "eval_delay": Field(None, 0, EVAL),
    "eval_on_start": Field(None, False, "grpokit evaluates before training, always (data.eval_size=0 turns evaluation off)"),
    "per_device_eval_batch_size": Field(None, 8, EVAL),
    "eval_accumulation_steps": Field(None, None, EVAL),
    "eval_do_concat_batches": Field(None, True, EVAL),
    "eval_use_gather_object": Field(None, False, EVAL),
    "batch_eval_metrics": Field(None, False, EVAL),
    "prediction_loss_only": Field(None, False, EVAL),
    "include_for_metrics": Field(None, [], EVAL),
    "metric_for_best_model": Field(None, None, "grpokit keeps the last model (final/) and the newest checkpoints"),
    "greater_is_better": Field(None, None, "grpokit keeps the last model (final/) and the newest checkpoints"),
    "load_best_model_at_end": Field(None, False, "grpokit keeps the last model (final/) and the newest checkpoints"),
    "do_train": Field(None, False, TA),
    "do_eval": Field(None, False, TA),
    "do_predict": Field(None, False, TA),
    "label_names": Field(None, None, "GRPO has no labels"),
    "label_smoothing_factor": Field(None, 0.0, "GRPO has no labels"),
    "length_column_name": Field(None, "length", "GRPO has no length-grouped sampler"),
    "train_sampling_strategy": Field(None, "random", DATALOADER),
    "neftune_noise_alpha": Field(None, None, "grpokit adds no embedding noise", math=True),
    # -------- logging and trackers
    "log_completions": Field("monitor.log_completions", False, "grpokit writes completions.jsonl every "
                             "monitor.log_completions steps"),
    "log_multimodal": Field(None, True, "grpokit writes every logged prompt's images to the run's images/ folder "
                            "(completions.jsonl names them; grpokit report shows them)"),
    "num_completions_to_print": Field(None, None, LOGGING),
    "log_unique_prompts": Field(None, False, LOGGING),
    "log_completions_hub_repo": Field(None, None, HUB),
    "report_to": Field("monitor", "none", "trackio, wandb and tensorboard are carried (monitor.trackio, .wandb, "
                       ".tensorboard); others are not"),
    "project": Field("monitor", "huggingface", "the Trackio and W&B project"),
    "run_name": Field(None, None, "grpokit names a run after its folder (train.output_dir)"),
    "trackio_space_id": Field(None, None, "grpokit's Trackio logs locally (trackio sync uploads them)"),
    "trackio_static_space_id": Field(None, None, "grpokit's Trackio logs locally (trackio sync uploads them)"),
    "trackio_bucket_id": Field(None, None, "grpokit's Trackio logs locally (trackio sync uploads them)"),
    "logging_steps": Field(None, 10, LOGGING),
    "logging_strategy": Field(None, "steps", LOGGING),
    "logging_first_step": Field(None, False, LOGGING),
    "logging_nan_inf_filter": Field(None, True, LOGGING),
    "log_level": Field(None, "passive", LOGGING),
    "log_level_replica": Field(None, "warning", LOGGING),
    "log_on_each_node": Field(None, True, LOGGING),
    "disable_tqdm": Field(None, None, "grpokit train --no-progress; grpokit.train(progress=False)"),
    "skip_memory_metrics": Field(None, True, LOGGING),
    "include_num_input_tokens_seen": Field(None, "no", "grpokit logs num_tokens every step"),
    "debug": Field(None, "", TA),
    # -------- the Hub
    "push_to_hub": Field(None, False, HUB),
    "hub_model_id": Field(None, None, HUB),
    "hub_strategy": Field(None, "every_save", HUB),
    "hub_token": Field(None, None, HUB),
    "hub_private_repo": Field(None, None, HUB),
    "hub_always_push": Field(None, False, HUB),
    "hub_revision": Field(None, None, HUB),
    # -------- devices, parallelism, speed
    "use_cpu": Field(None, False, DEVICES),
    "local_rank": Field(None, -1, DEVICES),
    "ddp_backend": Field(None, None, DEVICES),
    "ddp_timeout": Field(None, 1800, DEVICES),
    "ddp_find_unused_parameters": Field(None, None, DEVICES),
    "ddp_bucket_cap_mb": Field(None, None, DEVICES),
    "ddp_broadcast_buffers": Field(None, None, DEVICES),
    "ddp_static_graph": Field(None, None, DEVICES),
    "fsdp": Field(None, None, "grpokit takes FSDP2 / DeepSpeed from the accelerate launcher's config "
                  "(examples/accelerate/)"),
    "fsdp_config": Field(None, None, "grpokit takes FSDP2 / DeepSpeed from the accelerate launcher's config"),
    "deepspeed": Field(None, None, "grpokit takes FSDP2 / DeepSpeed from the accelerate launcher's config"),
    "accelerator_config": Field(None, None, "grpokit takes its processes from the launcher"),
    "parallelism_config": Field(None, None, "grpokit takes its processes from the launcher"),
    "torch_compile": Field(None, False, SPEED),
    "torch_compile_backend": Field(None, None, SPEED),
    "torch_compile_mode": Field(None, None, SPEED),
    "torch_empty_cache_steps": Field(None, None, SPEED),
    "use_liger_kernel": Field(None, False, SPEED + " (grpokit's train.logprob_chunk_size saves the same memory)"),
    "liger_kernel_config": Field(None, None, SPEED),
    "use_cache": Field(None, False, SPEED),
    "bf16_full_eval": Field(None, False, EVAL),
    "fp16_full_eval": Field(None, False, EVAL),
    "dataloader_drop_last": Field(None, False, DATALOADER),
    "dataloader_num_workers": Field(None, 0, DATALOADER),
    "dataloader_pin_memory": Field(None, True, DATALOADER),
    "dataloader_persistent_workers": Field(None, False, DATALOADER),
    "dataloader_prefetch_factor": Field(None, None, DATALOADER),
    "dataloader_in_order": Field(None, True, DATALOADER),
    "dataloader_multiprocessing_context": Field(None, None, DATALOADER),
}

# Fields with a grpokit key that from_trl carries with the fields they depend on, not one to one.
CARRIED_BELOW = {"use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                 "vllm_importance_sampling_mode", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max",
                 "max_tool_calling_iterations", "max_steps", "save_strategy", "save_steps", "eval_strategy",
                 "eval_steps", "warmup_steps", "epsilon_high", "log_completions", "output_dir", "activation_checkpointing"}

# Fields TRL's __post_init__ fills in whatever the user gave: their value says nothing about a choice.
FILLED_IN = {"activation_checkpointing", "disable_tqdm", "report_to", "use_cpu", "accelerator_config",
             "dataloader_pin_memory", "debug", "pad_to_multiple_of", "generation_batch_size", "steps_per_generation"}
