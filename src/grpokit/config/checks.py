"""Every rule about settings: each value in its range, and every "X cannot go with Y", whether X
and Y are two settings, a setting and the way the run is launched (processes, sharding: Launch),
or a setting and the model (a vision-language model, its positions, its attention: ModelFacts).

`problems(config, facts)` lists every problem at once, each naming its field and a fix; `check`
raises them as one ConfigError. They run at start-up, before anything is loaded or written
(training/setup.py, for `grpokit train`, `grpokit eval` and `grpokit serve`), and `grpokit config
--check my.yaml` prints them without loading a model. What only the data or the user's code can
tell (a row, a reward function's arguments, a tool's signature) is checked where they are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlparse

from grpokit.config.variants import VARIANT_SETTINGS, has_tools, unused_settings
from grpokit.runtime.errors import ConfigError
from grpokit.runtime.launch import Launch
from grpokit.settings.schema import DECODERS, QUANTIZATIONS, Config, setting


@dataclass(frozen=True)
class ModelFacts:
    """What the rules need to know of the model, read from its config (no weights loaded)."""

    vision: bool = False  # a vision-language model
    max_positions: int | None = None  # its positions (max_position_embeddings), when it says
    static_problem: str | None = None  # why rollout.decoder=static cannot decode it (None: it can)
    mask_problem: str | None = None  # why no 4D attention mask is exact for it (models/architecture.py; None: one is)
    routed: bool = False  # a mixture-of-experts model whose routers' logits a load-balancing loss reads


@dataclass(frozen=True)
class Facts:
    """What the rules read besides the config: how the run is launched, and the model (None: not
    known, and the rules about it are not checked)."""

    launch: Launch = field(default_factory=Launch)
    model: ModelFacts | None = None


def facts(config: Config, model_name: str | None = None, model=None, tokenizer=None,
          world_size: int | None = None, local_only: bool = False) -> Facts:
    """The facts of a run of `config` on `world_size` processes (default: as torchrun or accelerate
    launched it): its launch (the environment's), and the model `model_name` (default model.name)
    or the loaded `model` given with its `tokenizer` (a vision-language model's processor), read
    from its config without loading weights. `local_only`: a model not on this machine yet (a Hub
    id not downloaded) is not fetched, its facts not known (None)."""
    import os

    from grpokit.runtime.launch import read_launch

    if world_size is None:  # the launcher's, before the process group exists
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return Facts(read_launch(world_size), model_facts(model_name or config.model.name, model, tokenizer, local_only))


def model_facts(name: str, model=None, tokenizer=None, local_only: bool = False) -> ModelFacts | None:
    """ModelFacts of the model named `name`, or of `model` (loaded) given with `tokenizer` (its
    processor makes it a vision-language model's); None when its config cannot be read (a missing
    folder, a Hub id offline: loading it says why), or with `local_only`, is not on this machine."""
    from grpokit.engines.static_decoder import static_decoding_problem
    from grpokit.models.architecture import Layers
    from grpokit.models.loading import model_config
    from grpokit.models.routers import routed_choices
    from grpokit.models.vision import is_processor
    from grpokit.runtime.errors import StartupError

    try:
        hf = model.config if model is not None else model_config(name, local_only)
        if hf is None:
            return None
        vision = is_processor(tokenizer) if tokenizer is not None else getattr(hf, "vision_config", None) is not None
    except StartupError:
        return None
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf  # a vision-language model's
    positions = getattr(text, "max_position_embeddings", None)
    return ModelFacts(vision, positions if isinstance(positions, int) else None, static_decoding_problem(hf, vision),
                      Layers.of(hf).mask_problem(), routed_choices(hf) is not None)


def problems(config: Config, facts: Facts = Facts()) -> list[str]:
    """Every problem of `config` as launched and with the model `facts` say, each naming its field and a fix."""
    errors = _check_settings(config)
    world = facts.launch.world_size
    if not errors and config.completions_per_update % world:
        errors.append(
            f"the {config.completions_per_update} completions of one optimizer update (train.prompts_per_step="
            f"{config.train.prompts_per_step} x rollout.num_generations={config.rollout.num_generations} / "
            f"train.updates_per_step={config.train.updates_per_step}) cannot be split evenly over "
            f"{world} processes: make it a multiple of {world}"
        )
    if _judged(config) and config.reward.judge_mode == "group" and world > 1:
        errors.append(f"reward.judge_mode=group shows the judge a prompt's completions together, which {world} "
                      "processes split between them: use reward.judge_mode=single, or one process")
    if config.rollout.engine == "vllm" and world > 1:
        errors.append(f"rollout.engine=vllm runs vLLM inside one training process, not {world}: with "
                      "several, serve vLLM apart (grpokit serve --engine vllm) and use rollout.engine=server")
    return [*errors, *_check_launch(config, facts.launch), *_check_rollout_kind(config, facts),
            *_check_model(config, facts.model)]


def check(config: Config, facts: Facts = Facts()) -> None:
    """Raise ConfigError listing every problem (`problems`)."""
    found = problems(config, facts)
    if found:
        raise ConfigError.listing(found)


def engine_problems(config: Config, measures_entropies: bool) -> list[str]:
    """What the engine a run connected to cannot do that the config asks of it: a rollout server
    says which engine it runs only once reached (at start-up, before the first step)."""
    q = config.algorithm.top_entropy_quantile
    return [] if q == 1 or measures_entropies else [
        f"algorithm.top_entropy_quantile={q} selects tokens by their sampling entropy, which the engine of "
        f"rollout.engine={config.rollout.engine} does not measure (vLLM): use the transformers engine, or remove it"]


def choices() -> dict[str, tuple]:
    """The allowed values of each field that names one of several things, each taken from the
    registry that owns those things (imported here, when a config is checked, not when it is read)."""
    from grpokit.algorithm.advantages import AGGREGATIONS, ESTIMATORS, SCALES
    from grpokit.algorithm.loss import IS_MODES, KL_ESTIMATORS, LEVELS, LOSSES
    from grpokit.algorithm.schedule import SCHEDULES
    from grpokit.engines.protocols import ENGINES
    from grpokit.models.loading import DTYPES
    from grpokit.models.reasoning import PARSERS
    from grpokit.rollouts.tool_formats import CHOICES as TOOL_CALL_FORMATS
    from grpokit.tasks.dataset import LONG_PROMPTS

    return {
        "model.dtype": tuple(DTYPES),
        "model.reasoning_parser": PARSERS,
        "rollout.tool_call_format": TOOL_CALL_FORMATS,
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


def _check_settings(c: Config) -> list[str]:
    """Every value allowed and in its range, no setting set for a variant that is off, and no two
    settings that contradict each other; each message names its field and a fix."""
    return [*_check_choices(c), *_check_task(c), *_check_sampling(c), *_check_algorithm(c), *_check_variants(c),
            *_check_unused(c), *_check_engine(c), *_check_rollout(c), *_check_data(c), *_check_train(c),
            *_check_distill(c), *_check_judge(c), *_check_reward_functions(c.reward.functions, c.rollout.agent is not None,
                                                         c.distill.teacher is not None)]


def _judged(c: Config) -> bool:
    return any((e if isinstance(e, str) else e.get("name") if isinstance(e, dict) else None) == "judge"
               for e in c.reward.functions or ())


def _check_judge(c: Config) -> list[str]:
    r, p = c.reward, _Problems()
    if not _judged(c):
        return p
    p.need(r.judge_url is not None, "reward.functions names the judge, but reward.judge_url is not set: the judge's "
           "OpenAI-compatible base URL (grpokit serve --model <judge> answers at http://127.0.0.1:<port>/v1)")
    if r.judge_url is not None:
        p += [e.replace("rollout.server_url", "reward.judge_url") for e in _url_problems(r.judge_url)]
    p.need(r.judge_mode in ("group", "single"), f"reward.judge_mode={r.judge_mode}: must be group or single")
    p.need(r.judge_timeout > 0 and r.judge_retries >= 0 and r.judge_concurrency >= 1,
           "reward.judge_timeout must be > 0, reward.judge_retries >= 0 and reward.judge_concurrency >= 1")
    p.need(r.judge_temperature >= 0, f"reward.judge_temperature={r.judge_temperature}: must be >= 0")
    return p


def _check_distill(c: Config) -> list[str]:
    d, p = c.distill, _Problems()
    if d.teacher is None:
        return p
    p.need(math.isfinite(d.coef) and d.coef > 0, f"distill.coef={d.coef}: must be a finite number > 0")
    p.need(not c.rollout.dynamic_sampling, "rollout.dynamic_sampling drops groups of equal rewards, but with "
           f"distill.teacher={d.teacher} every token has a signal of its own: use one of them")
    return p


def _check_choices(c: Config) -> list[str]:
    errors = []
    for key, allowed in choices().items():
        value = setting(c, key)
        if value not in allowed:
            errors.append(f"{key}={value!r} is not one of: {', '.join('null' if a is None else a for a in allowed)}")
    return errors


def _check_task(c: Config) -> list[str]:
    from grpokit.tasks.registry import check_task_name

    p = _Problems()
    task_problem = check_task_name(c.data.task)
    p.need(task_problem is None, task_problem)
    p.need(not c.data.task_args or (c.data.path is None and (c.data.task.startswith(("reasoning_gym:", "textarena:",
                                                                                      "verifiers:"))
                                                             or c.data.task in ("shapes", "arithmetic"))),
           f"data.task_args={c.data.task_args!r} is only read by data.task=reasoning_gym:<name>, textarena:<env id>, "
           "verifiers:<module>:<load_environment>, shapes and arithmetic, and data.path is null")
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
    p.need(a.entropy_coef >= 0, f"algorithm.entropy_coef={a.entropy_coef}: must be >= 0 (a bonus on the entropy; "
           "0: none)")
    p.need(a.router_aux_loss_coef is None or a.router_aux_loss_coef >= 0,
           f"algorithm.router_aux_loss_coef={a.router_aux_loss_coef}: must be >= 0 (0: none; null: the model's own)")
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
    if r.partial:
        p += _partial_problems(c)
    p.need(r.server_timeout > 0, f"rollout.server_timeout={r.server_timeout}: must be > 0")
    p.need(r.decoder in DECODERS, f"rollout.decoder={r.decoder!r}: must be one of {', '.join(DECODERS)}")
    if r.decode_slots is not None:
        p.need(r.decode_slots >= 1, f"rollout.decode_slots={r.decode_slots}: must be >= 1 (or null: every completion "
               "at once)")
        p.need(r.decoder != "static", f"rollout.decode_slots={r.decode_slots} with rollout.decoder=static: "
               "the static decoder sizes its cache once for the completions it starts with, so none can join later; "
               "use rollout.decoder=dynamic (or auto, which picks it when decode_slots is set)")
    return p


def _partial_problems(c: Config) -> list[str]:
    """rollout.partial: its settings, and the ways of sampling it does not go with (yet)."""
    r, p = c.rollout, _Problems()
    p.need(r.partial_tokens >= 1, f"rollout.partial_tokens={r.partial_tokens}: must be >= 1")
    p.need(r.partial_spare is None or r.partial_spare >= 1, f"rollout.partial_spare={r.partial_spare}: must be >= 1, "
           "or null")
    p.need(r.partial_max_lag >= 1, f"rollout.partial_max_lag={r.partial_max_lag}: must be >= 1")
    p.need(r.is_correction, "rollout.partial with rollout.is_correction=false: a carried completion's tokens were "
           "sampled by the policies before the update, and the importance weights are what corrects for that")
    for problem, why in (
            (r.dynamic_sampling, "rollout.dynamic_sampling (its rounds draw prompts by the rewards)"),
            (has_tools(c) or r.agent is not None, "tools, environments or agents (a conversation carried mid-turn "
             "into the next step is not built)")):
        p.need(not problem, f"rollout.partial with {why}: not supported; turn one of them off")
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
    p.need(r.agent is None or not has_tools(c), f"rollout.agent={r.agent} runs its own tools and loop, and the run "
           "also has tools or an environment (rollout.tools, rollout.environment, or the task's own): keep one "
           "(rollout.tools=[] drops the task's own)")
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
    p.need(m.quantization in QUANTIZATIONS, f"model.quantization={m.quantization}: must be one of {', '.join(QUANTIZATIONS)}")
    if m.quantization != "none":
        p.need(m.dtype != "float64", f"model.quantization={m.quantization} with model.dtype=float64: bitsandbytes "
               "computes in float32, bfloat16 or float16")
        p.need(c.rollout.engine != "vllm", f"model.quantization={m.quantization} with rollout.engine=vllm: "
               "vLLM holding the same bitsandbytes-quantized base is not built; sample in-process (transformers) or "
               f"on a `grpokit serve --quantization {m.quantization}` server (rollout.engine=server), which takes "
               "the adapters alone")
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
    if t.micro_batch_tokens is not None:
        if t.micro_batch_tokens < 1:
            p.append(f"train.micro_batch_tokens={t.micro_batch_tokens}: must be >= 1, or null")
        if t.micro_batch_size is not None:
            p.append(f"train.micro_batch_size={t.micro_batch_size} and train.micro_batch_tokens={t.micro_batch_tokens} "
                     "each set the micro-batches (completions, or packed tokens): set one of them")
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


def _check_reward_functions(functions, agent: bool, teacher: bool = False) -> list[str]:
    """agent: rollout.agent is set, whose returned reward is one (reward.functions=[]: it alone);
    teacher: distill.teacher is set (reward.functions=[]: its signal alone)."""
    if functions is None:
        return []
    if not functions and not agent and not teacher:
        return ["reward.functions is empty: name at least one function, or null for the task's own (an empty list is "
                "for rollout.agent: the reward its agent returns, alone; or distill.teacher: its signal alone)"]
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


# ---------------------------------------------------------------- the launch: processes and sharding


def _check_launch(c: Config, launch: Launch) -> list[str]:
    """What the accelerate config's sharding (runtime/launch.py) asks that grpokit cannot run."""
    if launch.sharding is None:
        return []
    p = _Problems()
    if not launch.deepspeed_installed:
        return ["the accelerate config asks for DeepSpeed, which is not installed: pip install 'grpokit[deepspeed]'"]
    asks = f"the accelerate config asks for {launch.sharding}, which grpokit cannot run as set up: "
    p.need(launch.mixed_precision == "no", asks + f"mixed_precision: {launch.mixed_precision} (grpokit has one "
           "precision setting, model.dtype: set mixed_precision: 'no' and model.dtype=bfloat16 to train in bf16)")
    p.need(c.model.quantization == "none", asks + f"model.quantization={c.model.quantization} (a quantized base is not "
           "sharded: it runs with data parallelism, every process holding the quantized base)")
    p.need(c.rollout.engine != "vllm", asks + "rollout.engine=vllm (it runs in one process; serve it with `grpokit "
           "serve --engine vllm` and set rollout.engine=server)")
    p.need(not c.algorithm.sync_ref_model, "algorithm.sync_ref_model with sharded weights (FSDP2, ZeRO-3) is not "
           "supported: the reference is mixed with the policy weight by weight; use data parallelism")
    p.need(c.distill.teacher is None, f"distill.teacher with sharded weights ({launch.sharding}) is not built yet: the "
           "teacher would be a whole copy on every process; use data parallelism")
    if launch.sharding == "FSDP" and launch.fsdp_version != "2":
        return [*p, f"the accelerate config's fsdp_config: fsdp_version: {launch.fsdp_version} (grpokit shards with "
                "FSDP2: fsdp_version: 2)"]
    if launch.unreadable is not None:
        return [*p, f"accelerate could not read the config's {launch.sharding} settings: {launch.unreadable}"]
    if launch.plugin is None:  # a launch described by hand (tests), not read from accelerate's
        return p
    return [*p, *(_check_fsdp(launch) if launch.sharding == "FSDP" else _check_deepspeed(c, launch))]


def _check_fsdp(launch: Launch) -> list[str]:
    p = _Problems()
    p.need(not launch.plugin.activation_checkpointing, "the accelerate config's fsdp_config: "
           "fsdp_activation_checkpointing: true (grpokit has one setting for it: model.gradient_checkpointing=true)")
    return p


# The DeepSpeed settings grpokit's own config decides, and where.
DEEPSPEED_OWNED = {
    "train_batch_size": "train.*", "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.micro_batch_size", "gradient_clipping": "train.max_grad_norm",
    "optimizer": "train.learning_rate, train.weight_decay", "scheduler": "train.warmup_steps",
    "fp16": "model.dtype", "bf16": "model.dtype",
}


def _check_deepspeed(c: Config, launch: Launch) -> list[str]:
    ds, found = launch.deepspeed_config, []
    for key, owner in DEEPSPEED_OWNED.items():
        value = ds.get(key, "auto")
        if value != "auto" and not (key in ("fp16", "bf16") and not value.get("enabled", False)):
            found.append(f"{key} is set by grpokit's {owner} (remove it, or set it to \"auto\")")
    if c.model.dtype != "float32":
        found.append(f"model.dtype={c.model.dtype} (DeepSpeed keeps float32 master weights for 16-bit models, which "
                     "grpokit's checkpoints do not hold yet: use FSDP2, or float32)")
    zero = ds.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        if (zero.get(key) or {}).get("device") == "nvme":
            found.append(f"{key} to nvme (offload to cpu is supported)")
    if launch.zero3_init:
        found.append("zero3_init_flag: true (grpokit loads the whole model, then shards it: set it to false)")
    stage = int(zero.get("stage", 0))
    if stage not in (2, 3):
        found.append(f"zero_stage: {stage} (grpokit runs ZeRO-2 and ZeRO-3; without sharding, launch without DeepSpeed)")
    return ["the accelerate config's DeepSpeed settings: " + "; ".join(found)] if found else []


# ---------------------------------------------------------------- the rollout kind, processes and the model


def _check_rollout_kind(c: Config, facts: Facts) -> list[str]:
    """Ways of sampling (agents, tools and environments, dynamic sampling, the engine) that do not
    go with the launch or with a vision-language model."""
    from grpokit.engines.protocols import ENGINES, engine_class

    launch, vision = facts.launch, facts.model is not None and facts.model.vision
    several, lockstep = launch.world_size > 1, launch.lockstep
    remote = c.rollout.engine in ENGINES and engine_class(c.rollout.engine).remote
    tools, r, p = has_tools(c), c.rollout, _Problems()
    if r.agent is not None:
        for refused, why in [(vision, "a vision-language model (the endpoint takes text messages only)"),
                             (lockstep, "sharded weights (FSDP2, ZeRO-3): the processes would make different numbers of "
                              "requests"),
                             (several and remote, "rollout.engine=server on several processes: the agents' outcomes live "
                              "in process 0, which alone talks to the server; use one process, or the transformers "
                              "engine"),
                             (several and r.dynamic_sampling, "rollout.dynamic_sampling on several processes: the kept "
                              "groups' outcomes would have to move between processes"),
                             (r.in_flight_updates, "rollout.in_flight_updates (its requests take no push in flight)")]:
            p.need(not refused, f"rollout.agent={r.agent} with {why}: not supported")
    p.need(not (r.partial and vision), "rollout.partial with a vision-language model is not supported yet (its "
           "prompts' images are not carried)")
    p.need(not (r.in_flight_updates and (vision or tools)), "rollout.in_flight_updates with a vision-language model "
           "or with tools and environments is not supported yet (images not sent again, turns' tokens not tagged)")
    p.need(not (vision and lockstep), "sharded weights (FSDP2, ZeRO-3) with a vision-language model are not supported "
           "yet: a process whose rows have no image would skip the vision encoder's gathers that the others take; use "
           "data parallelism")
    p.need(not (vision and tools), "multi-turn rollouts (rollout.tools, rollout.environment) with a vision-language "
           "model are not supported yet: a conversation's turns would carry no images")
    if c.train.micro_batch_tokens is not None:
        p.need(not vision, "train.micro_batch_tokens with a vision-language model is not supported: its prompts run "
               "with their images' features, which packed rows do not carry; use train.micro_batch_size")
    p.need(not (tools and lockstep), "multi-turn rollouts (rollout.tools, rollout.environment) with sharded weights "
           "(FSDP2, ZeRO-3) are not supported: the processes would take different numbers of turns")
    if r.environment is not None and several:
        p.need(not remote, "rollout.environment with rollout.engine=server on several processes is not supported: the "
               "environments live in process 0, which alone talks to the server; use one process, or the "
               "transformers engine")
        p.need(not r.dynamic_sampling, "rollout.dynamic_sampling with rollout.environment on several processes is not "
               "supported: the kept groups' environments would have to move between processes; use one process, or "
               "turn one of them off")
    return p


def _check_model(c: Config, model: ModelFacts | None) -> list[str]:
    """Settings that the model cannot take: more positions than it has, a decoder it cannot run."""
    if model is None:
        return []
    p, r, d = _Problems(), c.rollout, c.data
    if c.rollout.engine == "transformers" and r.decoder == "static" and model.static_problem:
        p.append(f"rollout.decoder=static: {model.static_problem}; use rollout.decoder=dynamic (or auto)")
    if c.train.micro_batch_tokens is not None and model.mask_problem:
        p.append(f"train.micro_batch_tokens packs completions into rows under one attention mask, but for this model "
                 f"{model.mask_problem}: use train.micro_batch_size")
    if c.algorithm.router_aux_loss_coef and not model.routed:
        p.append(f"algorithm.router_aux_loss_coef={c.algorithm.router_aux_loss_coef}: the model has no routers whose "
                 "logits a load-balancing loss reads (not a mixture-of-experts model, or one whose config has no "
                 "output_router_logits, as DeepSeek-V3's bias-balanced routing): leave it null or 0")
    if model.max_positions is None:
        return p
    limit, length = model.max_positions, r.max_completion_length
    if limit - length < 1:
        p.append(f"rollout.max_completion_length={length} leaves no room for a prompt in the model's {limit} "
                 "positions: lower it")
    elif d.max_prompt_length is not None and d.max_prompt_length > limit - length:
        p.append(f"data.max_prompt_length={d.max_prompt_length} + rollout.max_completion_length={length} exceeds the "
                 f"model's {limit} positions: lower one of them")
    return p
