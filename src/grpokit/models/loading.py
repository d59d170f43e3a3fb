"""Loading a model by `model.name` (the bundled and tiny ones of bundled.py, a local folder or a
Hub id), its tokenizer or a vision-language model's processor; the policy (and, when beta > 0, the
reference model) with LoRA, frozen parts and activation checkpointing; saving a model folder.
"""

from __future__ import annotations

import contextvars
import copy
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from grpokit.models.bundled import (BUNDLED, BUNDLED_VLM, TINY, TINY_VLM, bundled_model_path, bundled_tokenizer,
                                    bundled_vlm_path, cached_folder, over_the_same_read, tiny_config, tiny_model_path,
                                    tiny_random, tiny_random_vlm, tiny_vlm_processor)
from grpokit.models.pad_token import with_pad_token
from grpokit.models.routers import quiet_routers, router_modules
from grpokit.runtime.errors import StartupError
from grpokit.settings.schema import ModelConfig

# bitsandbytes, where installed, is imported by transformers and peft whether or not a model is
# quantized, and warns on import, where the CPU has AVX-512 BF16, that an optional faster kernel from
# the Hub is absent; its own kernel runs instead (and is the one grpokit keeps: fit_for_passes).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


# The setting that named the model being read (`naming`): its failures say it.
_SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("setting", default="model.name")


@contextmanager
def naming(setting: str):
    """Within it, a model that cannot be read is reported as `setting`'s (distill.teacher), not model.name's."""
    token = _SETTING.set(setting)
    try:
        yield
    finally:
        _SETTING.reset(token)


@contextmanager
def _loading(name: str):
    """Turn a failure to load `model.name` (or the setting `naming` says) into one start-up message naming it."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        setting = _SETTING.get()
        raise StartupError(
            f"{setting}={name!r} could not be loaded: {e}\n"
            f"  {setting} is '{BUNDLED}', '{TINY}', a local model folder, or a Hub id (which needs internet)"
        ) from None


def check_source(name: str) -> None:
    """A `model.name` (or the setting `naming` says names another model: distill.teacher) that is a
    local path must be a model folder: say what it is instead when it is not (a missing path, a run
    folder, a folder without config.json) rather than let it be taken for a Hub id."""
    setting = _SETTING.get()
    if name in (BUNDLED, TINY, TINY_VLM, BUNDLED_VLM):
        return
    path = Path(name).expanduser()
    local = path.is_absolute() or name.startswith((".", "~")) or name.count("/") != 1 or Path(name.split("/")[0]).is_dir()
    if not path.exists():
        if local:
            raise StartupError(f"{setting}={name!r}: no such folder")
        return  # a Hub id
    if not path.is_dir():
        raise StartupError(f"{setting}={name!r} is a file: give the model's folder (the one holding config.json)")
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return
    if (path / "final").is_dir() or (path / "checkpoints").is_dir():
        raise StartupError(f"{setting}={name!r} is a training run's folder: its trained model is {path / 'final'} "
                           f"(or a checkpoint, {path / 'checkpoints'}/step-N)")
    raise StartupError(f"{setting}={name!r} has no config.json: not a model folder (for a training run, use <run>/final)")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == TINY_VLM or is_vision_model(name):
        return load_processor(name).tokenizer
    if name in (BUNDLED, TINY):  # (tiny_vlm_processor adds tokens to a deep copy of its own)
        with _loading(name):
            read = bundled_tokenizer()
            return over_the_same_read(read, read)
    check_source(name)
    with _loading(name):
        tokenizer = AutoTokenizer.from_pretrained(name)
    return with_pad_token(tokenizer)



def is_vision_model(name: str) -> bool:
    """Whether model.name is a vision-language model (its config has a vision part)."""
    if name in (BUNDLED, TINY):
        return False
    if name in (TINY_VLM, BUNDLED_VLM):
        return True
    if (Path(name) / "adapter_config.json").is_file():
        return is_vision_model(json.loads((Path(name) / "adapter_config.json").read_text())["base_model_name_or_path"])
    from transformers import AutoConfig

    check_source(name)
    with _loading(name):
        return getattr(AutoConfig.from_pretrained(name), "vision_config", None) is not None


def model_config(name: str, local_only: bool = False):
    """The transformers config of model.name `name`, read without its weights (what the start-up
    checks know of a model); StartupError naming it when it cannot be read. `local_only`: None
    for a model not on this machine yet (a Hub id not downloaded, the bundled models not converted
    yet) rather than fetch or build it."""
    from transformers import AutoConfig

    if name in (TINY, TINY_VLM):
        return tiny_config(vision=name == TINY_VLM)
    adapter = Path(name) / "adapter_config.json"
    if adapter.is_file():
        return model_config(json.loads(adapter.read_text())["base_model_name_or_path"], local_only)
    if name in (BUNDLED, BUNDLED_VLM):
        if local_only and not (cached_folder(name) / "config.json").is_file():
            return None
        return AutoConfig.from_pretrained(bundled_model_path() if name == BUNDLED else bundled_vlm_path())
    check_source(name)
    try:
        with _loading(name):
            return AutoConfig.from_pretrained(name, local_files_only=local_only)
    except StartupError:
        if local_only and not Path(name).exists():  # a Hub id not downloaded yet
            return None
        raise


def load_processor(name: str):
    """The processor (tokenizer and image processor) of vision-language model.name `name`."""
    if name == TINY_VLM:
        return tiny_vlm_processor()
    from transformers import AutoProcessor

    if name == BUNDLED_VLM:
        name = str(bundled_vlm_path())

    source, adapter = name, Path(name) / "adapter_config.json"
    if adapter.is_file() and not (Path(name) / "processor_config.json").is_file():  # a LoRA folder saved without it
        source = json.loads(adapter.read_text())["base_model_name_or_path"]
    with _loading(name):
        processor = AutoProcessor.from_pretrained(source)
    with_pad_token(processor.tokenizer)
    return processor




def load_model(name: str, dtype: str = "float32", quantization: str = "none", device: torch.device | None = None):
    """The causal LM for `model.name`, in `dtype`, in train mode. A folder holding a LoRA adapter
    (a LoRA run's final/ or checkpoint) loads as its base model with the adapter merged in (on a
    quantized base: into its weights as the adapters saw them, dequantized). `quantization`
    (model.quantization) loads the weights quantized, onto `device`."""
    torch_dtype = DTYPES[dtype]
    adapter = Path(name) / "adapter_config.json"
    if adapter.is_file():  # a plain model from here on: evaluation, merging, or training from it
        base = load_model(json.loads(adapter.read_text())["base_model_name_or_path"], dtype, saved_quantization(name))
        if is_quantized(base):
            base = base.dequantize()
        return load_adapter(base, name).merge_and_unload().train()
    if quantization != "none":
        model = _load_quantized(name, torch_dtype, quantization, device or torch.device("cpu"))
    elif name == TINY:
        model = tiny_random(bundled_tokenizer(), torch_dtype)  # read only: no copy
    elif name == TINY_VLM:
        model = tiny_random_vlm(torch_dtype)
    else:
        with _loading(name):
            model = _model_class(name).from_pretrained(_source(name), dtype=torch_dtype)
    fit_for_passes(model)
    model.train()
    return model


def _model_class(name: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(name) else AutoModelForCausalLM


def _source(name: str) -> str | Path:
    """What from_pretrained reads for `model.name`: a built-in model's folder, or the name itself."""
    if name in (TINY, TINY_VLM):
        return tiny_model_path(name)
    return {BUNDLED: bundled_model_path, BUNDLED_VLM: bundled_vlm_path}.get(name, lambda: name)()


def _load_quantized(name: str, dtype: torch.dtype, quantization: str, device: torch.device):
    """model.quantization through bitsandbytes, as transformers loads it: every linear layer of the
    model but its output layer holds 4-bit codes (NF4 or FP4, with QLoRA's double quantization of
    their scales) or int8 (LLM.int8()), computing in `dtype`; placed on `device` as it loads."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise StartupError(f"model.quantization={quantization} needs bitsandbytes: pip install 'grpokit[quantization]'") from None
    from transformers import BitsAndBytesConfig

    settings = (BitsAndBytesConfig(load_in_8bit=True) if quantization == "int8" else
                BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=dtype))
    with _loading(name):
        return _model_class(name).from_pretrained(_source(name), dtype=dtype, quantization_config=settings,
                                                  device_map={"": device})


def is_quantized(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "is_quantized", False)


def quantization_of(model) -> str:
    """The model.quantization `model` was loaded with ("none" when it was not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_quantized(base):
        return "none"
    settings = base.config.quantization_config
    settings = settings.to_dict() if hasattr(settings, "to_dict") else settings
    return "int8" if settings.get("load_in_8bit") else settings["bnb_4bit_quant_type"]


# An adapter folder of a quantized base says so in this file: the base it loads onto.
QUANTIZATION_FILE = "grpokit_quantization.json"


def saved_quantization(folder: str | Path) -> str:
    path = Path(folder) / QUANTIZATION_FILE
    return json.loads(path.read_text())["quantization"] if path.is_file() else "none"


def load_adapter(base, folder: str):
    """`base` under the LoRA adapter saved in `folder` (peft's PeftModel, not merged), its modules
    named as they were when it was made (_names_as_given)."""
    from peft import PeftModel

    targets = json.loads((Path(folder) / "adapter_config.json").read_text()).get("target_modules") or []
    with _names_as_given(base, [] if isinstance(targets, str) else list(targets)):
        return PeftModel.from_pretrained(base, folder)


def fit_for_passes(model) -> None:
    """What grpokit sets on a loaded model before its passes: a quantized model's 4-bit layers keep
    the kernel that has a backward; a float64 model's mixture-of-experts
    layers run transformers' eager loop over the experts (the default grouped kernel,
    torch._grouped_mm, has no float64 kernel); the model's forward returns no router logits
    (models/routers.py reads them where the load-balancing loss needs them)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes' 4-bit layers on a CPU with AVX-512 BF16 repack their weights for a faster
            # kernel the first time they run in eval mode, and keep that kernel in training, where it
            # has no backward: gradients would not flow through them. One kernel for every pass.
            module.support_avx512bf16_for_cpu = False
    implementations = getattr(model, "get_experts_implementation", lambda: {})()
    if model.dtype == torch.float64 and "grouped_mm" in implementations.values():
        model.set_experts_implementation("eager")
    quiet_routers(model)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's and the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token: completions could never stop")
    return ids


def apply_lora(model, m: ModelConfig, base_name: str):
    """`model` with LoRA adapters of config section `m` (model.lora_*) through peft: only the
    adapters train. `base_name` is recorded in the adapter's config so the adapter folder loads."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise StartupError("model.lora_rank > 0 needs peft: pip install 'grpokit[lora]'") from None
    modules = lora_modules(model, m.lora_target_modules)
    parameters = lora_parameters(model, m.lora_target_parameters)
    if getattr(model.config, "tie_word_embeddings", False) and any(t.split(".")[-1] == "lm_head" for t in modules):
        raise StartupError("model.lora_target_modules includes lm_head, whose weight this model ties to its input "
                           "embeddings: adapt the other layers")
    config = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, target_modules=modules,
                        target_parameters=parameters or None, task_type="CAUSAL_LM")
    try:
        with _names_as_given(model, modules):
            model = get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module the model does not have
        raise StartupError(f"model.lora_target_modules={m.lora_target_modules}, model.lora_target_parameters="
                           f"{m.lora_target_parameters!r}: {e}") from None
    # peft records the model's own path; grpokit's model.name (a built-in name too) is what loads it,
    # a local folder by its absolute path (the adapter may be loaded from anywhere).
    model.peft_config["default"].base_model_name_or_path = (
        str(Path(base_name).resolve()) if Path(base_name).is_dir() else base_name)
    return model


def adapter_settings(model) -> dict:
    """A LoRA model's adapter settings (peft's LoraConfig) as JSON: what another process needs to
    put the same adapters on the same base (`with_adapters`), so that only their tensors travel."""
    settings = model.peft_config["default"].to_dict()
    settings.pop("peft_type", None)  # (implied: LoraConfig)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in settings.items()}


def with_adapters(base, settings: dict):
    """`base` under fresh LoRA adapters made from `adapter_settings` (their values to be loaded)."""
    from peft import LoraConfig, get_peft_model

    targets = settings.get("target_modules") or []
    with _names_as_given(base, [] if isinstance(targets, str) else list(targets)):
        return get_peft_model(base, LoraConfig(**settings))


def lora_modules(model, setting: str) -> list[str]:
    """The modules model.lora_target_modules = `setting` names: for "all-linear", every linear
    layer (peft's: torch's Linear, transformers' Conv1D) of the language model but the output layer
    and a mixture of experts' routers (lora_parameters' "router"), by its full name; else the names given."""
    from transformers.pytorch_utils import Conv1D

    if setting != "all-linear":
        return [t.strip() for t in setting.split(",") if t.strip()]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    inside = {id(module) for module in decoder.modules()} - {id(m) for _, m in router_modules(model)[0]}
    return [name for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and id(module) in inside and module is not head]


def lora_parameters(model, setting: str) -> list[str]:
    """The parameters model.lora_target_parameters = `setting` names, as peft's target_parameters:
    "experts" is every routed expert's weights (the 3-D parameters of transformers' experts
    modules), "router" each router's weight (the module the model records router logits from)."""
    names = []
    for word in (t.strip() for t in setting.split(",") if t.strip()):
        if word == "experts":
            found = [f"{name}.{p}" for name, module in model.named_modules() if hasattr(module, "_is_expert_parallel")
                     for p, w in module.named_parameters(recurse=False) if w.dim() == 3]
        elif word == "router":
            found = [f"{name}.weight" for name, _ in router_modules(model)[0]]
        else:
            found = [word]
        if not found:
            raise StartupError(f"model.lora_target_parameters={setting!r}: this model has no {word} (it is not a "
                               "mixture-of-experts model transformers' experts layers run)")
        names += found
    return names


@contextmanager
def _names_as_given(model, modules: list[str]):
    """peft renames, on the mixture-of-experts models whose experts transformers 5 fused, the MLP
    module names of adapters trained under transformers 4 (gate_proj, up_proj, down_proj) to the
    fused experts' parameters. On DeepSeek-V3 and GLM-4-MoE, whose dense MLP and shared experts
    bear those names, that took their adapters away. grpokit names the modules of the model as it
    is: where a name of `modules` names an existing linear layer that would be renamed, peft's
    renaming is off while these adapters are made or loaded (an adapter of transformers 4 names
    modules the model no longer has, and is renamed as peft means to)."""
    import peft.tuners.tuners_utils as tuners
    import peft.utils.save_and_load as save_and_load

    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    renamed = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
    # (a saved adapter names its modules by their shortest distinct suffixes: "gate_proj")
    if not any(t.rsplit(".", 1)[-1] in renamed and any(n == t or n.endswith("." + t) for n in linear) for t in modules):
        yield
        return
    before = tuners.is_transformers_ge_v5, save_and_load.is_transformers_ge_v5
    tuners.is_transformers_ge_v5 = save_and_load.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        tuners.is_transformers_ge_v5, save_and_load.is_transformers_ge_v5 = before


def vision_tower(model) -> torch.nn.Module | None:
    """A vision-language model's vision encoder (Idefics3's vision_model, Qwen's visual, Gemma 3's
    vision_tower), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    for name in ("vision_model", "visual", "vision_tower"):
        module = getattr(inner, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def _freeze(policy, m: ModelConfig) -> None:
    """model.freeze_vision_tower: the vision encoder keeps its weights; model.freeze_language_model:
    the language model (its decoder and output layer) does. A text model has neither to freeze."""
    for setting, frozen in (("freeze_vision_tower", lambda: [vision_tower(policy)]),
                            ("freeze_language_model", lambda: [policy.get_decoder(), policy.get_output_embeddings()])):
        if getattr(m, setting):
            if vision_tower(policy) is None:
                raise StartupError(f"model.{setting}=true, but {m.name} is a text model (it has no vision encoder)")
            for module in frozen():
                module.requires_grad_(False)


def merge_adapter(folder: Path, dtype: str) -> Path:
    """`grpokit train --merge`: <folder>/merged, the base model with the LoRA adapter of `folder`
    merged into its weights (a plain Hugging Face folder, no peft needed to load it)."""
    save_model(load_model(str(folder), dtype), load_tokenizer(str(folder)), Path(folder) / "merged")
    return Path(folder) / "merged"


def enable_activation_checkpointing(model) -> None:
    """model.gradient_checkpointing: transformers' per-layer checkpointing, non-reentrant (it
    supports inputs that need no gradient and keyword arguments)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def save_model(model, tokenizer, folder: Path, weights: list | None = None) -> None:
    """Write a Hugging Face folder (weights, config, tokenizer, chat template) into `folder`; the
    caller makes it atomic (rundir/checkpoint.py writes into a temporary folder and renames it). `weights`:
    (name, tensor) pairs to write instead of the model's own (a sharded model's, gathered; a LoRA
    model's adapters under the peft model's names)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # no "Writing model shards" bar under the run's own
    if not torch.cuda.is_available():
        # save_pretrained imports DeepSpeed where it is installed (accelerate unwraps a DeepSpeed
        # engine), which then warns it found no GPU and is "Setting accelerator to CPU": say so first.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        if hasattr(model, "peft_config"):  # the adapters alone; embeddings are not adapted, no Hub lookup to check
            given = {} if weights is None else {"state_dict": dict(weights)}
            model.save_pretrained(folder, save_embedding_layers=False, **given)
            if is_quantized(model):
                (Path(folder) / QUANTIZATION_FILE).write_text(json.dumps({"quantization": quantization_of(model)}) + "\n")
        else:
            model.save_pretrained(folder, state_dict=None if weights is None else dict(weights))
        tokenizer.save_pretrained(folder)
    finally:
        if shown:
            logging.enable_progress_bar()


def load_policy(m: ModelConfig, device: torch.device, model=None, reference: bool = False, chunked: bool = False):
    """The policy (`model`, or model.name's) on `device`, the same on every process, and with
    `reference` (a KL term: algorithm.beta > 0) the reference model (None otherwise, and with
    LoRA). `chunked`: train.logprob_chunk_size is set, which a model whose head does more refuses."""
    from grpokit.models.logprobs import check_chunkable
    from grpokit.runtime import distributed

    if model is None:
        policy = load_model(m.name, m.dtype, m.quantization, device)
        policy = policy if m.quantization != "none" else policy.to(device)  # (a quantized one loads in place)
    else:
        policy = model.train().to(device)
    fit_for_passes(policy)
    distributed.broadcast_parameters(policy)
    # The reference model is the initial policy, so it is copied before a checkpoint's weights
    # are loaded. With LoRA it is the policy itself with its adapters switched off: no second
    # copy of the weights.
    frozen = None
    if m.lora_rank:
        policy = apply_lora(policy, m, m.name)
        distributed.broadcast_parameters(policy)  # the adapters' random initialisation
    elif reference:
        frozen = copy.deepcopy(policy).eval().requires_grad_(False)
    _freeze(policy, m)
    if m.gradient_checkpointing:  # after the reference copy, which never trains
        enable_activation_checkpointing(policy)
    if chunked:  # asked for: a model whose head does more is refused (null decides itself)
        try:
            check_chunkable(policy)
        except ValueError as e:
            raise StartupError(str(e)) from None
    return policy, frozen
