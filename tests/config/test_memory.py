"""The estimate of a process's peak memory (config/memory.py): each term against what the loaded
model really holds (parameters, LoRA's adapters, quantized weights, the tensors autograd keeps per
token), the fit and its remedies, `grpokit config --check --memory`, and the start-up refusal of a
run that cannot fit, before any weight loads. The estimate against whole runs' measured peaks is
benchmarks/memory.py's (docs/speed-and-memory.md)."""

import os

import pytest
import torch

from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.config.memory import GB, _saved_per_token, estimate, fitting, parse_memory
from grpokit.models.loading import apply_lora, load_model, model_config
from grpokit.runtime.errors import ConfigError
from grpokit.training.trainer import Trainer

TINY = ["model.name=tiny-random", "train.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.max_completion_length=16", "data.max_prompt_length=48"]


def terms(config, **launch):
    return {t.name: t.bytes for t in estimate(config, model_config(config.model.name), **launch).terms}


def test_weights_gradients_and_adamw_are_the_model_s_own():
    model = load_model("tiny-random")
    params = sum(p.numel() for p in model.parameters())
    full = terms(load_config(None, TINY))
    assert full["weights"] == full["gradients"] == params * 4 and full["AdamW state"] == 2 * params * 4
    assert full["reference"] == 0 and terms(load_config(None, [*TINY, "algorithm.beta=0.04"]))["reference"] == params * 4
    bf16 = terms(load_config(None, [*TINY, "model.dtype=bfloat16"]))
    assert bf16["weights"] == params * 2
    # Loading a float32 checkpoint into bfloat16: the file read, the model built beside it.
    assert bf16["checkpoint read"] == params * 4 and bf16["model built"] == params * 2
    assert full["checkpoint read"] == full["model built"] == 0  # taken as read
    # Sharded over 2 processes: half of each.
    assert terms(load_config(None, TINY), world_size=2, sharded="FSDP")["AdamW state"] == params * 4

    lora = load_config(None, [*TINY, "model.lora_rank=8", "model.lora_target_modules=q_proj,v_proj,down_proj"])
    adapted = apply_lora(load_model("tiny-random"), lora.model, "tiny-random")
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert terms(lora)["gradients"] == trained * 4 and terms(lora)["weights"] == params * 4


def test_quantized_weights_are_what_bitsandbytes_holds():
    pytest.importorskip("bitsandbytes")
    for quantization in ("nf4", "int8"):
        config = load_config(None, [*TINY, "model.lora_rank=4", f"model.quantization={quantization}"])
        held = load_model("tiny-random", quantization=quantization).get_memory_footprint()
        assert terms(config)[f"weights ({quantization})"] == pytest.approx(held, rel=0.02), quantization


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_activations_per_token_are_what_autograd_keeps_on_the_cpu(dtype):
    """The meta device's count (a fused attention's saved tensors) against the real tiny model's
    saved tensors in a training forward, attention through sdpa, per token and layer."""
    model = load_model("tiny-random", dtype).train()
    params = {id(p) for p in model.parameters()}
    kept = {}

    def pack(t):
        base = t if t._base is None else t._base
        if id(base) not in params:
            kept[id(base)] = base.numel() * base.element_size()
        return t

    T = 32
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=torch.arange(5, 5 + T)[None])
    real = sum(kept.values()) / T / model.config.num_hidden_layers
    assert _saved_per_token(model.config, dtype) == pytest.approx(real, rel=0.15)
    # Counted on a copy of the model's config: the model itself keeps its attention.
    assert model.config._attn_implementation != "grpokit_memory"
    model.get_decoder()(input_ids=torch.arange(5, 5 + T)[None]).last_hidden_state.sum().backward()


def test_a_run_that_cannot_fit_is_told_what_would_make_it():
    config = load_config(None, [*TINY, "rollout.max_completion_length=512", "train.prompts_per_step=8",
                                "rollout.num_generations=8"])
    hf = model_config("tiny-random")
    peak = estimate(config, hf).peak
    ok, fixes = fitting(config, hf, peak * 0.5)
    assert not ok and fixes and fixes[-1].startswith("(estimated peak then")
    for fix in fixes[:-1]:  # the settings named, applied, fit
        section_field, value = fix.split("=")
        section, field = section_field.split(".")
        current = getattr(getattr(config, section), field)
        setattr(getattr(config, section), field, type(current)(value == "true" if value in ("true", "false") else value)
                if current is not None else int(value))
    assert estimate(config, hf).peak <= peak * 0.5
    assert fitting(config, hf, 0.1 * GB) == (False, [])  # the process alone is more


def test_memory_sizes_and_gpu_names():
    assert parse_memory("24GB") == (24e9, None) and parse_memory("80 GiB") == (80 * 2**30, None)
    assert parse_memory("H100") == (80e9, "cuda") and parse_memory("a100-80gb") == (80e9, "cuda")
    with pytest.raises(ValueError, match="give a size"):
        parse_memory("lots")


def test_config_check_prints_the_estimate_and_the_fit(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: tiny-random\n")
    assert main(["config", "--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak memory per process:" in out and "(estimated), of which process 0.45, weights" in out
    assert main(["config", "--check", str(path), "--memory", "H100"]) == 0
    assert "this run fits in 80.0 GB per process" in capsys.readouterr().out
    assert main(["config", "--check", str(path), "--memory", "100MB"]) == 1
    assert "this run does not fit in 0.1 GB per process" in capsys.readouterr().out
    assert main(["config", "--check", str(path), "--memory", "plenty"]) == 2


def test_a_run_that_cannot_fit_is_refused_before_its_weights_load(tmp_path, monkeypatch, capsys):
    pages = os.sysconf("SC_PAGE_SIZE")
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: int(0.2 * GB / pages) if name == "SC_PHYS_PAGES" else real(name))
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"(?s)peak memory per process: .* this run does not fit in 0.2 GB per process"):
        Trainer(load_config(None, [*TINY, f"train.output_dir={run}"]), progress=False)
    assert not run.exists()
