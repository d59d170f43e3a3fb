"""The start-up estimate of a process's peak memory (config/memory.py) against the peak it reaches.

Each case is a `grpokit train` run in a process of its own: two steps on a model with the bundled
SmolLM2-135M-Instruct's config and random weights (a random model almost never samples its end token,
so every completion runs to rollout.max_completion_length: the estimate's longest case; the reward
is `length`, in characters, which differs between completions, so every step trains), or with
`--shape qwen3-1.7b` Qwen3-1.7B's shape (hidden 2048, 28 layers, vocabulary 151,936). The estimate
is the run's own start-up line; the measured peak is the process's peak resident memory (ru_maxrss
from wait4). Prints a Markdown table and each run's start-up line.

    python benchmarks/memory.py                          # full, LoRA, QLoRA in float32 and bfloat16
    python benchmarks/memory.py --shape qwen3-1.7b --cases full-float32 qlora-float32

Each shape's run ends with the bytes one weight push to a rollout server carries for LoRA at rank
16 on all linear layers: the merged weights (in float32 and bfloat16) against the adapters alone
(`weights/push_bytes`), the tensors counted as the trainer's client lays them out, on the model
built on the meta device.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Work per step: float32 fills the activations; bfloat16 matmuls are ~400x slower on a CPU, so its
# runs are short and mostly measure the weights and their state.
WORK = {
    "float32": ["train.prompts_per_step=2", "rollout.num_generations=8", "rollout.max_completion_length=96"],
    "bfloat16": ["train.prompts_per_step=1", "rollout.num_generations=2", "rollout.max_completion_length=8"],
}
TRAINING = {"full": [], "lora": ["model.lora_rank=16"], "qlora": ["model.lora_rank=16", "model.quantization=nf4"]}
CASES = [f"{t}-{d}" for d in WORK for t in TRAINING]
SHAPES = {
    "smollm2-135m": None,  # the bundled model's config
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1000000.0),
}


def random_model(shape: str, folder: Path) -> Path:
    """A model folder of `shape` with random weights (seed 0) and the bundled tokenizer."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpokit.models.bundled import bundled_model_path, bundled_tokenizer

    tokenizer = bundled_tokenizer()
    if SHAPES[shape] is None:
        config = AutoConfig.from_pretrained(bundled_model_path())
    else:
        settings = dict(SHAPES[shape])
        config = AutoConfig.for_model(settings.pop("model_type"), **settings, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(case: str, model: Path, extra: list[str]) -> tuple[str, float, str]:
    """(the start-up line, the peak resident GB, the run's output's last line) of one case."""
    training, dtype = case.rsplit("-", 1)
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "grpokit", "train", "--no-progress", f"model.name={model}", f"model.dtype={dtype}",
                "train.max_steps=2", "data.eval_size=0", "train.save_every=0", "reward.functions=[length]", f"train.output_dir={out}/run",
                *WORK[dtype], *TRAINING[training], *extra]
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)
    line = next((s for s in output.splitlines() if s.startswith(("peak memory per process", "grpokit: peak memory"))), "")
    return line, usage.ru_maxrss * 1024 / 1e9, output.strip().splitlines()[-1] if output.strip() else ""


def push_bytes(model: Path, rank: int = 16) -> str:
    """A line: the bytes of a merged push (float32, bfloat16) and of an adapter-only one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpokit.config.loading import load_config
    from grpokit.engines.weights import adapter_tensors, base_weights
    from grpokit.models.loading import apply_lora

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.float32)
    lora = apply_lora(base, load_config(None, [f"model.lora_rank={rank}"]).model, str(model))
    merged = sum(t.numel() for _, t in base_weights(lora))  # the merged weights' names and shapes are the base's
    adapters = sum(t.numel() * t.element_size() for _, t in adapter_tensors(lora))
    return (f"bytes per push, LoRA rank {rank}: merged {merged * 4 / 1e9:.2f} GB (float32), {merged * 2 / 1e9:.2f} GB "
            f"(bfloat16); adapters alone {adapters / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "grpokit-memory-models",
                        help="where the random models are written (once)")
    parser.add_argument("overrides", nargs="*", help="more section.field=value for every run")
    args = parser.parse_args()
    model = random_model(args.shape, args.folder / args.shape)
    rows, lines = [], []
    for case in args.cases:
        line, measured, last = run(case, model, args.overrides)
        found = re.search(r"peak memory per process: ([\d.]+) GB", line)
        if found is None:
            rows.append(f"| {case} | (no estimate: {last}) | {measured:.2f} | |")
            continue
        estimated = float(found.group(1))
        refused = line.startswith("grpokit:")
        rows.append(f"| {case} | {estimated:.1f} | {'refused at start-up' if refused else f'{measured:.2f}'} | "
                    f"{'' if refused else f'{estimated / measured:.2f}'} |")
        lines.append(f"{case}: {line}")
        print(rows[-1], flush=True)
    print(f"\nshape: {args.shape}; overrides: {' '.join(args.overrides) or 'none'}\n")
    print("| case | estimated peak (GB) | measured peak (GB) | estimated / measured |\n|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + "\n".join(lines))
    print("\n" + push_bytes(model))


if __name__ == "__main__":
    main()
