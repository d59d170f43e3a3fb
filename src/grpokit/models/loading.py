"""Loading a model by `model.name` (the bundled and tiny ones of bundled.py, a local folder or a
Hub id), its tokenizer or a vision-language model's processor; the policy (and, when beta > 0, the
reference model) with LoRA, frozen parts and activation checkpointing; saving a model folder.
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from grpokit.models.bundled import (BUNDLED, BUNDLED_VLM, TINY, TINY_VLM, bundled_model_path, bundled_tokenizer,
                                    bundled_vlm_path, cached_folder, over_the_same_read, tiny_config, tiny_random,
                                    tiny_random_vlm, tiny_vlm_processor)
from grpokit.runtime.errors import StartupError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@contextmanager
def _loading(name: str):
    """Turn a failure to load `model.name` into one start-up message naming it."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        raise StartupError(
            f"model.name={name!r} could not be loaded: {e}\n"
            f"  model.name is '{BUNDLED}', '{TINY}', a local model folder, or a Hub id (which needs internet)"
        ) from None


def check_source(name: str) -> None:
    """A `model.name` that is a local path must be a model folder: say what it is instead when it
    is not (a missing path, a run folder, a folder without config.json) rather than let it be
    taken for a Hub id."""
    if name in (BUNDLED, TINY, TINY_VLM, BUNDLED_VLM):
        return
    path = Path(name).expanduser()
    local = path.is_absolute() or name.startswith((".", "~")) or name.count("/") != 1 or Path(name.split("/")[0]).is_dir()
    if not path.exists():
        if local:
            raise StartupError(f"model.name={name!r}: no such folder")
        return  # a Hub id
    if not path.is_dir():
        raise StartupError(f"model.name={name!r} is a file: give the model's folder (the one holding config.json)")
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return
    if (path / "final").is_dir() or (path / "checkpoints").is_dir():
        raise StartupError(f"model.name={name!r} is a training run's folder: its trained model is {path / 'final'} "
                           f"(or a checkpoint, {path / 'checkpoints'}/step-N)")
    raise StartupError(f"model.name={name!r} has no config.json: not a model folder (for a training run, use <run>/final)")


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



def with_pad_token(tokenizer):
    if tokenizer.pad_token_id is None:
        # Padding is always masked explicitly; the pad id's value never decides what is a token.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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




def load_model(name: str, dtype: str = "float32"):
    """The causal LM for `model.name`, in `dtype`, in train mode. A folder holding a LoRA adapter
    (a LoRA run's final/ or checkpoint) loads as its base model with the adapter merged in."""
    from transformers import AutoModelForCausalLM

    torch_dtype = DTYPES[dtype]
    adapter = Path(name) / "adapter_config.json"
    if adapter.is_file():  # a plain model from here on: evaluation, merging, or training from it
        from peft import PeftModel

        base = load_model(json.loads(adapter.read_text())["base_model_name_or_path"], dtype)
        return PeftModel.from_pretrained(base, name).merge_and_unload().train()
    if name == TINY:
        model = tiny_random(bundled_tokenizer(), torch_dtype)  # read only: no copy
    elif name == TINY_VLM:
        model = tiny_random_vlm(torch_dtype)
    elif is_vision_model(name):
        from transformers import AutoModelForImageTextToText

        with _loading(name):
            source = bundled_vlm_path() if name == BUNDLED_VLM else name
            model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch_dtype)
    else:
        with _loading(name):
            source = bundled_model_path() if name == BUNDLED else name
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    model.train()
    return model


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's and the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token: completions could never stop")
    return ids


def apply_lora(model, m, base_name: str):
    """`model` with LoRA adapters of config section `m` (model.lora_*) through peft: only the
    adapters train. `base_name` is recorded in the adapter's config so the adapter folder loads."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise StartupError("model.lora_rank > 0 needs peft: pip install 'grpokit[lora]'") from None
    # "all-linear": peft's name for every linear layer but the output layer; of a vision-language
    # model, every linear layer of its language model (each by its full name).
    targets = m.lora_target_modules if m.lora_target_modules == "all-linear" else [
        t.strip() for t in m.lora_target_modules.split(",") if t.strip()]
    if targets == "all-linear" and vision_tower(model) is not None:
        decoder = model.get_decoder()
        prefix = next(name for name, module in model.named_modules() if module is decoder)
        targets = [f"{prefix}.{name}" for name, module in decoder.named_modules() if isinstance(module, torch.nn.Linear)]
    if "lm_head" in targets and getattr(model.config, "tie_word_embeddings", False):
        raise StartupError("model.lora_target_modules includes lm_head, whose weight this model ties to its input "
                           "embeddings: adapt the other layers")
    config = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, target_modules=targets,
                        task_type="CAUSAL_LM")
    try:
        model = get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module the model does not have
        raise StartupError(f"model.lora_target_modules={m.lora_target_modules}: {e}") from None
    # peft records the model's own path; grpokit's model.name (a built-in name too) is what loads it,
    # a local folder by its absolute path (the adapter may be loaded from anywhere).
    model.peft_config["default"].base_model_name_or_path = (
        str(Path(base_name).resolve()) if Path(base_name).is_dir() else base_name)
    return model


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


def _freeze(policy, m) -> None:
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
    (name, tensor) pairs to write instead of the model's own (a sharded model's, gathered)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # no "Writing model shards" bar under the run's own
    if not torch.cuda.is_available():
        # save_pretrained imports DeepSpeed where it is installed (accelerate unwraps a DeepSpeed
        # engine), which then warns it found no GPU and is "Setting accelerator to CPU": say so first.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        if hasattr(model, "peft_config"):  # the adapters alone; embeddings are not adapted, no Hub lookup to check
            model.save_pretrained(folder, save_embedding_layers=False)
        else:
            model.save_pretrained(folder, state_dict=None if weights is None else dict(weights))
        tokenizer.save_pretrained(folder)
    finally:
        if shown:
            logging.enable_progress_bar()


def load_policy(config, device: torch.device, model=None):
    """The policy (`model`, or model.name's) on `device`, the same on every process, and the
    reference model (None without a KL term, and with LoRA)."""
    from grpokit.models.logprobs import check_chunkable
    from grpokit.runtime import distributed

    m = config.model
    policy = (load_model(m.name, m.dtype) if model is None else model.train()).to(device)
    distributed.broadcast_parameters(policy)
    # The reference model is the initial policy, so it is copied before a checkpoint's weights
    # are loaded. With LoRA it is the policy itself with its adapters switched off: no second
    # copy of the weights.
    reference = None
    if m.lora_rank:
        policy = apply_lora(policy, m, m.name)
        distributed.broadcast_parameters(policy)  # the adapters' random initialisation
    elif config.algorithm.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    _freeze(policy, m)
    if m.gradient_checkpointing:  # after the reference copy, which never trains
        enable_activation_checkpointing(policy)
    if config.train.logprob_chunk_size:  # asked for: a model whose head does more is refused (null decides itself)
        try:
            check_chunkable(policy)
        except ValueError as e:
            raise StartupError(str(e)) from None
    return policy, reference
