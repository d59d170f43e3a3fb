"""final/README.md: a Hugging Face model card for the trained model, as TRL writes one.

YAML metadata first (base model, library, tags, datasets where they are Hub ids), then how the
model was trained: the task or data, the reward functions, the eval table at each evaluation, the
reward plot (final/reward.png) and the resolved config.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from grpokit.models.bundled import BUNDLED, TINY, TINY_VLM

# The Hub id of a model grpokit ships under another name.
HUB_IDS = {BUNDLED: "HuggingFaceTB/SmolLM2-135M-Instruct"}


def _hub_id(name: str | None) -> str | None:
    """`name` when it is a Hub id (owner/name, not a local path), or the one a built-in name stands for."""
    if name in HUB_IDS:
        return HUB_IDS[name]
    if not name or name in (TINY, TINY_VLM) or Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return None
    return name if name.count("/") == 1 else None


def _number(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def model_card(config: dict, eval_history: list[dict], reward_names: list[str], run_name: str,
               plot: str | None) -> str:
    """The card's text; `config` is the run's resolved config (as config.yaml holds it)."""
    model, data = config["model"], config["data"]
    base = _hub_id(model["name"])
    dataset = _hub_id(data.get("path")) if data.get("path") else None
    meta = {
        **({"base_model": base} if base else {}),
        **({"base_model_relation": "adapter" if model.get("lora_rank") else "finetune"} if base else {}),
        "library_name": "grpokit",
        "model_name": run_name,
        "pipeline_tag": "text-generation",
        # The folder is a transformers model (a peft adapter with LoRA): the tags say how to load it.
        "tags": ["grpokit", "grpo", "reinforcement-learning", "transformers", *(["peft", "lora"] if model.get("lora_rank") else [])],
        **({"datasets": [dataset]} if dataset else {}),
    }
    trained_on = (f"the dataset `{data['path']}`" if data.get("path")
                  else f"grpokit's task `{data['task']}`" + (f" with `{data['task_args']}`" if data.get("task_args") else ""))
    source = f"[{base}](https://huggingface.co/{base})" if base else f"`{model['name']}`"
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "",
        f"# {run_name}", "",
        f"This model is {source} trained with "
        f"GRPO (Group Relative Policy Optimization) by [grpokit](https://pypi.org/project/grpokit/) on {trained_on}.",
        "",
        "## Training", "",
        f"- loss: `{config['algorithm']['loss_type']}`, KL coefficient beta {config['algorithm']['beta']}, "
        f"{config['rollout']['num_generations']} completions per prompt, {config['train']['prompts_per_step']} prompts "
        f"per step, {config['train']['max_steps']} steps, learning rate {config['train']['learning_rate']}",
        "- reward functions: " + ", ".join(f"`{n}`" for n in reward_names),
        "",
    ]
    if model.get("lora_rank"):
        lines += _adapter_section(model)
    keys = list(dict.fromkeys(k for row in eval_history for k in row if k.startswith("eval/")))
    if eval_history and keys:
        lines += ["## Evaluation", "", "Held-out prompts, greedy, at each evaluation:", "",
                  "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += ["| " + " | ".join(_number(row.get(k, "")) for k in ["step", *keys]) + " |" for row in eval_history]
        lines.append("")
    if plot:
        lines += [f"![reward per step]({plot})", ""]
    lines += ["## Config", "", "The resolved config (`grpokit train --config` takes it as it is where every reward function, "
              "tool and environment is a built-in or named by `module:name` or a file):", "", "```yaml",
              yaml.safe_dump(config, sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


def _adapter_section(model: dict) -> list[str]:
    """How to load and merge a LoRA run's adapter (a quantized base: onto that base)."""
    quantization = model.get("quantization", "none")
    base = f"`{model['name']}`" + (f" quantized to {quantization} by bitsandbytes (QLoRA)" if quantization != "none" else "")
    return ["## Loading", "",
            f"This folder is a LoRA adapter (peft) trained on {base}. `grpokit eval --model <this folder>` loads it "
            "merged into its base" + (", the base's weights dequantized as the adapters saw them in training"
                                      if quantization != "none" else "") + "; `grpokit train --merge` (on the run's "
            "command) also writes `merged/`, a plain transformers model folder with the adapter merged in.", ""]


def write_model_card(run_dir: Path, config: dict, eval_history: list[dict], reward_names: list[str]) -> Path:
    """final/README.md and final/reward.png for the run in `run_dir`; the card's path."""
    from grpokit.rundir.folder import read_metrics
    from grpokit.rundir.report import PANELS, plot

    final = run_dir / "final"
    for name in ("README.md", "reward.png"):
        # final/'s files are hard links to the checkpoint's (peft writes a README.md there): a new
        # file, not a write through the link, which would change the checkpoint.
        (final / name).unlink(missing_ok=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    drawn = plot(next(p for p in PANELS if p.name == "reward"), rows, [], final / "reward.png")
    card = final / "README.md"
    card.write_text(model_card(config, eval_history, reward_names, run_dir.name, "reward.png" if drawn else None))
    return card
