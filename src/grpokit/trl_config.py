"""Coming from TRL: `grpokit.from_trl(GRPOConfig or dict)` gives the grpokit config for a TRL
`GRPOConfig` (TRL 1.16), and the TRL settings it could not carry over, each with the reason.

Every field of GRPOConfig (its own and those it inherits from transformers' TrainingArguments) is
in FIELDS (trl_fields.py), with what becomes of it:
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
(tests/top/test_from_trl.py checks them against TRL's own).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from grpokit.config.loading import load_config
from grpokit.config.variants import unused_settings
from grpokit.runtime.errors import ConfigError
from grpokit.trl_fields import CARRIED_BELOW, FIELDS, FILLED_IN, FromTRLError, _listed, _losses, _normalized_by_update_tokens


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
