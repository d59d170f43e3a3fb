"""Stability diagnostics: rules over a run's metrics that name what is going wrong, with the evidence
and a concrete fix. The same rules raise live alerts during training (monitor.py) and make
`grpokit doctor`'s findings, so a run directory alone is enough to diagnose a run.

Every rule reads the train rows of metrics.jsonl (and the evaluation rows) up to some step and
compares windows of WINDOW steps (medians or means, robust to a single odd step):

- `grad_norm`: the median grad_norm of the last WINDOW steps is at least GROWTH x that of steps
  WINDOW+1 to 2 x WINDOW (trending up), or its coefficient of variation (std / mean) over the last
  WINDOW steps is at least 1 while it was below 0.5 over steps WINDOW+1 to 2 x WINDOW (swinging).
  Seen in the field in long runs with beta = 0, while the reward still rose (a small beta > 0
  cured it). The first WINDOW steps are not the baseline: a fresh policy's groups mostly score
  alike (advantage 0, no gradient), and its completions shorten as it learns (a token's share of
  the loss grows), so grad_norm grows over them with nothing drifting (docs/monitoring.md shows
  it on the default run).
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
- `waste`: over the last WASTE_STEPS steps (it shows from the first), the mean waste/passes or
  waste/decode (token positions computed / tokens kept, training/metrics.py `Waste`) is above
  2: more than half of that compute went to padding or to completions that had ended.
- `lag`: over the last LAG_STEPS steps (it shows from the first), the trained tokens' mean lag
  (partial/lag_mean with partial rollouts, staleness/token_mean with in-flight weight updates:
  versions between the weights that sampled a token and the step's) averaged LAG_MEAN or more, or
  the share of importance weights outside their bounds (sampling/is_truncated_fraction or
  is_masked_fraction) averaged OUTSIDE or more and grew from the first to the last of them: the trainer learns from samples the current policy would not draw.
- `agents`: in the last step, rollouts' agents failed (agents/failed) or requests of theirs were
  refused (agents/refused_requests): a failed rollout gets no reward. The evidence gives the share
  of rollouts that failed over the last WINDOW steps (the failure rate).
- `judge`: in the last step, the judge left JUDGE_FAILED or more of the completions unscored
  (judge/failed): a timeout, an HTTP error or a reply that did not parse gives None, so those take
  no part in their groups' statistics.
- `lost_metric`: the last step's row lacks a key that each of the (at least LOST_AFTER, at most
  WINDOW) steps before it had (those only some steps log aside, INTERMITTENT): a quantity that
  stopped being measured, whose curve would end without a word.
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


# RunFacts' fields, and where a run's config.yaml holds each.
FACTS = {"beta": "algorithm.beta", "learning_rate": "train.learning_rate", "num_generations": "rollout.num_generations",
         "prompts_per_step": "train.prompts_per_step", "max_completion_length": "rollout.max_completion_length",
         "max_steps": "train.max_steps"}


@dataclass(frozen=True)
class RunFacts:
    """The config values the suggestions quote; None: not in the config that was read."""
    beta: float | None
    learning_rate: float | None
    num_generations: int | None
    prompts_per_step: int | None
    max_completion_length: int | None
    max_steps: int | None = None

    @classmethod
    def from_config(cls, config: dict) -> RunFacts:
        """From a config as saved (nested sections); a missing section or field is None."""
        def read(key):
            section, name = key.split(".")
            value = (config or {}).get(section)
            return value.get(name) if isinstance(value, dict) else None

        return cls(**{name: read(key) for name, key in FACTS.items()})

    def missing(self) -> list[str]:
        """The config keys that could not be read."""
        return [key for name, key in FACTS.items() if getattr(self, name) is None]


def _is(key: str, value) -> str:
    """`key=value`, for a suggestion; `key` alone when the config did not hold the value."""
    return key if value is None else f"{key}={value}"


def _now(value) -> str:
    """`now <value>`, for a suggestion; what it says when the config did not hold the value."""
    return "its value not in the config" if value is None else f"now {value:g}"


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _span(rows: list[dict]) -> str:
    return f"steps {rows[0]['step']}-{rows[-1]['step']}"


def grad_norm(rows, evals, facts) -> Finding | None:
    if len(rows) < 3 * WINDOW:
        return None
    early, recent = rows[WINDOW:2 * WINDOW], rows[-WINDOW:]  # (the module docstring: not the first WINDOW)
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
    fix = ("with algorithm.beta=0 (the default, which runs no reference model) nothing holds the policy near where "
           "it started, and over a long run it can drift this way while the reward still rises: set "
           "algorithm.beta=0.001 (the reference model costs a forward pass), or lower train.learning_rate"
           if facts.beta == 0 else f"lower train.learning_rate ({_now(facts.learning_rate)}) or raise algorithm.beta ({_now(facts.beta)})")
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
                       f"({_now(facts.learning_rate)}), or fewer algorithm.num_iterations / train.updates_per_step")
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
                   f"raise rollout.num_generations ({_now(facts.num_generations)}) or train.prompts_per_step "
                   f"({_now(facts.prompts_per_step)}); if every completion scores the same, the task is too hard or too easy "
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
                   f"train.learning_rate ({_now(facts.learning_rate)}) or the batch ({_is('train.prompts_per_step', facts.prompts_per_step)}, "
                   f"{_is('rollout.num_generations', facts.num_generations)})")


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
                   f"{share:.0%} of completions stopped at {_is('rollout.max_completion_length', facts.max_completion_length)} "
                   f"over {_span(recent)}",
                   f"raise rollout.max_completion_length ({_now(facts.max_completion_length)}), or reward shorter "
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
                       f"the policy is running away from the reference: raise algorithm.beta ({_now(facts.beta)}) "
                       f"or lower train.learning_rate ({_now(facts.learning_rate)})")
    return None


WASTE_STEPS = 3
# What stops each kind of waste (training/metrics.py Waste).
WASTE_FIXES = {
    "waste/passes": "pack the log-prob passes: set train.micro_batch_tokens (a token budget per micro-batch, no "
                    "padding; docs/speed-and-memory.md) in place of train.micro_batch_size",
    "waste/decode": "decode with rollout.decoder=dynamic, which drops a completion from the batch when it ends (the "
                    "static decoder computes every completion until the longest ends)",
}


def waste(rows, evals, facts) -> Finding | None:
    recent = rows[-WASTE_STEPS:]
    for key, fix in WASTE_FIXES.items():
        values = _values(recent, key)
        if len(values) == WASTE_STEPS and (mean := statistics.fmean(values)) > 2:
            return Finding("waste", recent[-1]["step"],
                           f"{key} {mean:.2f} over {_span(recent)}: {1 - 1 / mean:.0%} of those token positions were "
                           "computed for nothing (padding, or completions that had ended)", fix)
    return None


LAG_STEPS, LAG_MEAN, OUTSIDE = 3, 1.0, 0.2
LAG_FIX = ("lower the lag: a larger rollout.partial_tokens or a smaller rollout.partial_spare (fewer groups carried), a "
           "smaller rollout.partial_max_lag or rollout.max_staleness, or a lower train.learning_rate (the policy then moves "
           "less between the sampler's weights and the trainer's)")


def lag(rows, evals, facts) -> Finding | None:
    recent = rows[-LAG_STEPS:]
    lags = _values(recent, "partial/lag_mean") or _values(recent, "staleness/token_mean")
    if len(lags) == LAG_STEPS and (mean := statistics.fmean(lags)) >= LAG_MEAN:
        return Finding("lag", recent[-1]["step"], f"the trained tokens were sampled {mean:.2f} weight versions before "
                       f"their step on average over {_span(recent)}", LAG_FIX)
    for key in ("sampling/is_truncated_fraction", "sampling/is_masked_fraction"):
        outside = _values(recent, key)
        if len(outside) == LAG_STEPS and statistics.fmean(outside) >= OUTSIDE and outside[-1] > outside[0]:
            return Finding("lag", recent[-1]["step"], f"{statistics.fmean(outside):.0%} of the importance weights fell "
                           f"outside their bounds over {_span(recent)} ({key}), and the share grows", LAG_FIX)
    return None


def agents(rows, evals, facts) -> Finding | None:
    last = rows[-1] if rows else {}
    failed, refused = last.get("agents/failed") or 0, last.get("agents/refused_requests") or 0
    if not failed and not refused:
        return None
    total = facts.num_generations * facts.prompts_per_step if facts.num_generations and facts.prompts_per_step else None
    recent = [r for r in rows[-WINDOW:] if "agents/failed" in r]
    rate = "" if total is None else (f"; {sum(_values(recent, 'agents/failed')) / (total * len(recent)):.1%} of the "
                                     f"rollouts failed over {_span(recent)}")
    return Finding("agents", last["step"],
                   f"{failed:g}{'' if total is None else f' of {total}'} rollouts' agents failed and {refused:g} of "
                   f"their requests were refused at step {last['step']}{rate}",
                   "failures.jsonl says why, for each at its step (agent_error, and each refused request's message in "
                   "the agent's error); a failed rollout gets no reward (docs/agents.md, When an agent fails)")


JUDGE_FAILED = 0.5


def judge(rows, evals, facts) -> Finding | None:
    last = rows[-1] if rows else {}
    failed = _values([last], "judge/failed")
    if not failed or failed[0] < JUDGE_FAILED:
        return None
    return Finding("judge", last["step"], f"the judge left {failed[0]:.0%} of step {last['step']}'s completions "
                   "unscored (judge/failed)",
                   "failures.jsonl's judge column says why for each, at its step (a timeout, an HTTP error, a reply "
                   "that did not parse); check reward.judge_url, a longer reward.judge_timeout, or a judge model that "
                   "follows the rubric's format (docs/distillation.md)")


# Keys a train row holds only at some steps: a weight push's, the waste of what a step ran
# (training/metrics.py), an agent's named rewards (those its rollouts returned that step).
INTERMITTENT = ("weights/", "waste/", "agent/")
LOST_AFTER = 3  # steps that must all hold a key before its loss is said


def lost_metric(rows, evals, facts) -> Finding | None:
    """The last step's row lacks a key every one of the steps before it in the window had."""
    before, last = rows[-WINDOW - 1:-1], rows[-1] if rows else {}
    if len(before) < LOST_AFTER:
        return None
    lost = sorted(k for k in set.intersection(*(set(r) for r in before)) - set(last) if not k.startswith(INTERMITTENT))
    if not lost:
        return None
    return Finding("lost_metric", last["step"], f"step {last['step']}'s metrics lack {', '.join(lost)}, which "
                   f"{_span(before)} all had",
                   "something stopped measuring it: an engine (or an agent's request) that gave no entropies for a "
                   "trained token drops `entropy`; a reward function that stopped calling log_metric drops its key. "
                   "The step's console output and failures.jsonl say what changed")

RULES = (grad_norm, clip_ratio, zero_std, reward_flat, truncation, kl, waste, lag, agents, judge, lost_metric)


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


def run_status(run_dir: Path, rows: list[dict], max_steps: int | None) -> str:
    """finished / running / stopped, from the folder alone."""
    from grpokit.rundir.checkpoint import latest_checkpoint
    from grpokit.rundir.folder import run_dir_in_use

    steps = [r["step"] for r in rows if "loss" in r]
    last = steps[-1] if steps else 0
    of = "" if max_steps is None else f" of {max_steps}"
    if run_dir_in_use(run_dir):
        return f"running: at step {last}{of}"
    if (run_dir / "final").exists() and (max_steps is None or last >= max_steps):
        return f"finished: {last} steps"
    checkpoint = latest_checkpoint(run_dir)
    saved = f"newest checkpoint {checkpoint.name}" if checkpoint else "no checkpoint"
    return f"stopped at step {last}{of} ({saved}; `grpokit train --config {run_dir / 'config.yaml'}` resumes)"


def _how_it_stopped(run_dir: Path, rows: list[dict]) -> str:
    """What a stopped run's folder says of how it stopped (its stop record, rundir.record_stop, or
    else a guess from its logs), and what resuming will redo."""
    from grpokit.rundir.checkpoint import checkpoint_step, latest_checkpoint
    from grpokit.rundir.folder import read_stop

    steps = [r["step"] for r in rows if "loss" in r]
    last = steps[-1] if steps else 0
    checkpoint = latest_checkpoint(run_dir)
    saved = checkpoint_step(checkpoint) if checkpoint else 0
    stop = read_stop(run_dir)
    if stop is not None and stop.get("step") == last:
        if checkpoint is not None and saved == last:
            resume = f"the state after step {last} is saved in {checkpoint.name}: resuming loses nothing"
        elif last == 0:
            resume = "it had completed no step: resuming starts from step 1"
        else:
            redo = f"steps {saved + 1}-{last}" if last > saved + 1 else f"step {last}"
            resume = (f"{'its newest checkpoint is ' + checkpoint.name if checkpoint else 'it has no checkpoint'}: "
                      f"resuming trains {redo} again")
        message = str(stop.get("message", "")).replace("\n", "\n   ")
        if stop["reason"] == "error":
            return f"it stopped after step {last} on an error: {message}\n  {resume}"
        if stop["reason"] == "signal":
            return f"it was stopped by {stop.get('signal')} after step {last} ({message})\n  {resume}"
        return f"it finished after step {last}, the train.max_steps it ran with then: {resume}"
    if checkpoint is not None and saved == last:
        return (f"it stopped after step {last} with a checkpoint of it (SIGTERM or Ctrl-C, a failure it saved "
                "first, or the end of a shorter train.max_steps): resuming loses nothing")
    redo = f"steps {saved + 1}-{last}" if last > saved + 1 else f"step {last}"
    return (f"it crashed or was killed after step {last} (its output's last lines say why), {last - saved} step(s) "
            f"after its {'newest checkpoint' if checkpoint else 'start'}: resuming trains {redo} again")


def doctor(run_dir: Path) -> str:
    """`grpokit doctor`: the run's status and every finding, with its evidence and a fix. A TRL
    output_dir is diagnosed by the same rules (`trl_doctor`)."""
    from grpokit.rundir.folder import read_run

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and trl_state_file(run_dir) is not None:
        return trl_doctor(run_dir)
    config, rows = read_run(run_dir)
    facts = RunFacts.from_config(config)
    found = diagnose(rows, facts)
    status = run_status(run_dir, rows, facts.max_steps)
    lines = [f"{run_dir}: {status}"]
    if status.startswith("stopped"):
        lines.append(_how_it_stopped(run_dir, rows))
    if facts.missing():
        lines.append(f"config.yaml does not say {', '.join(facts.missing())}: the findings below are judged from "
                     "the metrics alone, and their fixes cannot quote those settings")
    train = [r for r in rows if "loss" in r]
    if not found:
        lines.append(f"no problems found in {len(train)} steps (the checks need {2 * WINDOW} steps to compare "
                     "windows; see `grpokit doctor --help`)")
    return "\n".join(lines + finding_lines(found))


def finding_lines(found: list[tuple[Finding, Finding | None]]) -> list[str]:
    """Each finding of `diagnose` as doctor prints it: where it began, whether it still holds, the fix."""
    lines = []
    for i, (first, now) in enumerate(found, 1):
        still = f"still so at step {now.step}" if now else "gone by the last step"
        lines.append(f"{i}. {first.kind}, from step {first.step} ({still}): {(now or first).evidence}")
        lines.append(f"   -> {first.suggestion}")
    return lines


# ---------------------------------------------------------------- TRL runs

# Where TRL's GRPOConfig holds what RunFacts quotes (prompts_per_step has no one field there).
TRL_FACTS = {"beta": "beta", "learning_rate": "learning_rate", "num_generations": "num_generations",
             "max_completion_length": "max_completion_length"}
# grpokit's setting names in the fixes, as TRL's GRPOConfig calls them.
TRL_NAMES = {"algorithm.beta": "beta", "train.learning_rate": "learning_rate",
             "rollout.num_generations": "num_generations", "rollout.max_completion_length": "max_completion_length",
             "train.prompts_per_step": "per_device_train_batch_size", "algorithm.num_iterations": "num_iterations",
             "train.updates_per_step": "steps_per_generation"}


def trl_state_file(folder: Path) -> Path | None:
    """The trainer_state.json of a TRL (transformers Trainer) output_dir with the most steps: the
    folder's own (`trainer.save_state()`) or its newest checkpoint-N's."""
    found = [p for p in (folder / "trainer_state.json", *folder.glob("checkpoint-*/trainer_state.json")) if p.is_file()]
    if not found:
        return None

    def steps(path: Path) -> int:
        try:
            return int(json.loads(path.read_text()).get("global_step", 0))
        except (ValueError, AttributeError):
            return -1
    return max(found, key=steps)


class _StandIn:
    """A class the unpickler cannot import (TRL's GRPOConfig where TRL is not installed): its fields."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)


def read_trl_args(path: Path) -> dict:
    """The fields of a training_args.bin (a pickled GRPOConfig), readable without TRL installed;
    {} when it cannot be read. Unpickling runs the file's code paths: only for a run of your own."""
    import pickle
    import types

    import torch

    class Lenient(pickle.Unpickler):
        def find_class(self, module, name):
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                return _StandIn

    try:
        args = torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=types.SimpleNamespace(Unpickler=Lenient, load=pickle.load, __name__="pickle"))
    except Exception:  # noqa: BLE001 - a damaged or foreign file: the settings stay unread
        return {}
    return dict(getattr(args, "__dict__", {}))


def trl_rows(log_history: list[dict]) -> list[dict]:
    """TRL's log_history as grpokit's metrics rows: its training logs keep their names (they are
    grpokit's), its evaluation logs' `eval_x` become `eval/x`; the end-of-training summary is left out."""
    rows = []
    for entry in log_history:
        if "step" not in entry:
            continue
        evals = {f"eval/{k[5:]}": v for k, v in entry.items() if k.startswith("eval_")}
        if evals:
            rows.append({"step": entry["step"], **evals})
        elif "loss" in entry:
            rows.append(dict(entry))
    return rows


def _in_trl_names(text: str) -> str:
    for ours, theirs in TRL_NAMES.items():
        text = text.replace(ours, theirs)
    return text


def trl_doctor(folder: Path) -> str:
    """`grpokit doctor` of a TRL output_dir: its logged metrics (trainer_state.json) judged by
    grpokit's rules, the fixes in TRL's setting names, and which settings could be read."""
    state_file = trl_state_file(folder)
    state = json.loads(state_file.read_text())
    rows = trl_rows(state.get("log_history") or [])
    args_file = next((p for p in (state_file.parent / "training_args.bin", folder / "training_args.bin") if p.is_file()),
                     None)
    args = read_trl_args(args_file) if args_file else {}
    facts = RunFacts(**{name: args.get(key) for name, key in TRL_FACTS.items()}, prompts_per_step=None,
                     max_steps=state.get("max_steps") or args.get("max_steps"))
    step, total = state.get("global_step", 0), facts.max_steps
    train = [r for r in rows if "loss" in r]
    lines = [f"{folder}: a TRL run, {len(train)} logged steps to step {step}"
             + (f" of {total}" if total else "") + f" ({state_file.relative_to(folder.parent)}"
             + (f", logged every {state['logging_steps']} steps" if state.get("logging_steps") else "") + ")"]
    read = [f"{key}={args[key]}" for key in TRL_FACTS.values() if args.get(key) is not None]
    unread = [key for key in TRL_FACTS.values() if args.get(key) is None]
    source = args_file.relative_to(folder.parent) if args_file else "training_args.bin (not found)"
    lines.append(f"settings read from {source}: {', '.join(read) or 'none'}"
                 + (f"; not read: {', '.join(unread)} (the fixes below cannot quote them)" if unread else ""))
    found = diagnose(rows, facts)
    if not found:
        lines.append(f"no problems found in {len(train)} logged steps (the checks need {2 * WINDOW} to compare windows)")
    return "\n".join(lines + [_in_trl_names(line) for line in finding_lines(found)])
