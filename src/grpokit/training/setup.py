"""The one place that wires a run: `grpokit train` (Trainer), `grpokit eval` (api.evaluate) and
`grpokit serve` (server.py) build their parts here, each taking what it needs, so that a new kind
of rollout, task or engine is wired once.

    check(config, facts)       every rule about the settings, at once (config/checks.py)
    prepare(config, ...)       before the model loads: the tokenizer (or a vision-language model's
                               processor), tools, prompts as token ids, the rollout kind's class,
                               the task (its data read and checked) and the reward functions
    make_kind(...)             once the model is loaded (its EOS ids): the rollout kind
    served_engine(...)         what `grpokit serve` serves: the model, its engine, its fingerprint
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from grpokit.algorithm.loss import LossSettings
from grpokit.config.checks import Facts, check, facts
from grpokit.config.loading import settle
from grpokit.config.schema import Config, reward_specs
from grpokit.models.loading import eos_token_ids, fit_for_passes, load_model
from grpokit.models.packing import AUTO
from grpokit.models.reasoning import Reasoning
from grpokit.models.vision import Vision, check_vision, processing
from grpokit.multiturn import kinds
from grpokit.multiturn.kinds import RolloutKind
from grpokit.multiturn.tools import Tools
from grpokit.rewards.reward_set import RewardSet
from grpokit.rollout.prompts import PromptEncoder
from grpokit.runtime import distributed
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.runtime.threads import share_cores, trainer_processes
from grpokit.tasks.registry import make_task

__all__ = ["Prepared", "checked_facts", "loss_settings", "make_kind", "prepare", "served_engine"]


def checked_facts(config: Config, model=None, tokenizer=None, model_name: str | None = None) -> Facts:
    """Settle `config` (a Config built in Python was not loaded) and check every rule against the
    launch and the model (`model_name`, default model.name, or the loaded `model` given with its
    `tokenizer`): ConfigError listing every problem. The facts checked against."""
    settle(config)
    found = facts(config, model_name, model, tokenizer, world_size=distributed.world_size())
    check(config, found)
    return found


@dataclass
class Prepared:
    """A run's parts made before its model loads."""

    tokenizer: object  # a vision-language model's is its processor's
    vision: Vision | None  # a vision-language model's processor and the inputs of its passes (models/vision.py)
    tools: Tools | None  # None: no tools or environment
    encoder: PromptEncoder  # prompts as the engines see them
    task: object  # where prompts come from (tasks/)
    rewards: RewardSet


def prepare(config: Config, tokenizer=None, model_name: str | None = None, model_facts=None,
            train: bool = True, model=None) -> Prepared:
    """The parts of a run of `config` with the model `model_name` (default model.name), or `model`
    (loaded) given with its `tokenizer` (or processor), checked against the data: with `train`,
    the first training row (an environment's reset, the reward functions' arguments); and every
    prompt against the model's positions (`model_facts`, config/checks.py)."""
    name = model_name or config.model.name
    if train:  # this process's share of the machine's cores (runtime/threads.py)
        share_cores(trainer_processes(config.rollout.server_url or [] if config.rollout.engine == "server" else []))
    tokenizer, vision = processing(name, tokenizer)
    if model is not None:  # a model given with the wrong one of tokenizer and processor: said before its data
        check_vision(model, vision)
    tools = Tools.from_config(config, tokenizer, model_name)
    if vision is not None and (config.model.chat_template or config.model.chat_template_kwargs):
        vision.processor.chat_template = tokenizer.chat_template  # the template prompts are rendered with
    encoder = PromptEncoder(tokenizer, None if tools is None else tools.schemas, config.data.max_prompt_length, vision)
    task = make_task(config.data, config.train.seed, encoder.length, encoder.image_tokens)
    kind = kinds.kind_of(config, tools)
    if train:
        first = next(task.train_stream())
        if tools is not None:
            tools.check({"prompt": first.prompt, **first.columns}, getattr(task, "prompts_from_reset", False))
    rewards = RewardSet(reward_specs(config, task.reward_functions), config.reward.timeout,
                        extra=kind.rewards(config, tools), teacher=config.distill.teacher is not None,
                        reasoning=Reasoning.of(config.model.reasoning_parser, tokenizer))
    if train:
        rewards.check_arguments(first.columns, environments=(tools is not None and tools.environment is not None)
                                or config.rollout.agent is not None)
        _check_prompt_lengths(config, task, encoder, None if model_facts is None else model_facts.max_positions)
    return Prepared(tokenizer, vision, tools, encoder, task, rewards)


def _check_prompt_lengths(config: Config, task, encoder: PromptEncoder, limit: int | None) -> None:
    """Every prompt and its completion fit the model's `limit` positions, or data.max_prompt_length
    makes them (config/checks.py holds it to that): a longer sequence would train on positions the
    model never learned. Only the data tells which prompts are longer."""
    d, length = config.data, config.rollout.max_completion_length
    if limit is None or d.max_prompt_length is not None or limit - length < 1:
        return
    budget = limit - length  # what a prompt may hold
    examples = [*getattr(task, "train_examples", ()), *task.eval_examples]  # a built-in stream: its eval split
    lengths = [encoder.length(e) for e in examples]
    over = [n for n in lengths if n > budget]
    if over:
        raise ConfigError(
            f"{len(over)} of the {len(lengths)} prompts are longer than the {budget} tokens that the model's {limit} "
            f"positions leave beside rollout.max_completion_length={length} (the longest: {max(over)}): set "
            f"data.max_prompt_length={budget} (data.long_prompts=drop leaves them out, truncate keeps their end)")


def memory_line(config: Config, found: Facts, prepared: Prepared, device: torch.device, model=None) -> str:
    """The start-up line of a process's estimated peak memory (config/memory.py), its prompts at the
    longest the data holds; ConfigError, before any weight loads, where it cannot fit the memory this
    process has (a GPU's, or the machine's shared by its processes; memory.refused)."""
    import os

    from grpokit.config.memory import estimate, fits_line, refused
    from grpokit.models.loading import model_config

    hf = model.config if model is not None else model_config(config.model.name)
    task = prepared.task  # a dataset's rows, or a generated stream's first ones (an environment's reset: one)
    listed = getattr(task, "train_examples", None)
    read = listed[:256] if listed is not None else itertools.islice(
        task.train_stream(), 1 if getattr(task, "prompts_from_reset", False) else 64)
    examples = [*read, *task.eval_examples]
    longest = max((prepared.encoder.length(e) for e in examples), default=None)
    launch = dict(world_size=distributed.world_size(), sharded=found.launch.sharding, device=device.type,
                  prompt_tokens=config.data.max_prompt_length or longest)
    estimated = estimate(config, hf, **launch)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type == "cuda":
        memory, whose = torch.cuda.get_device_properties(device).total_memory, "this GPU's memory"
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
        whose = "this machine's memory" + (f" shared by its {local} processes" if local > 1 else "")
    if refused(estimated, memory):
        raise ConfigError(f"{estimated.line()}\n  this run {fits_line(config, hf, memory, **launch)} ({whose})")
    return estimated.line()


def loss_settings(config: Config, model=None) -> LossSettings:
    """The loss's hyperparameters for a run: `config`'s algorithm.* and rollout.is_* (algorithm.kl_estimator null is k3;
    algorithm.router_aux_loss_coef null is `model`'s own, router_balance)."""
    a, r = config.algorithm, config.rollout
    return LossSettings(beta=a.beta, epsilon=a.epsilon, epsilon_high=a.epsilon_high, kl_estimator=a.kl_estimator or "k3",
                        importance_sampling_level=a.importance_sampling_level, delta=a.delta,
                        sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
                        is_level=r.is_level, is_mode=r.is_mode, is_cap=r.is_cap, is_min=r.is_min,
                        entropy_coef=a.entropy_coef, distill_coef=config.distill.coef,
                        router_aux_loss_coef=router_balance(config, model)[0])


def router_balance(config: Config, model=None) -> tuple[float, tuple[int, int] | None]:
    """The load-balancing loss's weight in a run of `model` (algorithm.router_aux_loss_coef, null: the
    model config's router_aux_loss_coef where it has output_router_logits, as TRL; else 0), and, when
    it is on, (experts, experts each token is routed to) (None when off). StartupError: a weight set
    for a model whose routers grpokit cannot read."""
    from grpokit.models.routers import routed_choices, router_modules

    routed = None if model is None else routed_choices(model.config)
    if routed and not router_modules(model)[0]:  # it has output_router_logits, but no router it records
        routed = None
    coef = config.algorithm.router_aux_loss_coef
    if coef is None:
        coef = getattr(model.config.get_text_config(decoder=True), "router_aux_loss_coef", 0.0) if routed else 0.0
    if coef and not routed and model is not None:
        raise StartupError(f"algorithm.router_aux_loss_coef={coef}: {type(model).__name__} records no routers' logits "
                           "for a load-balancing loss: leave it null or 0")
    return coef, routed if coef and routed else None


def micro_batch_tokens(config: Config, vision: bool) -> int | str | None:
    """The passes' packing budget (models/logprobs.py LogProbs): train.micro_batch_tokens; by
    default, with neither micro-batch setting given, a text model's picks per step by its
    lengths (packing.AUTO); train.micro_batch_size given (or images, which packed rows do not
    carry): padded micro-batches."""
    t = config.train
    if t.micro_batch_tokens is None and t.micro_batch_size is None and not vision:
        return AUTO
    return t.micro_batch_tokens


def make_kind(config: Config, prepared: Prepared, model) -> RolloutKind:
    """The run's rollout kind (multiturn/kinds.py), for `model` (its EOS ids end a turn)."""
    return kinds.make_kind(config, prepared.tokenizer, prepared.tools, prepared.encoder,
                           eos_token_ids(model, prepared.tokenizer))


def served_engine(model_name: str, engine_name: str, dtype: str, tensor_parallel_size: int = 1,
                  data_parallel_size: int = 1, decode_slots: int | None = None, quantization: str = "none") -> tuple:
    """What `grpokit serve` serves: (engine, the model's fingerprint, tokenizer, EOS ids), the
    engine a ServedEngine (rollout/protocols.py) of `model_name` in `dtype`: the transformers
    engine (decode_slots: rollout.decode_slots; quantization: model.quantization, the base a QLoRA
    trainer pushes its adapters to), or vLLM on tensor_parallel_size x data_parallel_size GPUs."""
    from grpokit.rollout.weights import fingerprint

    tokenizer, vision = processing(model_name)
    if engine_name == "vllm":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from grpokit.models.loading import DTYPES
        from grpokit.rollout.vllm_engine import DataParallelVLLM, VLLMEngine, model_path

        path = model_path(model_name)
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):  # names and shapes only, for the fingerprint
            auto = AutoModelForCausalLM if vision is None else AutoModelForImageTextToText
            shapes = auto.from_config(config, dtype=DTYPES[dtype])
        eos = eos_token_ids(shapes, tokenizer)
        args = dict(model_path=path, dtype=dtype, pad_id=tokenizer.pad_token_id, eos_ids=eos, vision=vision)
        engine = VLLMEngine(**args, tensor_parallel_size=tensor_parallel_size) if data_parallel_size == 1 else \
            DataParallelVLLM(data_parallel_size, tensor_parallel_size, **args)
        return engine, fingerprint(shapes), tokenizer, eos
    if engine_name == "transformers":
        from grpokit.rollout.transformers_engine import TransformersEngine

        # requires_grad stays on, as on the trainer's policy: PyTorch runs other CPU kernels for
        # parameters without it (measured: log-probs differ in the last bits), and the server must
        # sample exactly as the trainer's own engine would. Generation runs under no_grad anyway.
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(model_name, dtype, quantization, device)
        model = (model if quantization != "none" else model.to(device)).eval()  # (a quantized one loads in place)
        fit_for_passes(model)  # the passes the trainer's policy runs, kernel for kernel
        eos = eos_token_ids(model, tokenizer)
        engine = TransformersEngine(model, tokenizer.pad_token_id, eos, vision=vision, slots=decode_slots)
        return engine, fingerprint(model), tokenizer, eos
    raise StartupError(f"grpokit serve has no way to build the {engine_name!r} engine: use transformers or vllm")
