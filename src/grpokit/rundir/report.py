"""`grpokit report <run_dir>`: a run's curves, alerts and sample completions, from its folder alone.

Writes `<run_dir>/plots/<panel>.png` (one per panel in PANELS whose metrics the run logged) and
`<run_dir>/report.html`, a single self-contained page: the same PNGs embedded as base64, no
script, no stylesheet or font from elsewhere, so it can be mailed or attached to an issue.

- Every panel marks the live alerts (alerts.jsonl) at their steps, so a curve and the alert that
  its shape raised are seen together; the alerts are also listed with their evidence and fix.
- Evaluation rows (eval/reward) are drawn as points joined by a line on the reward panel.
- The completions table shows up to SAMPLE_STEPS logged steps from completions.jsonl (the first,
  the last, evenly spaced between), up to SAMPLES_PER_STEP completions each.
- A step whose value is NaN (a skipped update) is a gap in its curve, not a zero.
- A vision-language model's samples show their prompt images as thumbnails (images/, embedded too).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

from grpokit.rundir.diagnose import WINDOW, run_status
from grpokit.rundir.folder import read_metrics, read_run

SAMPLE_STEPS = 4
SAMPLES_PER_STEP = 8
ALERT_COLOR = "#d000d0"  # magenta: no curve uses it (matplotlib's default colours are tab10)


@dataclass(frozen=True)
class Panel:
    name: str  # plots/<name>.png
    title: str
    keys: tuple[str, ...]  # metrics drawn (those the run logged); a key ending in "*" is a prefix
    below: tuple[str, ...] = ()  # metrics drawn on a second axis under the first


PANELS = (
    Panel("reward", "reward: train mean per step, held-out eval (points)", ("reward", "rewards/*/mean", "eval/reward")),
    Panel("grad_norm", f"grad_norm, and its rolling median over {WINDOW} steps", ("grad_norm",)),
    Panel("clip_ratio", "clip ratios: share of tokens clipped", ("clip_ratio/region_mean", "clip_ratio/low_mean",
                                                                  "clip_ratio/high_mean")),
    Panel("kl", "KL to the reference model", ("kl",)),
    Panel("entropy", "entropy of the policy (nats per token)", ("entropy",)),
    Panel("completion_length", "completion length (tokens) and truncation rate",
          ("completions/mean_length", "completions/min_length", "completions/max_length"),
          below=("completions/clipped_ratio",)),
    Panel("learning_rate", "learning rate", ("learning_rate",)),
    Panel("step_time", "seconds per step, and its parts", ("step_time", "time/generate", "time/logprobs", "time/update", "time/optimizer")),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _expand(keys: tuple[str, ...], rows: list[dict]) -> list[str]:
    """The panel's keys the run logged; "rewards/*/mean" stands for one key per reward function."""
    present = dict.fromkeys(k for r in rows for k in r)
    out = []
    for key in keys:
        if "*" in key:
            head, tail = key.split("*")
            out += [k for k in present if k.startswith(head) and k.endswith(tail) and "/" not in k[len(head):-len(tail)]]
        elif key in present:
            out.append(key)
    return out


def _rolling_median(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = sorted(v for v in values[max(0, i - window + 1):i + 1] if math.isfinite(v))
        out.append(part[len(part) // 2] if part else math.nan)
    return out


def _mark_alerts(ax, alerts: list[dict], label: bool) -> None:
    for alert in alerts:
        ax.axvline(alert["step"], color=ALERT_COLOR, linestyle="--", linewidth=1.5)
        if label:
            ax.annotate(alert["kind"], (alert["step"], 1), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", va="top", fontsize=7, color=ALERT_COLOR, rotation=90)


def plot(panel: Panel, rows: list[dict], alerts: list[dict], path: Path) -> bool:
    """Draw `panel` to `path` (PNG); False (and no file) when the run logged none of its metrics."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    groups = [g for g in (_expand(panel.keys, rows), _expand(panel.below, rows)) if g]
    if not groups:
        return False
    two = len(groups) == 2
    fig = Figure(figsize=(7.5, 4.2 if two else 3.2), dpi=100, layout="constrained")
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False, height_ratios=[2, 1] if two else None)[:, 0]
    for ax, group in zip(axes, groups):
        for key in group:
            steps, values = _series(rows, key)
            if key.startswith("eval/"):
                ax.plot(steps, values, "o-", markersize=4, linewidth=1.2, label=key)
            elif key == "grad_norm":
                ax.plot(steps, values, linewidth=0.8, alpha=0.6, label=key)
                ax.plot(steps, _rolling_median(values, WINDOW), linewidth=1.8, label=f"rolling median ({WINDOW})")
            else:
                main = key == group[0]
                ax.plot(steps, values, linewidth=1.6 if main else 1.0, alpha=1 if main else 0.75, label=key)
        ax.grid(alpha=0.3)
        if len(group) > 1 or group == ["grad_norm"]:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.set_ylabel(group[0], fontsize=8)
        _mark_alerts(ax, alerts, label=ax is axes[0])
    axes[0].set_title(panel.title, fontsize=10)
    axes[-1].set_xlabel("step")
    fig.savefig(path, format="png")
    return True


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn is the question
        turns = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not turns:
            return json.dumps(prompt)
        content = turns[-1]  # a string, or parts (text and images: the images are shown beside it)
        return content if isinstance(content, str) else "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(prompt)


def _prompt_html(sample: dict, run_dir: Path) -> str:
    """A sample's prompt as HTML: thumbnails of its images (the run folder's PNGs, embedded), then its text."""
    thumbnails = []
    for name in sample.get("images") or ():
        path = run_dir / str(name)
        if path.is_file():
            data = base64.b64encode(path.read_bytes()).decode()
            thumbnails.append(f'<img class="thumb" src="data:image/png;base64,{data}" alt="{html.escape(str(name))}">')
        else:
            thumbnails.append(f'<span class="note">[{html.escape(str(name))}: missing]</span>')
    return "".join(thumbnails) + html.escape(_prompt_text(sample.get("prompt")))


def _completion_html(completion) -> str:
    """A completion as HTML: its text; a conversation's tool calls and tool results set apart
    from the model's own text (classes call and tool)."""
    if not isinstance(completion, list):
        return html.escape(str(completion))
    parts = []
    for m in (m for m in completion if isinstance(m, dict)):
        if m.get("role") == "tool":
            parts.append(f'<div class="tool">&larr; {html.escape(str(m.get("name", "tool")))}: '
                         f'{html.escape(str(m.get("content", "")))}</div>')
            continue
        if m.get("content"):
            parts.append(f"<div>{html.escape(str(m['content']))}</div>")
        for call in m.get("tool_calls") or []:
            f = call.get("function", call)
            parts.append(f'<div class="call">&rarr; {html.escape(str(f.get("name")))}'
                         f'({html.escape(json.dumps(f.get("arguments")))})</div>')
    return "".join(parts)


def _samples(path: Path) -> list[dict]:
    records = read_metrics(path)  # the same JSONL reading: a cut-off last line is left out
    steps = sorted({r["step"] for r in records})
    if len(steps) > SAMPLE_STEPS:
        picks = [steps[round(i * (len(steps) - 1) / (SAMPLE_STEPS - 1))] for i in range(SAMPLE_STEPS)]
        steps = sorted(set(picks))
    chosen = []
    for step in steps:
        chosen += [r for r in records if r["step"] == step][:SAMPLES_PER_STEP]
    return chosen


def _number(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else html.escape(str(value))


def _table(headers: list[str] | None, rows: list[list[str]], cls: str = "") -> str:
    """An HTML table of cells that are already HTML (escaped by the caller)."""
    head = "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr></thead>" if headers else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">{head}<tbody>{body}</tbody></table>'


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; } .plots img { width: 580px; max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 0.85em; width: 100%; }
th, td { border: 1px solid #ddd; padding: 4px 6px; vertical-align: top; text-align: left; }
th { background: #f4f4f4; } .samples td { white-space: pre-wrap; }
.samples td:nth-child(2), .samples td:nth-child(3) { font-family: ui-monospace, monospace; }
.alerts td:first-child { color: #d000d0; font-weight: 600; } .note { color: #666; }
.call { color: #0060c0; font-family: monospace; } .tool { color: #207020; font-family: monospace; }
.thumb { width: 64px; height: 64px; object-fit: contain; border: 1px solid #ccc; margin: 0 4px 4px 0; display: block; }
"""


def report(run_dir: Path) -> Path:
    """Write <run_dir>/plots/*.png and <run_dir>/report.html; return the HTML's path."""
    run_dir = Path(run_dir)
    config, rows = read_run(run_dir)
    alerts = read_metrics(run_dir / "alerts.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    images, absent = _write_plots(run_dir / "plots", rows, alerts)
    parts = [f"<h1>grpokit run: {html.escape(str(run_dir.resolve()))}</h1>",
             _table(None, [[html.escape(k), html.escape(str(v))] for k, v in _facts(run_dir, config, rows)]),
             *_alerts_html(alerts, len(train_rows)), *_curves_html(images, absent),
             *_samples_html(run_dir / "completions.jsonl")]
    return _write_page(run_dir, parts)


def _write_plots(plots_dir: Path, rows: list[dict], alerts: list[dict]) -> tuple[list, list[str]]:
    """plots/<panel>.png for each panel whose metrics the run logged: ((panel, path) of each drawn,
    the names of those not drawn)."""
    plots_dir.mkdir(exist_ok=True)
    images, absent = [], []
    for panel in PANELS:
        path = plots_dir / f"{panel.name}.png"
        if plot(panel, rows, alerts, path):
            images.append((panel, path))
        else:
            path.unlink(missing_ok=True)  # a stale plot from an earlier report of a different run
            absent.append(panel.name)
    return images, absent


def _facts(run_dir: Path, config: dict, rows: list[dict]) -> list[tuple[str, str]]:
    """The run at a glance: its status, model, data, batch, algorithm and rewards."""
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    # A partial or hand-written config.yaml: what it does not say shows as "?".
    a, r, t, m, d = ({**dict.fromkeys(keys, "?"), **(config.get(section) if isinstance(config.get(section), dict) else {})}
                     for section, keys in (("algorithm", ("loss_type", "beta")), ("rollout", ("num_generations",)),
                                           ("train", ("max_steps", "prompts_per_step", "learning_rate")),
                                           ("model", ("name",)), ("data", ("task",))))
    facts = [
        ("status", run_status(run_dir, rows, None if t["max_steps"] == "?" else t["max_steps"])),
        ("model", m["name"]),
        ("data", d.get("path") or d["task"]),
        ("batch", f"{t['prompts_per_step']} prompts x {r['num_generations']} completions per step"),
        ("algorithm", f"loss_type={a['loss_type']}, beta={a['beta']}, learning_rate={t['learning_rate']}"),
    ]
    if evals:
        first, last = evals[0], evals[-1]
        facts.append(("held-out eval/reward", f"{first['eval/reward']:.3f} at step {first['step']} -> "
                                               f"{last['eval/reward']:.3f} at step {last['step']}"))
    if train_rows:
        facts.append(("train reward, last step", f"{train_rows[-1]['reward']:.3f} at step {train_rows[-1]['step']}"))
    return facts


def _alerts_html(alerts: list[dict], steps: int) -> list[str]:
    parts = ["<h2>Alerts</h2>"]
    if alerts:
        parts.append(_table(["alert", "step", "evidence", "suggestion"],
                            [[html.escape(x["kind"]), str(x["step"]), html.escape(x["evidence"]),
                              html.escape(x["suggestion"])] for x in alerts], "alerts"))
        parts.append('<p class="note">Each plot marks these steps with a dashed magenta line. '
                     "<code>grpokit doctor</code> says which still hold at the last step.</p>")
    else:
        parts.append(f'<p class="note">No alert was raised in {steps} steps '
                     f"(the checks compare windows of {WINDOW} steps).</p>")
    return parts


def _curves_html(images: list, absent: list[str]) -> list[str]:
    parts = ["<h2>Curves</h2><div class=\"plots\">"]
    for panel, path in images:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f'<img id="plot-{panel.name}" alt="{html.escape(panel.title)}" src="data:image/png;base64,{data}">')
    parts.append("</div>")
    if absent:
        why = {"kl": "kl is logged only when algorithm.beta > 0 (a reference model)"}
        parts.append('<p class="note">Not in this run\'s metrics: ' +
                     "; ".join(html.escape(why.get(name, name)) for name in absent) + ".</p>")
    return parts


def _samples_html(path: Path) -> list[str]:
    parts = ["<h2>Sample completions</h2>"]
    samples = _samples(path)
    if samples:
        functions = list(dict.fromkeys(k for s in samples for k in s if k.startswith("rewards/")))
        parts.append(_table(
            ["step", "prompt", "completion", "reward", *[f.removeprefix("rewards/") for f in functions], "finish"],
            [[str(s["step"]), _prompt_html(s, path.parent), _completion_html(s.get("completion")),
              _number(s.get("reward")), *[_number(s.get(f, "")) for f in functions], html.escape(str(s.get("finish_reason", "")))]
             for s in samples], "samples",
        ))
        parts.append(f'<p class="note">From completions.jsonl: up to {SAMPLES_PER_STEP} completions of up to '
                     f"{SAMPLE_STEPS} logged steps (monitor.log_completions).</p>")
    else:
        parts.append('<p class="note">No completions.jsonl (monitor.log_completions=0).</p>')
    return parts


def _write_page(run_dir: Path, parts: list[str]) -> Path:
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>grpokit report: '
            f"{html.escape(run_dir.name)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(parts) +
            "\n</body></html>\n")
    out = run_dir / "report.html"
    tmp = out.with_suffix(".html.tmp")  # a report being rewritten is never seen half-written
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
