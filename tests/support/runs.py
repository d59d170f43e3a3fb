"""A run's metrics as its folder holds them, and whether two runs are the same run: bit for bit, or
to float rounding (two ways of computing the same run: processes, micro-batches, sharding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def metric_rows(run: Path) -> list[dict]:
    """Every row of `run`/metrics.jsonl, as JSON reads it ("nan" stays a string)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def measured(key: str) -> bool:
    """Whether a metric measures how the work was done, not what it computed: timings (step_time,
    time/generate, ...), the compute spent (waste/*, which another engine or pass counts otherwise)
    and the bytes moved (weights/push_bytes, with a rollout server only)."""
    return "time" in key or key.startswith(("waste/", "weights/"))


def untimed_metrics(run: Path) -> list[dict]:
    """metric_rows without the keys that are `measured`: what two runs of the same computation log
    alike, bit for bit."""
    return [{k: v for k, v in r.items() if not measured(k)} for r in metric_rows(run)]


def training_rows(run: Path) -> list[dict]:
    """The rows of `run`/metrics.jsonl that mention a loss: the training steps' (evaluations log none)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def completions_log(run: Path) -> list[dict]:
    """Every row of `run`/completions.jsonl (monitor.log_completions)."""
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


def final_weights(folder: Path) -> Path:
    """The weights file of a model folder: the model's, or a LoRA run's adapters."""
    adapters = folder / "adapter_model.safetensors"
    return adapters if adapters.is_file() else folder / "model.safetensors"


def assert_same_final_weights(a: Path, b: Path) -> None:
    """Runs `a` and `b` ended with the same weights, bit for bit."""
    wa, wb = (load_file(run / "final" / "model.safetensors") for run in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def assert_same_run(a: Path, b: Path, steps: int | None = None) -> None:
    """Runs `a` and `b` are the same run, bit for bit: the same metrics (timings aside,
    untimed_metrics) and the same final weights; with `steps`, their training steps are 1..steps."""
    rows = untimed_metrics(a), untimed_metrics(b)
    assert rows[0] == rows[1]
    if steps is not None:
        assert [r["step"] for r in rows[0] if "loss" in r] == list(range(1, steps + 1))
    assert_same_final_weights(a, b)


def assert_close_metrics(reference: list[dict], rows: list[dict]) -> None:
    """The same metric rows, with the same keys, to float64 rounding (rel 1e-9, abs 1e-12) on every
    value but the `measured` ones: two ways of computing the same float64 run (process counts,
    micro-batches)."""
    assert len(reference) == len(rows)
    for a, b in zip(reference, rows):
        a, b = ({k: v for k, v in row.items() if not measured(k)} for row in (a, b))
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key


def assert_same_run_to_rounding(run: Path, reference: Path, weights_tol: float = 2e-5, evals: bool = True) -> None:
    """The same metrics (to float32 reduction order) and final weights; the same optimizer state.
    evals=False: the training rows only (a run stopped at max_steps also evaluated there).
    weights_tol is 2% of one update (learning rate 1e-3): a sharded run's log-prob pass splits the
    sequence elsewhere (logprobs.py), FSDP2 steps torch's per-weight AdamW where one process steps
    the fused one, and chunked log-probs sum in another order; all float32 rounding, which AdamW's
    division by tiny second moments amplifies. A wrong update is off by a whole update."""
    mine, theirs = untimed_metrics(run), untimed_metrics(reference)
    if not evals:
        mine, theirs = ([r for r in rows if "loss" in r] for rows in (mine, theirs))
    assert [r["step"] for r in mine] == [r["step"] for r in theirs]
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    w, v = (load_file(final_weights(r / "final")) for r in (run, reference))
    assert w.keys() == v.keys()
    assert max((w[k] - v[k]).abs().max().item() for k in w) < weights_tol
    step = max(r["step"] for r in theirs)
    o, p = (torch.load(r / "checkpoints" / f"step-{step}" / "optimizer.pt", weights_only=True)["optimizer"]
            for r in (run, reference))
    assert o["state"].keys() == p["state"].keys() and len(o["state"]) > 0
    for name in o["state"]:
        assert o["state"][name]["step"] == p["state"][name]["step"]
        for moment in ("exp_avg", "exp_avg_sq"):
            mine, theirs = o["state"][name][moment], p["state"][name][moment]
            assert (mine - theirs).norm() <= 1e-3 * theirs.norm(), (name, moment)


def train_only_adapters(trainer) -> None:
    """`trainer.train()`, asserting that LoRA's adapters alone are trainable and that exactly they change."""
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    for name, p in trainer.policy.named_parameters():
        assert (not torch.equal(p, before[name])) == (name in trainable), name
