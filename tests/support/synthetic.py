"""Synthetic runs (tests/rundir/test_diagnose.py, test_report.py): a run folder of made-up metrics,
healthy or with one failure setting in halfway."""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml


SYNTHETIC_STEPS = 80


def healthy_row(step: int, rng: random.Random) -> dict:
    """A run that learns: reward rising, steady grad_norm, few zero-std groups, short completions."""
    return {
        "step": step,
        "loss": rng.gauss(0, 0.01),
        "reward": 0.1 + 0.8 * step / SYNTHETIC_STEPS + rng.gauss(0, 0.02),
        "reward_std": 0.4 + rng.gauss(0, 0.02),
        "frac_reward_zero_std": 0.2 + rng.gauss(0, 0.05),
        "grad_norm": 1.0 + rng.gauss(0, 0.1),
        "clip_ratio/region_mean": 0.01 + abs(rng.gauss(0, 0.005)),
        "completions/clipped_ratio": 0.1 + abs(rng.gauss(0, 0.03)),
        "kl": 0.01 + abs(rng.gauss(0, 0.002)),
        "waste/decode": 1.0,  # (no draw of rng: the other metrics' values stay as they were)
        "waste/passes": 1.25,
        "entropy": 0.5,
    }


def with_failure(kind: str, step: int, row: dict, rng: random.Random) -> dict:
    """`row` of a healthy run, with the failure `kind` set in from halfway."""
    late = step > SYNTHETIC_STEPS // 2  # the failure sets in halfway
    if kind == "grad_norm" and late:
        row["grad_norm"] = 1.0 + 0.15 * (step - SYNTHETIC_STEPS // 2)  # climbing, while the reward still rises
    if kind == "clip_ratio" and late:
        row["clip_ratio/region_mean"] = 0.3 + rng.gauss(0, 0.02)
    if kind == "zero_std" and late:
        row["frac_reward_zero_std"] = 0.7 + rng.gauss(0, 0.05)
    if kind == "reward_flat" and late:
        row["reward"] = 0.5 + rng.gauss(0, 0.02)  # stalled after halfway
    if kind == "truncation" and late:
        row["completions/clipped_ratio"] = 0.8 + rng.gauss(0, 0.03)
    if kind == "waste" and late:
        row["waste/passes"] = 3.2  # lengths grew ragged: most of each padded micro-batch is padding
    if kind == "agents":  # an agent run's rows carry these: two steps with failures
        failing = step in (SYNTHETIC_STEPS // 2 + 5, SYNTHETIC_STEPS // 2 + 6)
        row["agents/failed"], row["agents/refused_requests"] = (3.0, 1.0) if failing else (0.0, 0.0)
    if kind == "judge" and step == SYNTHETIC_STEPS // 2 + 5:
        row["judge/failed"] = 0.75  # a judge run's rows carry it: a step the judge mostly failed
    if kind == "lost_metric" and step > SYNTHETIC_STEPS // 2 + 5:
        del row["entropy"]  # something stopped measuring it (an agent's request with no entropies, once)
    if kind == "kl" and late:
        row["kl"] = 0.02 * 1.1 ** (step - SYNTHETIC_STEPS // 2)
    return row


def write_synthetic_run(folder: Path, kind: str | None, beta: float = 0.0) -> list[dict]:
    """A run folder (config.yaml, metrics.jsonl) of SYNTHETIC_STEPS steps, healthy or with the
    failure `kind` from halfway, evaluated every 10 steps; its rows."""
    from grpokit.settings.schema import Config

    rng = random.Random(0)
    folder.mkdir()
    config = Config()
    config.algorithm.beta = beta
    config.train.max_steps = SYNTHETIC_STEPS
    (folder / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    rows = []
    for step in range(1, SYNTHETIC_STEPS + 1):
        row = healthy_row(step, rng)
        rows.append(with_failure(kind, step, row, rng) if kind else row)
        if step % 10 == 0:  # evaluations follow the reward's trend
            trend = 0.5 if kind == "reward_flat" and step > SYNTHETIC_STEPS // 2 else 0.1 + 0.8 * step / SYNTHETIC_STEPS
            rows.append({"step": step, "eval/reward": trend})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
