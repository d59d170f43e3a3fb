"""Settings that one variant alone reads (VARIANT_SETTINGS): set away from its default while the
variant is off, such a setting is refused (checks.py), never silently ignored; `reset_unused` puts
them back for `grpokit eval` with other settings than the run's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpokit.settings.schema import Config, setting


@dataclass(frozen=True)
class Variant:
    """A part of the run that some settings belong to: they are read only while it is on."""

    switch: str  # the setting that turns it on
    on: Callable[[Config], bool]  # whether a config has it on
    turn_on: str | Callable[[], str]  # what to set to turn it on (a callable: read from a registry when asked)
    effect: str = "does not use it"  # what the switch, as it is, does to the variant's settings

    def problem(self, config: Config, key: str) -> str:
        """The message refusing `key`, set while this variant is off in `config`."""
        value = setting(config, key)
        shown = "" if isinstance(value, (list, dict)) else f"={show(value)}"  # a list is not repeated
        turn_on = self.turn_on() if callable(self.turn_on) else self.turn_on
        return (f"{key}{shown} is set but {self.switch}={show(setting(config, self.switch))} {self.effect}: set "
                f"{turn_on} or remove {key}")


def has_tools(c: Config) -> bool:
    """Whether the run has tools (rollout.tools, or the task's own when null) or an environment, as
    Tools.from_config decides."""
    from grpokit.tasks.registry import tool_names

    return bool(tool_names(c.rollout, c.data)) or c.rollout.environment is not None


def _read_by_loss(name: str) -> Variant:
    """The losses whose objective reads LossSettings' `name` (loss.Loss.reads)."""

    def on(c: Config) -> bool:
        from grpokit.algorithm.loss import LOSSES

        loss = LOSSES.get(c.algorithm.loss_type)  # unknown (a name not registered, a plain function): it may read it
        return not hasattr(loss, "reads") or name in loss.reads

    def turn_on() -> str:
        from grpokit.algorithm.loss import LOSSES

        first, *others = [n for n, loss in LOSSES.items() if name in getattr(loss, "reads", ())] or ["?"]
        return f"algorithm.loss_type={first}" + (f" (or {', '.join(others)})" if others else "")

    return Variant("algorithm.loss_type", on, turn_on)


_LORA = Variant("model.lora_rank", lambda c: c.model.lora_rank > 0, "model.lora_rank > 0")
# (quantized weights are fixed codes: only adapters beside them can train)
_QLORA = Variant("model.lora_rank", lambda c: c.model.lora_rank > 0, "model.lora_rank > 0 (QLoRA: LoRA's adapters "
                 "train on the quantized base)", "trains every weight, which quantized weights cannot")
_PROMPT_LIMIT = Variant("data.max_prompt_length", lambda c: c.data.max_prompt_length is not None,
                        "data.max_prompt_length (in tokens)")
_SERVER = Variant("rollout.engine", lambda c: c.rollout.engine == "server", "rollout.engine=server")
_VLLM = Variant("rollout.engine", lambda c: c.rollout.engine == "vllm", "rollout.engine=vllm")
_TRANSFORMERS = Variant("rollout.engine", lambda c: c.rollout.engine == "transformers", "rollout.engine=transformers")


def _nothing_to_correct(c: Config) -> bool:
    """Whether rollout.engine's class says its log-probs are the trainer's own and it does not
    generate ahead: the rollout importance weight would be exactly 1 (a server's say so only once
    connected: they may need it)."""
    from grpokit.engines.protocols import ENGINES, engine_class

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
        shown = f"{key}={show(setting(config, key))}"
        exact = (f"rollout.engine={config.rollout.engine} samples with the trainer's own code, so the rollout "
                 "importance weight has nothing to correct")
        if config.rollout.is_correction:
            return f"{shown} is set but {exact}: use rollout.engine=vllm or a server, or remove {key}"
        if not _nothing_to_correct(config):
            return super().problem(config, key)
        return (f"{shown} is set but rollout.is_correction=false, and {exact}: set rollout.is_correction=true and "
                f"rollout.engine=vllm (or a server), or remove {key}")


_CORRECTION = _Correction("rollout.is_correction", _corrected, "rollout.is_correction=true")
_TOOLS = Variant("rollout.tools", has_tools,
                 "rollout.tools (or rollout.environment, or a data.task with tools of its own)")
_CALLS = Variant("rollout.tools", lambda c: has_tools(c) or c.rollout.agent is not None,
                 "rollout.tools, rollout.environment or rollout.agent (a data.task with tools of its own)")
_PARTIAL = Variant("rollout.partial", lambda c: c.rollout.partial, "rollout.partial=true")
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
    "model.lora_target_parameters": _LORA,
    "model.quantization": _QLORA,
    "data.long_prompts": _PROMPT_LIMIT,
    "rollout.server_url": _SERVER,
    "rollout.server_timeout": _SERVER,
    "rollout.vllm_gpu_memory_utilization": _VLLM,
    "rollout.vllm_sleep": _VLLM,
    "rollout.decoder": _TRANSFORMERS,
    "rollout.decode_slots": _TRANSFORMERS,
    "rollout.is_level": _CORRECTION,
    "rollout.is_mode": _CORRECTION,
    "rollout.is_cap": _CORRECTION,
    "rollout.is_min": _CORRECTION,
    "rollout.max_turns": _TOOLS,
    "rollout.tool_call_format": _CALLS,
    "rollout.tool_timeout": _TOOLS,
    "rollout.agent_timeout": Variant("rollout.agent", lambda c: c.rollout.agent is not None,
                                     "rollout.agent=<module:function>"),
    "rollout.max_sampling_rounds": _DYNAMIC,
    "rollout.in_flight_updates": Variant("rollout.max_staleness", lambda c: c.rollout.max_staleness > 0,
                                         "rollout.max_staleness >= 1"),
    "rollout.partial_tokens": _PARTIAL,
    "rollout.partial_spare": _PARTIAL,
    "rollout.partial_max_lag": _PARTIAL,
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
            if (every or setting(config, key) != setting(defaults, key)) and not variant.on(config)]


def reset_unused(config: Config, keep: set[str] = frozenset()) -> None:
    """Put back at their defaults the settings of variants that `config` has off, but those in
    `keep`: a run's config.yaml given other settings to evaluate with (data.task=arithmetic after a
    calculator run), whose settings of the variants they switch off nothing reads."""
    defaults = Config()
    for key in unused_settings(config):
        if key not in keep:
            section, name = key.split(".")
            setattr(getattr(config, section), name, setting(defaults, key))


def show(value: Any) -> str:
    """A value as the user writes it: null, true, 0 (a float without a fraction), a list in brackets."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return f"[{', '.join(map(str, value))}]"
    return str(value)
