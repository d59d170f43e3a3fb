"""Stability diagnostics: rules over a run's metrics that name what is going wrong, with the evidence
and a concrete fix. The same rules raise live alerts during training (monitor.py) and make
`grpokit doctor`'s findings, so a run directory alone is enough to diagnose a run.

Every rule reads the train rows of metrics.jsonl (and the evaluation rows) up to some step and
compares windows of WINDOW steps (medians or means, robust to a single odd step):

- `grad_norm`: the median grad_norm of the last WINDOW steps is at least GROWTH x that of the
  first WINDOW steps (trending up), or its coefficient of variation (std / mean) over the last
  WINDOW steps is at least 1 while it was below 0.5 over the first WINDOW (swinging). Seen in the
  field in long runs with beta = 0, while the reward still rose (a small beta > 0 cured it).
- `clip_ratio`: the mean clip_ratio/region_mean of the last WINDOW steps exceeds both GROWTH x its
  mean over the first WINDOW steps and that mean + 0.1.
- `zero_std`: over the last WINDOW steps, on average at least half the groups had zero reward std:
  those groups give no learning signal.
- `reward_flat`: the mean reward of the last WINDOW steps differs from that of the WINDOW before by
  less than a quarter of the mean within-group reward std (the scale of the signal), and the best
  eval/reward of the last WINDOW steps is no more than 0.02 above the best before them (when there
  are evaluations on both sides): learning that stalled (in the field: batches too small, a
  learning rate too low, KL settings that contradicted each other).
- `truncation`: over the last WINDOW steps at least half the completions stopped at
  max_completion_length, and that share is not falling (the later half-window is no more than 0.1
  below the earlier).
- `kl`: the median kl of the last WINDOW steps is at least 0.1 and at least GROWTH x the median of
  the WINDOW before: growing without bound.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

WINDOW = 20
GROWTH = 3.0


@dataclass(frozen=True)
class Finding:
    kind: str
    step: int  # the last step of the evidence
    evidence: str
    suggestion: str

    def text(self) -> str:
        return f"{self.kind} (step {self.step}): {self.evidence}\n  -> {self.suggestion}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class RunFacts:
    """The config values the suggestions quote."""
    beta: float
    learning_rate: float
    num_generations: int
    prompts_per_step: int
    max_completion_length: int

    @classmethod
    def from_config(cls, config: dict) -> RunFacts:
        return cls(config["algorithm"]["beta"], config["train"]["learning_rate"],
                   config["rollout"]["num_generations"], config["train"]["prompts_per_step"],
                   config["rollout"]["max_completion_length"])


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _span(rows: list[dict]) -> str:
    return f"steps {rows[0]['step']}-{rows[-1]['step']}"


def grad_norm(rows, evals, facts) -> Finding | None:
    if len(rows) < 2 * WINDOW:
        return None
    early, recent = rows[:WINDOW], rows[-WINDOW:]
    a, b = _values(early, "grad_norm"), _values(recent, "grad_norm")
    if len(a) < WINDOW // 2 or len(b) < WINDOW // 2:
        return None
    ma, mb = statistics.median(a), statistics.median(b)
    cv_a, cv_b = (statistics.pstdev(v) / max(statistics.fmean(v), 1e-12) for v in (a, b))
    if ma > 0 and mb >= GROWTH * ma:
        evidence = f"grad_norm median x{mb / ma:.1f}: {ma:.3g} over {_span(early)}, {mb:.3g} over {_span(recent)}"
    elif cv_b >= 1.0 and cv_a < 0.5:
        evidence = (f"grad_norm swings: std/mean {cv_b:.2f} over {_span(recent)} (max {max(b):.3g}, "
                    f"min {min(b):.3g}), {cv_a:.2f} over {_span(early)}")
    else:
        return None
    fix = ("with algorithm.beta=0 nothing holds the policy near where it started: set algorithm.beta=0.001 "
           "(the reference model costs one forward pass), or lower train.learning_rate"
           if facts.beta == 0 else f"lower train.learning_rate (now {facts.learning_rate:g}) or raise algorithm.beta (now {facts.beta:g})")
    return Finding("grad_norm", recent[-1]["step"], evidence, fix)


def clip_ratio(rows, evals, facts) -> Finding | None:
    if len(rows) < 2 * WINDOW:
        return None
    early, recent = rows[:WINDOW], rows[-WINDOW:]
    a, b = _values(early, "clip_ratio/region_mean"), _values(recent, "clip_ratio/region_mean")
    if not a or not b:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if mb > GROWTH * ma and mb > ma + 0.1:
        return Finding("clip_ratio", recent[-1]["step"],
                       f"clip_ratio/region_mean {mb:.3f} over {_span(recent)}, {ma:.3f} over {_span(early)}",
                       f"each update moves the policy far from the one that sampled: lower train.learning_rate "
                       f"(now {facts.learning_rate:g}), or fewer algorithm.num_iterations / train.updates_per_step")
    return None


def zero_std(rows, evals, facts) -> Finding | None:
    recent = rows[-WINDOW:]
    values = _values(recent, "frac_reward_zero_std")
    if len(rows) < WINDOW or not values:
        return None
    share = statistics.fmean(values)
    if share < 0.5:
        return None
    rewards = _values(recent, "reward")
    level = f", mean reward {statistics.fmean(rewards):.3g}" if rewards else ""
    return Finding("zero_std", recent[-1]["step"],
                   f"{share:.0%} of groups had zero reward std over {_span(recent)}{level}: they give no learning signal",
                   f"raise rollout.num_generations (now {facts.num_generations}) or train.prompts_per_step (now "
                   f"{facts.prompts_per_step}); if every completion scores the same, the task is too hard or too easy "
                   "for the model, or the reward too coarse")


def reward_flat(rows, evals, facts) -> Finding | None:
    if len(rows) < 2 * WINDOW:
        return None
    before, recent = rows[-2 * WINDOW:-WINDOW], rows[-WINDOW:]
    a, b = _values(before, "reward"), _values(recent, "reward")
    spread = _values(before + recent, "reward_std")
    if not a or not b or not spread:
        return None
    scale = statistics.fmean(spread)
    change = statistics.fmean(b) - statistics.fmean(a)
    if scale == 0 or abs(change) >= 0.25 * scale:
        return None
    scored = [e for e in evals if isinstance(e.get("eval/reward"), (int, float))]
    earlier = [e["eval/reward"] for e in scored if e["step"] < recent[0]["step"]]
    latest = [e["eval/reward"] for e in scored if recent[0]["step"] <= e["step"] <= recent[-1]["step"]]
    if earlier and latest and max(latest) > max(earlier) + 0.02:
        return None  # evaluation still reaches new highs
    moved = (f"; best eval/reward {max(latest):.3g} over {_span(recent)}, {max(earlier):.3g} before"
             if earlier and latest else "")
    return Finding("reward_flat", recent[-1]["step"],
                   f"mean reward {statistics.fmean(a):.3g} over {_span(before)}, {statistics.fmean(b):.3g} over "
                   f"{_span(recent)} (a change of {abs(change):.3g}, within-group std {scale:.3g}){moved}",
                   f"learning has stalled (or converged): if eval is not where it should be, raise "
                   f"train.learning_rate (now {facts.learning_rate:g}) or the batch (train.prompts_per_step="
                   f"{facts.prompts_per_step}, rollout.num_generations={facts.num_generations})")


def truncation(rows, evals, facts) -> Finding | None:
    recent = rows[-WINDOW:]
    values = _values(recent, "completions/clipped_ratio")
    if len(rows) < WINDOW or len(values) < WINDOW:
        return None
    half = WINDOW // 2
    share, earlier, later = statistics.fmean(values), statistics.fmean(values[:half]), statistics.fmean(values[half:])
    if share < 0.5 or later < earlier - 0.1:
        return None
    return Finding("truncation", recent[-1]["step"],
                   f"{share:.0%} of completions stopped at rollout.max_completion_length={facts.max_completion_length} "
                   f"over {_span(recent)}",
                   f"raise rollout.max_completion_length (now {facts.max_completion_length}), or reward shorter "
                   "answers: a cut-off completion is scored on what it never finished")


def kl(rows, evals, facts) -> Finding | None:
    if len(rows) < 2 * WINDOW:
        return None
    before, recent = rows[-2 * WINDOW:-WINDOW], rows[-WINDOW:]
    a, b = _values(before, "kl"), _values(recent, "kl")
    if not a or not b:
        return None
    ma, mb = statistics.median(a), statistics.median(b)
    if mb >= 0.1 and mb >= GROWTH * ma:
        return Finding("kl", recent[-1]["step"],
                       f"kl median {ma:.3g} over {_span(before)}, {mb:.3g} over {_span(recent)}",
                       f"the policy is running away from the reference: raise algorithm.beta (now {facts.beta:g}) "
                       f"or lower train.learning_rate (now {facts.learning_rate:g})")
    return None


RULES = (grad_norm, clip_ratio, zero_std, reward_flat, truncation, kl)


class Watch:
    """Live alerts: feed it rows as they are logged; `new()` returns each kind's first finding once."""

    def __init__(self, facts: RunFacts):
        self.facts = facts
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self.raised: set[str] = set()

    def add(self, row: dict) -> list[Finding]:
        if "eval/reward" in row:
            self.evals.append(row)
            return []
        if "loss" not in row:
            return []
        self.rows.append(row)
        found = []
        for rule in RULES:
            if rule.__name__ not in self.raised and (finding := rule(self.rows, self.evals, self.facts)):
                self.raised.add(finding.kind)
                found.append(finding)
        return found


def diagnose(rows: list[dict], facts: RunFacts) -> list[tuple[Finding, Finding | None]]:
    """Replay the rules over a run's metrics rows: each kind's first finding, with the finding at
    the last step if it still holds there (else None)."""
    watch = Watch(facts)
    first = []
    for row in rows:
        first += watch.add(row)
    last = {r.__name__: r(watch.rows, watch.evals, facts) for r in RULES} if watch.rows else {}
    return [(f, last.get(f.kind)) for f in first]


def run_status(run_dir: Path, rows: list[dict], max_steps: int) -> str:
    """finished / running / stopped, from the folder alone."""
    from grpokit.checkpoint import latest_checkpoint
    from grpokit.rundir import run_dir_in_use

    steps = [r["step"] for r in rows if "loss" in r]
    last = steps[-1] if steps else 0
    if run_dir_in_use(run_dir):
        return f"running: at step {last} of {max_steps}"
    if (run_dir / "final").exists() and last >= max_steps:
        return f"finished: {last} steps"
    checkpoint = latest_checkpoint(run_dir)
    saved = f"newest checkpoint {checkpoint.name}" if checkpoint else "no checkpoint"
    return f"stopped at step {last} of {max_steps} ({saved}; `grpokit train --config {run_dir / 'config.yaml'}` resumes)"


def doctor(run_dir: Path) -> str:
    """`grpokit doctor`: the run's status and every finding, with its evidence and a fix."""
    from grpokit.rundir import read_run

    run_dir = Path(run_dir)
    config, rows = read_run(run_dir)
    found = diagnose(rows, RunFacts.from_config(config))
    lines = [f"{run_dir}: {run_status(run_dir, rows, config['train']['max_steps'])}"]
    train = [r for r in rows if "loss" in r]
    if not found:
        lines.append(f"no problems found in {len(train)} steps (the checks need {2 * WINDOW} steps to compare "
                     "windows; see `grpokit doctor --help`)")
    for i, (first, now) in enumerate(found, 1):
        still = f"still so at step {now.step}" if now else "gone by the last step"
        lines.append(f"{i}. {first.kind}, from step {first.step} ({still}): {(now or first).evidence}")
        lines.append(f"   -> {first.suggestion}")
    return "\n".join(lines)
