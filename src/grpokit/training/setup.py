"""The one place that builds a run's parts: `build(config, use)` for `grpokit train` (Trainer),
`grpokit eval` (api.evaluate) and `grpokit serve` (server.py), each use taking the parts it needs,
so that a new kind of rollout, task or engine is wired once. In order:

    checked_facts(config, ...)  the config settled and every rule checked against the launch and
                                the model, at once (config/checks.py); once for the same values
    prepare(config, ...)        before the model loads: the tokenizer (or a vision-language model's
                                processor), tools, prompts as token ids, the task (its data read and
                                checked) and the reward functions
    train: the sharding strategy, the memory estimate (refused where it cannot fit), the run
           folder, the policy and reference, the teacher, the sampler (its engine and rollout
           kind), the scorer, the optimizer and schedule, the log-prob passes
    eval:  the model evaluated, its engine and rollout kind
    serve: the model served, its engine (ENGINES' class builds it) and fingerprint

An engine is made only through engines/protocols.py's ENGINES.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpokit.algorithm.loss import LossSettings
from grpokit.algorithm.schedule import lr_multiplier
from grpokit.config.checks import Facts, check, facts
from grpokit.config.loading import settle
from grpokit.engines.prompts import PromptEncoder
from grpokit.engines.protocols import engine_class, make_engine
from grpokit.models.loading import eos_token_ids, load_model, load_policy
from grpokit.models.logprobs import LogProbs, check_inputs_embeds, chunk_size
from grpokit.models.packing import AUTO
from grpokit.models.reasoning import Reasoning
from grpokit.models.teacher import load_teacher
from grpokit.models.vision import Vision, check_vision, processing
from grpokit.rewards.reward_set import RewardSet
from grpokit.rollouts import kinds
from grpokit.rollouts.kinds import RolloutKind
from grpokit.rollouts.tools import Tools
from grpokit.rundir.checkpoint import checkpoint_bytes, load_weights
from grpokit.rundir.folder import check_disk_space, open_run_dir, release_run_dir, start_run_dir
from grpokit.runtime import distributed
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.runtime.reach import reach
from grpokit.runtime.threads import share_cores, trainer_processes
from grpokit.sampling.sampler import Sampler
from grpokit.sampling.scoring import Scorer
from grpokit.settings.schema import Config, reward_specs
from grpokit.tasks.registry import make_task
from grpokit.training import sharding

__all__ = ["USES", "Parts", "Prepared", "build", "checked_facts", "loss_settings", "prepare"]

# What `build` builds a run's parts for.
USES = ("train", "eval", "serve")


def checked_facts(config: Config, model=None, tokenizer=None, model_name: str | None = None) -> Facts:
    """Settle `config` (a Config built in Python was not loaded) and check every rule against the
    launch and the model (`model_name`, default model.name, or the loaded `model` given with its
    `tokenizer`): ConfigError listing every problem. The facts checked against. A config loaded
    and checked against the same facts, its values unchanged since, is not settled or checked again."""
    found = facts(config, model_name, model, tokenizer, world_size=distributed.world_size())
    if config.checked == (found, config.to_dict()):
        return found
    settle(config)
    check(config, found)
    config.checked = (found, config.to_dict())
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
    tools = Tools.from_config(config.rollout, config.data, config.model, tokenizer, model_name)
    if vision is not None and (config.model.chat_template or config.model.chat_template_kwargs):
        vision.processor.chat_template = tokenizer.chat_template  # the template prompts are rendered with
    encoder = PromptEncoder(tokenizer, None if tools is None else tools.schemas, config.data.max_prompt_length, vision)
    task = make_task(config.data, config.train.seed, encoder.length, encoder.image_tokens)
    kind = kinds.kind_of(config.rollout, tools)
    if train:
        first = next(task.train_stream())
        if tools is not None:
            tools.check({"prompt": first.prompt, **first.columns}, getattr(task, "prompts_from_reset", False))
    rewards = RewardSet(reward_specs(config, task.reward_functions), config.reward.timeout,
                        extra=kind.rewards(tools), teacher=config.distill.teacher is not None,
                        reasoning=Reasoning.of(config.model.reasoning_parser, tokenizer))
    if train:
        rewards.check_arguments(first.columns, environments=(tools is not None and tools.environment is not None)
                                or config.rollout.agent is not None)
        _check_prompt_lengths(config, task, encoder, None if model_facts is None else model_facts.max_positions)
    return Prepared(tokenizer, vision, tools, encoder, task, rewards)


def judge_urls(config: Config, prepared: Prepared) -> list[tuple[str, float, str]]:
    """The URL, timeout and the setting that gave the URL of each judge among the run's reward
    functions (rewards/judge.py): reward.judge_url, or an entry's own `url`."""
    entries = config.reward.functions or []
    return [(arguments["url"], arguments["timeout"],
             f"reward.functions[{i}].url" if isinstance(entries[i], dict) and "url" in entries[i] else "reward.judge_url")
            for i, (name, _, arguments) in enumerate(reward_specs(config, prepared.task.reward_functions))
            if name == "judge" and arguments.get("url")]


def reach_judges(config: Config, prepared: Prepared) -> None:
    """Each judge answers before the model loads (a GET of its /models, any answer), tried for its
    reward.judge_timeout: StartupError naming the URL otherwise, not a step of failed scores.
    Process 0 asks, and its answer stops every process alike."""
    def ask():
        for url, timeout, setting in judge_urls(config, prepared):
            reach(url, setting, timeout, "/models")

    distributed.on_main(ask)


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


@dataclass
class Parts:
    """A run's parts as `build` makes them for one use; what that use does not need stays None."""

    device: torch.device
    tokenizer: object  # a vision-language model's is its processor's
    vision: Vision | None  # a vision-language model's processor and the inputs of its passes (models/vision.py)
    prepared: Prepared | None = None  # train, eval: the data and rewards (a server reads none)
    facts: Facts | None = None  # train, eval: what the config was checked against
    model: torch.nn.Module | None = None  # train: the policy, as the sharding strategy holds it; eval, serve: the model
    eos_ids: list[int] = field(default_factory=list)
    kind: RolloutKind | None = None  # eval (train: the sampler's)
    engine: object = None  # eval, serve (train: the sampler's own, made with the run's sharding)
    fingerprint: dict | None = None  # serve: the model's names and shapes, which a trainer's must match
    # train:
    parallel: sharding.Strategy | None = None  # replicated, or sharded as the launcher's accelerate config says
    run_dir: Path | None = None
    resume_from: Path | None = None  # the checkpoint the run continues from
    resumed_rows: list[dict] = field(default_factory=list)  # metrics.jsonl's rows kept from before it
    reference: torch.nn.Module | None = None
    teacher: object = None
    sampler: Sampler | None = None  # how a step's completions come to be (their engine and rollout kind)
    scorer: Scorer | None = None
    logprobs: LogProbs | None = None
    params: list = field(default_factory=list)  # the weights the optimizer steps
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    loss_settings: LossSettings | None = None
    checkpoint_size: int = 0  # about the bytes a checkpoint takes
    notes: list[str] = field(default_factory=list)  # what the user hears at start-up


def build(config: Config, use: str, *, model=None, tokenizer=None, model_name: str | None = None,
          tensor_parallel_size: int = 1, data_parallel_size: int = 1) -> Parts:
    """The parts of a run of `config` for `use` (USES): "train" (`model`, `tokenizer`: objects to
    train in place and tokenize with instead of model.name's), "eval" (the model in `model_name`),
    "serve" (model.name with rollout.engine, on tensor_parallel_size x data_parallel_size GPUs for
    vLLM). Every rule is checked before anything is read or written."""
    if use == "train":
        return _for_training(config, model, tokenizer)
    if use == "eval":
        return _for_evaluation(config, model_name or config.model.name)
    if use == "serve":
        return _for_serving(config, tensor_parallel_size, data_parallel_size)
    raise ValueError(f"build: use={use!r} is not one of {USES}")


def _for_training(config: Config, model, tokenizer) -> Parts:
    """Every rule about the settings, against the launch and the model, before anything is read or
    written (config/checks.py); then the data and the reward functions (a bad row or name fails
    here), the memory estimate, the output folder, the model, then the disk space a checkpoint of
    it needs."""
    device = distributed.init()
    found = checked_facts(config, model, tokenizer)
    parallel = sharding.from_launch(config, found.launch)
    prepared = prepare(config, tokenizer, model_facts=found.model, model=model)
    reach_judges(config, prepared)
    parts = Parts(device, prepared.tokenizer, prepared.vision, prepared, found, parallel=parallel)
    memory = memory_line(config, found, prepared, device, model)  # refused here when it cannot fit
    # Process 0 alone owns the run directory; the others learn its path (a default one is stamped
    # with process 0's clock) or its refusal, and stop with the same message.
    existed = config.train.output_dir is not None and Path(config.train.output_dir).exists()
    parts.run_dir, parts.resume_from, damaged = distributed.on_main(lambda: open_run_dir(config))
    with _removed_if_refused(parts.run_dir, existed):  # a refused start leaves no empty folder behind
        config.train.output_dir = str(parts.run_dir)
        seed_stream = _seed_everything(config.train.seed)
        _models(config, parts, model)
        # Log-prob passes call the whole model on token ids when only such a call gathers sharded
        # weights, or when the model uses the ids for more than the embedding lookup (models/logprobs.py).
        whole_model = parallel.lockstep or not check_inputs_embeds(parts.model)
        chunk = chunk_size(config.train.logprob_chunk_size, parts.model, device, parts.vision)
        routed = _sampling(config, parts, seed_stream)
        _optimization(config, parts, whole_model, chunk, routed)
        # The metrics.jsonl rows kept from before the checkpoint, and what to tell the user about them.
        parts.resumed_rows, note = distributed.on_main(lambda: _start_run_dir(config, parts))
    parts.notes = [line for line in (*damaged, note, memory, parallel.describe(parts.model),
                                     *getattr(prepared.task, "notes", ())) if line]
    return parts


def _models(config: Config, parts: Parts, model) -> None:
    """The policy, the reference (with a KL term) and the teacher (distill.teacher)."""
    parts.model, parts.reference = load_policy(config.model, parts.device, model, reference=config.algorithm.beta > 0,
                                               chunked=bool(config.train.logprob_chunk_size))
    check_vision(parts.model, parts.vision)
    parts.eos_ids = eos_token_ids(parts.model, parts.tokenizer)
    parts.teacher = None if config.distill.teacher is None else load_teacher(
        config.distill.teacher, config.model.name, parts.tokenizer, config.model.dtype, parts.device,
        config.distill.timeout)


def _sampling(config: Config, parts: Parts, seed_stream: torch.Generator) -> tuple[int, int] | None:
    """The sampler (its engine, made for the whole policy) and the scorer; with a load-balancing
    term, (experts, experts each token is routed to)."""
    kind = _kind(config, parts.prepared, parts.eos_ids)
    parts.sampler = Sampler(config, parts.prepared.task, kind, parts.tokenizer, parts.model, parts.parallel,
                            parts.device, seed_stream, parts.vision)
    balance, routed = router_balance(config, parts.model)  # the load-balancing term's weight, experts
    parts.scorer = Scorer(config, parts.tokenizer, parts.prepared.rewards, parts.sampler.rows, parts.device,
                          parts.parallel.lockstep, balance > 0)
    return routed


def _optimization(config: Config, parts: Parts, whole_model: bool, chunk: int | None,
                  routed: tuple[int, int] | None) -> None:
    """The weights sharded (a checkpoint's loaded first, whole), the optimizer and its schedule, the
    log-prob passes (`whole_model`, `chunk`, `routed`: models/logprobs.py LogProbs) and the loss's
    settings."""
    policy = parts.model
    # Counted while every process holds the whole model.
    parts.checkpoint_size = checkpoint_bytes(policy) + (
        checkpoint_bytes(parts.reference) if config.algorithm.sync_ref_model else 0)
    if parts.resume_from is not None:  # into whole weights, before sharding spreads them
        load_weights(policy, parts.resume_from)
    parts.model, parts.reference = parts.parallel.wrap(policy, parts.reference)
    parts.params = [p for p in parts.model.parameters() if p.requires_grad]
    parts.optimizer, parts.scheduler = _optimizer(config, parts)
    parts.logprobs = LogProbs(parts.model, parts.reference, config.rollout.temperature, chunk,
                              config.model.gradient_checkpointing, whole_model,
                              config.micro_batch_size(distributed.world_size()), parts.device, parts.vision,
                              micro_batch_tokens(config, parts.vision is not None), parts.parallel.lockstep, routed)
    parts.loss_settings = loss_settings(config, parts.model)


def _optimizer(config: Config, parts: Parts):
    """AdamW (fused: one kernel over all weights, where the strategy allows it) and its
    learning-rate schedule (algorithm/schedule.py): linear warm-up over train.warmup_steps updates, then
    train.lr_scheduler over the run's max_steps x updates_per_step x num_iterations updates."""
    t = config.train
    optimizer = parts.parallel.make_optimizer(
        parts.model, parts.params,
        lambda params: torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay,
                                         fused=parts.parallel.fused_adamw))
    total = t.max_steps * config.updates_per_step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: lr_multiplier(t.lr_scheduler, update, t.warmup_steps, total))
    return optimizer, scheduler


def _start_run_dir(config: Config, parts: Parts) -> tuple[list[dict], str | None]:
    """The run folder begun, or continued from its checkpoint (its later metrics rows dropped): the
    rows kept, and what to tell the user of it (process 0)."""
    check_disk_space(parts.run_dir, config, parts.checkpoint_size)
    return start_run_dir(parts.run_dir, config, parts.resume_from)


def _for_evaluation(config: Config, model_name: str) -> Parts:
    """The model in `model_name`, scored on `config`'s held-out prompts: its engine and rollout kind."""
    found = checked_facts(config, model_name=model_name)
    prepared = prepare(config, model_name=model_name, model_facts=found.model, train=False)
    reach_judges(config, prepared)
    if not prepared.task.eval_examples:
        raise ConfigError(f"no held-out prompts to score: data.eval_size={config.data.eval_size} (a run trained "
                          "with data.eval_size=0 keeps that in its config): add data.eval_size=100, or data.eval_path")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(model_name, config.model.dtype).to(device)
    eos = eos_token_ids(model, prepared.tokenizer)
    engine = make_engine(config.rollout, model, prepared.tokenizer, eos, model_name, vision=prepared.vision)
    return Parts(device, prepared.tokenizer, prepared.vision, prepared, found, model, eos,
                 kind=_kind(config, prepared, eos), engine=engine,
                 notes=list(getattr(prepared.task, "notes", ())))


def _for_serving(config: Config, tensor_parallel_size: int, data_parallel_size: int) -> Parts:
    """What `grpokit serve` serves: model.name in model.dtype (model.quantization: the base a QLoRA
    trainer pushes its adapters to) through the engine rollout.engine names, which builds it
    (`served`: the transformers engine decoding at most rollout.decode_slots completions at once, or
    vLLM on tensor_parallel_size x data_parallel_size GPUs)."""
    tokenizer, vision = processing(config.model.name)
    served = engine_class(config.rollout.engine)
    if served.remote:
        raise StartupError(f"grpokit serve cannot serve the {config.rollout.engine!r} engine, which is itself "
                           "another process's: use transformers or vllm")
    engine, model, eos = served.served(config.model, config.rollout, tokenizer, vision,
                                       tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
    from grpokit.engines.weights import fingerprint

    return Parts(engine.device, tokenizer, vision, model=model, eos_ids=eos, engine=engine,
                 fingerprint=fingerprint(model))


def _kind(config: Config, prepared: Prepared, eos_ids: list[int]) -> RolloutKind:
    """The run's rollout kind (rollouts/kinds.py), for a model of EOS ids `eos_ids` (they end a turn)."""
    return kinds.make_kind(config.rollout, prepared.tokenizer, prepared.tools, prepared.encoder, eos_ids,
                           config.model.reasoning_parser)


@contextlib.contextmanager
def _removed_if_refused(run_dir: Path, existed: bool):
    """A start-up refusal inside leaves no folder it created behind (process 0 owns it)."""
    try:
        yield
    except BaseException:
        if not existed and distributed.is_main() and run_dir.is_dir() and not any(run_dir.iterdir()):
            release_run_dir(run_dir)
            run_dir.rmdir()
        raise


def _seed_everything(seed: int) -> torch.Generator:
    """Seed every global RNG, the same on every process (they must start from the same weights);
    return the stream each step draws one sampling seed per completion from, so that what a
    completion samples depends on its seed, not on which process samples it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # reward functions may draw from any global RNG
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
