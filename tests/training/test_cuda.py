"""The CUDA paths, on a GPU (skipped where there is none): a short run in float32 and bfloat16;
chunked log-probs and activation checkpointing against the plain passes; micro-batching that
changes nothing, in float64. Run them with `pytest -m cuda`."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.runs import measured

from grpokit.cli import main

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUN = ["--no-progress", "model.name=tiny-random", "reward.functions=[length]", "train.prompts_per_step=2",
       "rollout.num_generations=4", "rollout.max_completion_length=12", "data.eval_size=4", "train.learning_rate=1e-3"]


def train(out: Path, *extra: str) -> tuple[list[dict], dict]:
    assert main(["train", *RUN, f"train.output_dir={out}", *extra]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not measured(k)} for r in rows], load_file(out / "final" / "model.safetensors")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_short_run_trains_on_the_gpu(tmp_path, dtype):
    from grpokit.models.loading import load_model

    rows, weights = train(tmp_path / dtype, "train.max_steps=3", f"model.dtype={dtype}")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in steps)
    start = dict(load_model("tiny-random", dtype).named_parameters())
    assert all(w.dtype == getattr(torch, dtype) for w in weights.values())
    assert any(not torch.equal(start[k].detach().cpu(), w) for k, w in weights.items() if k in start)


def test_chunked_logprobs_and_checkpointing_equal_the_plain_passes(tmp_path):
    """One update, with a KL term (the reference model's pass is chunked too)."""
    plain_rows, plain = train(tmp_path / "plain", "train.max_steps=1", "algorithm.beta=0.01", "train.logprob_chunk_size=0")
    rows, chunked = train(tmp_path / "chunked", "train.max_steps=1", "algorithm.beta=0.01",
                          "train.logprob_chunk_size=5", "model.gradient_checkpointing=true")
    for a, b in zip(plain_rows, rows):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # A tenth of one update (learning rate 1e-3): AdamW's first step divides by tiny second moments,
    # which amplifies float32 reduction order; a wrong update is off by a whole one.
    assert all(torch.allclose(plain[k], chunked[k], rtol=0, atol=1e-4) for k in plain)


def test_micro_batching_changes_nothing_in_float64(tmp_path):
    """One update (a second step would sample from weights that differ in their last bits, and a
    different sampled token is a different run, not a wrong update)."""
    whole_rows, whole = train(tmp_path / "whole", "train.max_steps=1", "model.dtype=float64", "algorithm.beta=0.01")
    rows, micro = train(tmp_path / "micro", "train.max_steps=1", "model.dtype=float64", "algorithm.beta=0.01",
                        "train.micro_batch_size=3")
    for a, b in zip(whole_rows, rows):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key
    assert all(torch.allclose(whole[k], micro[k], rtol=0, atol=1e-6) for k in whole)  # a thousandth of an update


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_captured_static_decoder_samples_what_the_dynamic_one_does(dtype):
    """rollout.decoder=static on CUDA (its step replayed as a CUDA graph) against the dynamic
    decoder: the same tokens, masks and finish reasons, log-probs to rounding."""
    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.models.loading import load_model, load_tokenizer

    model, tokenizer = load_model("tiny-random").to("cuda", dtype), load_tokenizer("tiny-random")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 2?", "Hi", "A longer prompt than the two others")]
    first = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.pad_token_id], decoder="dynamic").generate(
        prompts, [3, 1, 2], SamplingParams(40, 1.0), list(range(6)))
    stops = first.completion_ids[:1, 20].tolist()  # one completion ends at token 20 or before, the others run on
    a, b = (TransformersEngine(model, tokenizer.pad_token_id, stops, decoder=d).generate(
        prompts, [3, 1, 2], SamplingParams(40, 1.0), list(range(6))) for d in ("dynamic", "static"))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert a.finish_reasons == b.finish_reasons and a.completion_mask[0].sum() <= 21
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(b.sampling_logps, a.sampling_logps, atol=tol, rtol=0)


def test_a_vision_language_model_trains_three_steps_in_bfloat16(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "vision.yaml"
    out = tmp_path / "vlm"
    assert main(["train", "--no-progress", "--config", str(example), "model.name=tiny-random-vlm", "model.dtype=bfloat16",
                 "train.max_steps=3", "data.eval_size=4", "train.eval_every=3", f"train.output_dir={out}"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in steps)
