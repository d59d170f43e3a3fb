"""Coming from TRL: `grpokit.from_trl(GRPOConfig or dict)` gives the grpokit config for a TRL
`GRPOConfig` (TRL 1.16), and the TRL settings it could not carry over, each with the reason.

Every field of GRPOConfig (its own and those it inherits from transformers' TrainingArguments) is
in FIELDS, with what becomes of it:
- carried to a grpokit key (converted where the meaning differs, e.g. TRL counts optimizer steps,
  grpokit counts generation steps);
- `batch`: the batch fields together become prompts_per_step, updates_per_step and
  micro_batch_size (grpokit's batch knobs, one meaning each);
- `math`: a setting grpokit does not have that changes what is trained. Set away from TRL's default,
  it is an error (FromTRLError) rather than a run that silently trains something else;
- `not carried`: how TRL's Trainer runs (logging, devices, the Hub, speed) or a setting grpokit
  decides another way. Set away from TRL's default, it is listed, with the reason.

A setting of a grpokit variant that the converted config has off (config.VARIANT_SETTINGS: vLLM's
settings without vLLM, the server timeout without a server, ...) is carried only when the TRL
config sets it: TRL's default for it would be a setting grpokit refuses, set for nothing.

TRL is not needed to convert a dict: TRL's defaults for the fields that matter are in FIELDS
(tests/test_from_trl.py checks them against TRL's own).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from grpokit.config import load_config, unused_settings
from grpokit.errors import ConfigError
from grpokit.schedule import SCHEDULES


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
    from grpokit.loss import LOSSES  # with torch: imported when a config is converted, not with this module

    return LOSSES


def _normalized_by_update_tokens(loss_type: str) -> bool:
    """Whether grpokit's loss `loss_type` divides by the tokens of each optimizer update (dapo, cispo)."""
    from grpokit.loss import token_mean

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
    "router_aux_loss_coef": Field(None, None, "grpokit adds no mixture-of-experts router loss", math=True),
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
    "chat_template_kwargs": Field(None, None, "grpokit renders prompts with the chat template's defaults (a template "
                                  "of your own: model.chat_template)", math=True),
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
    "entropy_coef": Field(None, 0.0, "grpokit adds no entropy bonus to the loss", math=True),
    "use_adaptive_entropy": Field(None, False, "grpokit adds no entropy bonus to the loss", math=True),
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


@dataclass(frozen=True)
class NotCarried:
    field: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.reason}"


def _plain(value):
    return getattr(value, "value", value)  # TRL's enums (SchedulerType, ...) as their strings


def _given(trl_config) -> dict[str, Any]:
    """The TRL fields `trl_config` sets (a GRPOConfig: those away from their declared default)."""
    if isinstance(trl_config, dict):
        unknown = sorted(set(trl_config) - set(FIELDS))
        if unknown:
            raise ConfigError(f"from_trl: {', '.join(unknown)} {'is not a field' if len(unknown) == 1 else 'are not fields'}"
                              " of TRL's GRPOConfig (1.16)")
        return {k: _plain(v) for k, v in trl_config.items()}
    if not dataclasses.is_dataclass(trl_config):
        raise ConfigError(f"from_trl takes a TRL GRPOConfig or a dict of its fields, got {type(trl_config).__name__}")
    given = {}
    for f in dataclasses.fields(trl_config):
        declared = (f.default if f.default is not dataclasses.MISSING
                    else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        value = _plain(getattr(trl_config, f.name))
        if f.name == "output_dir" and value == "trainer_output":
            continue  # transformers' stand-in for "not given"; a run folder of grpokit's own is named after the run
        if f.name not in FIELDS:
            raise ConfigError(f"from_trl: GRPOConfig field {f.name!r} is newer than the TRL (1.16) grpokit knows: "
                              "convert it by hand")
        if value != _plain(declared) or f.name in ("generation_batch_size", "steps_per_generation", "activation_checkpointing"):
            given[f.name] = value
    return given


def from_trl(trl_config, num_processes: int = 1) -> tuple[dict, list[NotCarried]]:
    """(grpokit config as {section: {field: value}}, the settings not carried over) for a TRL
    GRPOConfig (or a dict of its fields) run on `num_processes` processes. FromTRLError when a
    setting that changes what is trained cannot be carried."""
    given = _given(trl_config)
    _check_world(trl_config, given, num_processes)
    c = _Conversion({name: given.get(name, field.default) for name, field in FIELDS.items()})
    _refuse_math(c.value, given)
    _carry_fields(c)
    per_step = _carry_batch(c, num_processes)
    _carry_steps(c, per_step)
    _carry_engine(c)
    _carry_trackers(c)
    _list_the_rest(c, given)
    _leave_out_unread(c.out, given)
    return c.out, c.notes


@dataclass
class _Conversion:
    """from_trl's work: every TRL field's value (as set, or TRL's default), and what it makes of
    them: the grpokit config ({section: {field: value}}) and the settings not carried."""

    value: dict[str, Any]
    out: dict[str, dict] = dataclasses.field(default_factory=dict)
    notes: list[NotCarried] = dataclasses.field(default_factory=list)

    def put(self, key: str, v) -> None:
        section, name = key.split(".")
        self.out.setdefault(section, {})[name] = v

    def note(self, name: str, v, reason: str) -> None:
        self.notes.append(NotCarried(name, v, reason))


def _check_world(trl_config, given: dict, num_processes: int) -> None:
    world = getattr(trl_config, "world_size", num_processes)
    if world != num_processes:
        raise ConfigError(f"from_trl(num_processes={num_processes}) of a GRPOConfig built in a run of {world} "
                          f"process(es): TRL sized its generation batch for {world} (generation_batch_size="
                          f"{given.get('generation_batch_size')}); pass the fields you set as a dict instead")


def _clip_max(value: dict):
    """The upper bound of TRL's importance weight: its older name, or its newer one."""
    return value["vllm_importance_sampling_cap"] or value["vllm_importance_sampling_clip_max"]


def _refuse_math(value: dict, given: dict) -> None:
    """FromTRLError listing every setting that changes what is trained and that grpokit cannot carry."""
    errors = [f"{name}={given[name]!r}: {FIELDS[name].why}" for name in given
              if FIELDS[name].math and given[name] != FIELDS[name].default]
    if str(value["optim"]) not in ("adamw_torch", "adamw_torch_fused"):
        errors.append(f"optim={value['optim']!r}: {FIELDS['optim'].why}")
    if value["loss_type"] == "vespo" or value["loss_type"] == "luspo":
        errors.append(f"loss_type={value['loss_type']!r}: grpokit has {_listed(_losses())}")
    if value["beta"] and value["use_bias_correction_kl"]:
        errors.append(f"use_bias_correction_kl=True (TRL's default) with beta={value['beta']}: TRL multiplies the KL "
                      "term by the policy ratio, grpokit does not; use_bias_correction_kl=False is grpokit's KL term")
    if value["loss_type"] == "cispo" and (value["epsilon_high"] is None or value["epsilon_high"] <= 1):
        errors.append(f"loss_type='cispo' with epsilon_high={value['epsilon_high']!r}: TRL caps CISPO's weight at "
                      f"epsilon_high (at epsilon={value['epsilon']} without it), grpokit at 1 + algorithm.epsilon_high "
                      "with epsilon_high > 0: set epsilon_high above 1 (the CISPO paper's cap is 5)")
    if value["use_vllm"] and value["vllm_importance_sampling_correction"] and _clip_max(value) is None:
        errors.append("vllm_importance_sampling_clip_max=None: an importance weight without an upper bound; grpokit's "
                      "rollout.is_cap always bounds it: give a number")
    if errors:
        raise FromTRLError("these TRL settings change what is trained and grpokit cannot carry them over:\n"
                           + "\n".join(f"  - {e}" for e in errors))


def _carry_fields(c: _Conversion) -> None:
    """The fields carried one to one (converted where the meaning differs), and those carried
    with another field."""
    value = c.value
    # TRL sends a string prompt as plain text (a conversational one through the chat template, as grpokit does).
    c.put("data.chat_template", False)
    for name, field in FIELDS.items():
        if field.key is not None and "." in field.key and name not in CARRIED_BELOW:
            c.put(field.key, field.convert(value[name]) if field.convert else value[name])
    if _clip_max(value) is not None:  # None without vLLM: TRL reads none of these, and grpokit's default stands
        c.put("rollout.is_cap", _clip_max(value))
    level, _, mode = value["vllm_importance_sampling_mode"].partition("_")
    c.put("rollout.is_level", level)
    c.put("rollout.is_mode", mode)
    if value["epsilon_high"] is not None:
        c.put("algorithm.epsilon_high", value["epsilon_high"] - 1 if value["loss_type"] == "cispo" else value["epsilon_high"])
    if value["loss_type"] == "bnpo":
        c.note("loss_type", "bnpo", "carried as dapo: bnpo divides by the tokens of each local batch, so its update "
               "changes with the micro-batch size and the process count; dapo divides by the whole update batch's "
               "tokens (bnpo's value with one process and one micro-batch)")
    if value["gradient_checkpointing"] or value["activation_checkpointing"]:
        c.put("model.gradient_checkpointing", True)
    dtype = (value["model_init_kwargs"] or {}).get("dtype") or (value["model_init_kwargs"] or {}).get("torch_dtype")
    if dtype not in (None, "auto"):
        c.put("model.dtype", str(dtype).removeprefix("torch."))
    if value["output_dir"] is not None:
        c.put("train.output_dir", str(value["output_dir"]))
    if value["log_completions"] is False:
        c.put("monitor.log_completions", 0)


def _carry_batch(c: _Conversion, num_processes: int) -> int:
    """TRL's per-device batch, accumulation and generation batch, as grpokit's batch knobs; returns
    the number of TRL's optimizer steps in one grpokit step."""
    value = c.value
    per_device, accumulation = value["per_device_train_batch_size"], value["gradient_accumulation_steps"]
    update = per_device * num_processes * accumulation  # completions per optimizer update
    generation = value["generation_batch_size"]
    if generation is None:
        generation = per_device * num_processes * (value["steps_per_generation"] or accumulation)
    G = value["num_generations"]
    if generation % G or generation % update:
        raise FromTRLError(f"generation_batch_size={generation} must be a multiple of num_generations={G} and of the "
                           f"{update} completions of one optimizer update (per_device_train_batch_size x processes x "
                           "gradient_accumulation_steps)")
    c.put("train.prompts_per_step", generation // G)
    c.put("train.updates_per_step", generation // update)
    c.put("train.micro_batch_size", per_device)
    if generation > update and _normalized_by_update_tokens(value["loss_type"]):
        c.note("loss_type", value["loss_type"], f"each of the {generation // update} updates per generation batch is "
               "normalized by its own tokens; TRL's by the generation batch's tokens divided by the number of updates")
    if value["top_entropy_quantile"] < 1:
        c.note("top_entropy_quantile", value["top_entropy_quantile"], FIELDS["top_entropy_quantile"].why)
    return generation // update * value["num_iterations"]


def _carry_steps(c: _Conversion, per_step: int) -> None:
    """TRL's counts of optimizer steps (max_steps, warm-up, saving and evaluating) in grpokit steps of
    `per_step` optimizer steps each."""
    value = c.value

    def steps(name: str, v) -> int | None:
        if 0 < v < 1:  # transformers: a share of max_steps (its optimizer steps)
            if value["max_steps"] is None or value["max_steps"] <= 0:
                c.note(name, v, "a share of max_steps needs max_steps: set it in grpokit steps")
                return None
            v = math.ceil(v * value["max_steps"])
        n = math.ceil(v / per_step)
        if n * per_step != v:
            c.note(name, v, f"rounded up to {n} grpokit steps of {per_step} optimizer updates each")
        return n

    if value["max_steps"] is not None and value["max_steps"] > 0:
        c.put("train.max_steps", steps("max_steps", value["max_steps"]))
        total_updates = c.out["train"]["max_steps"] * per_step
    else:
        c.note("max_steps", value["max_steps"], f"{FIELDS['max_steps'].why} (num_train_epochs={value['num_train_epochs']})")
        total_updates = None
    _carry_warmup(c, total_updates)
    save = str(value["save_strategy"])
    if save == "no":
        c.put("train.save_every", 0)
    elif save == "steps" and (every := steps("save_steps", value["save_steps"])) is not None:
        c.put("train.save_every", every)
    else:
        c.note("save_strategy", save, "grpokit saves every train.save_every steps")
    evaluation = str(value["eval_strategy"])
    if evaluation == "no":
        c.put("train.eval_every", 0)
        c.put("data.eval_size", 0)
    elif evaluation == "steps" and (every := steps("eval_steps", value["eval_steps"] or value["logging_steps"])) is not None:
        c.put("train.eval_every", every)
    else:
        c.note("eval_strategy", evaluation, "grpokit evaluates every train.eval_every steps")


def _carry_warmup(c: _Conversion, total_updates: int | None) -> None:
    """warmup_steps (below 1, a share of the run's `total_updates`), and how it differs from TRL's."""
    warmup = c.value["warmup_steps"]
    if 0 < warmup < 1:
        if total_updates is None:
            c.note("warmup_steps", warmup, "a share of the updates needs max_steps: set train.warmup_steps")
        else:
            c.put("train.warmup_steps", math.ceil(warmup * total_updates))
    else:
        c.put("train.warmup_steps", int(warmup))
    if str(c.value["lr_scheduler_type"]) == "constant" and warmup:  # not constant_with_warmup
        c.put("train.warmup_steps", 0)
        c.note("warmup_steps", warmup, FIELDS["lr_scheduler_type"].why)
    elif warmup:
        c.note("warmup_steps", warmup, "carried, but grpokit's warm-up gives update u (from 0) the learning rate x "
               "(u + 1) / W, transformers' x u / W: its first update is not wasted")


def _carry_engine(c: _Conversion) -> None:
    """The generation engine, and the turns of a conversation with tools."""
    value = c.value
    if value["use_vllm"]:
        if value["vllm_mode"] == "server":
            c.put("rollout.engine", "server")
            c.put("rollout.server_url", value["vllm_server_base_url"]
                  or f"http://{value['vllm_server_host']}:{value['vllm_server_port']}")
            c.note("vllm_mode", "server", FIELDS["vllm_server_base_url"].why)
        else:
            c.put("rollout.engine", "vllm")
    if value["max_tool_calling_iterations"] is not None:
        c.put("rollout.max_turns", value["max_tool_calling_iterations"] + 1)


def _carry_trackers(c: _Conversion) -> None:
    reporters = c.value["report_to"]
    reporters = [reporters] if isinstance(reporters, str) else list(reporters or [])
    for tracker in reporters:
        if tracker in ("trackio", "wandb", "tensorboard"):
            c.put(f"monitor.{tracker}", True)
            if tracker != "tensorboard" and c.value["project"] != FIELDS["project"].default:
                c.put(f"monitor.{tracker}_project", c.value["project"])
        elif tracker == "all":  # transformers: every tracker installed
            c.note("report_to", tracker, "grpokit turns on only the trackers named: monitor.trackio, monitor.wandb, "
                   "monitor.tensorboard")
        elif tracker != "none":
            c.note("report_to", tracker, "grpokit logs to trackio, wandb and tensorboard")


def _list_the_rest(c: _Conversion, given: dict) -> None:
    """Everything else that was set and is not carried."""
    value = c.value
    handled = {n for n, f in FIELDS.items() if f.key is not None} | FILLED_IN | {
        "model_init_kwargs", "num_train_epochs", "optim", "bf16", "use_bias_correction_kl"}
    for name, v in given.items():
        if name not in handled and v != FIELDS[name].default:
            c.note(name, v, FIELDS[name].why)
    if value["bf16"] is not False and not value["fp16"]:  # TRL turns None into True: bf16 unless told otherwise
        c.note("bf16", True, FIELDS["bf16"].why)
    extra = {k: v for k, v in (value["model_init_kwargs"] or {}).items() if k not in ("dtype", "torch_dtype")}
    if extra:
        c.note("model_init_kwargs", extra, FIELDS["model_init_kwargs"].why)


# TRL fields carried to grpokit keys beside their own (Field.key).
ALSO_CARRIED = {"vllm_importance_sampling_mode": ("rollout.is_mode",)}


def _leave_out_unread(out: dict, given: dict) -> None:
    """Leave out of `out` the settings of a grpokit variant that it has off (config.VARIANT_SETTINGS,
    e.g. rollout.vllm_sleep without rollout.engine=vllm) where they only carry TRL's defaults: nobody
    chose them, and grpokit refuses a setting set for a variant that is off. One the TRL config set
    away from TRL's default stays (and is refused where it differs from grpokit's default)."""
    try:
        config = load_config(values=out, check=False)
    except ConfigError:
        return  # what cannot be set is said when the config is loaded
    chosen = {key for name, v in given.items() if v != FIELDS[name].default
              for key in (FIELDS[name].key, *ALSO_CARRIED.get(name, ()))}
    for key in unused_settings(config, every=True):
        section, name = key.split(".")
        if key not in chosen and name in out.get(section, {}):
            del out[section][name]


def table() -> str:
    """The table of docs/from-trl.md: every GRPOConfig field, its grpokit key or why there is none."""
    rows = ["| TRL GRPOConfig field | grpokit | note |", "|---|---|---|"]
    for name, field in FIELDS.items():
        if field.key == "batch":
            key = "train.prompts_per_step, updates_per_step, micro_batch_size"
            why = "generation_batch_size / num_generations prompts; generation batch / update batch updates; per-device batch as micro-batch"
        else:
            key = "monitor.*" if field.key == "monitor" else field.key or ("none: an error when set" if field.math else "none")
            why = field.why
        rows.append(f"| `{name}` | {f'`{key}`' if field.key else key} | {why} |")
    return "\n".join(rows)
