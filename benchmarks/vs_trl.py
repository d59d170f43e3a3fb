"""grpokit against TRL's GRPOTrainer on the same work, side by side, on this machine.

    pip install 'grpokit[bench]'        # TRL, for this benchmark only
    python benchmarks/vs_trl.py          # 30 steps each, about 12 minutes on 2 CPU cores
    python benchmarks/vs_trl.py --device cuda --dtype bfloat16 --model <folder> --prompts 8 \
        --max-completion-length 256 --out <file>     # on a GPU (the figures: benchmarks/results/)

Each trainer runs in its own process (so each has its own peak resident memory), and they take
turns: grpokit step 1, TRL step 1, grpokit step 2, ... (A B A B), each running alone on the
machine's cores while the other waits. The work is the same: the bundled SmolLM2-135M-Instruct in
float32 on CPU, the built-in arithmetic task's prompts (the same prompts in the same order), its
two reward functions with the same weights, 2 prompts x 8 generations = 16 completions of at
most 16 tokens per step, one optimizer update per step over all 16, loss_type dapo, beta 0.04 (so
both run a reference model, and every completion goes through forward and backward: with beta 0,
grpokit skips completions whose advantage is exactly 0, and on this task most are), group reward
scaling, clip epsilon 0.2, gradient clipping at 1.0, AdamW at a constant 1e-6, no weight
decay, temperature 1, no activation checkpointing (TRL's default turns it on; both off here).

Reported per trainer: step wall time (median, and the 10th to 90th percentile over the steps after
the first), generated tokens per second (completion tokens sampled), trained tokens per second
(prompt + completion tokens of the batch the update learns from), and peak resident memory of the
process. For grpokit, its own per-phase times (metrics.jsonl's time/*) split the step.
The table is printed and written to benchmarks/results/vs_trl.md. On a GPU (--device cuda), both
train there, and the peak GPU memory each allocated is reported too; --model, --dtype, --prompts
and --generations change the work for both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

LR = 1e-6


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def grpokit_worker(conn, args, src: str | None = None, overrides: tuple[str, ...] = ()) -> None:
    """src: the src/ folder of another grpokit checkout to run instead of this one (a worktree of an
    older commit, say); overrides: config overrides added to the benchmark's own."""
    import torch

    torch.set_num_threads(args.threads)
    if src is not None:
        sys.path.insert(0, src)
    try:
        from grpokit.config.loading import load_config
        from grpokit.runtime.allocator import keep_freed_memory
        from grpokit.training.trainer import Trainer
    except ImportError:  # a checkout from before the code's layers (997ce89)
        from grpokit.allocator import keep_freed_memory
        from grpokit.config import load_config
        from grpokit.trainer import Trainer

    PROMPTS_PER_STEP, GENERATIONS = args.prompts, args.generations
    config = load_config(None, [
        f"model.name={args.model}", f"model.dtype={args.dtype}", f"train.prompts_per_step={PROMPTS_PER_STEP}",
        f"rollout.num_generations={GENERATIONS}", f"rollout.max_completion_length={args.max_completion_length}",
        f"rollout.decoder={args.decoder}", f"train.logprob_chunk_size={'null' if args.logprob_chunk_size is None else args.logprob_chunk_size}",
        "algorithm.loss_type=dapo", f"algorithm.beta={args.beta}", "algorithm.scale_rewards=group", "algorithm.epsilon=0.2",
        "train.max_grad_norm=1.0", f"train.learning_rate={LR}", "train.weight_decay=0.0", "train.warmup_steps=0",
        f"train.max_steps={args.steps}", "data.eval_size=0", "train.eval_every=0", "train.save_every=0",
        "train.keep_checkpoints=1", f"train.output_dir={Path(args.workdir) / f'grpokit-run-{os.getpid()}'}",
        "train.resume=never", *overrides,
    ])
    keep_freed_memory()  # as `grpokit train` does (grpokit/runtime/allocator.py)
    trainer = Trainer(config, progress=False)
    lengths = []  # each generation's completion lengths
    engine, generate = trainer.sampler.engine, trainer.sampler.engine.generate

    def recorded(*a, **k):
        batch = generate(*a, **k)
        lengths.extend(batch.completion_mask.sum(-1).tolist())
        return batch

    engine.generate = recorded
    conn.send("ready")
    for step in range(1, args.steps + 1):
        conn.recv()
        start = time.perf_counter()
        metrics = trainer.train_step(step)  # its prompts: the next PROMPTS_PER_STEP of the data stream
        wall = time.perf_counter() - start
        generated = metrics["completions/mean_length"] * PROMPTS_PER_STEP * GENERATIONS
        conn.send({"wall": wall, "generated": generated, "tokens": metrics["num_tokens"],
                   "parts": {k: v for k, v in metrics.items() if k.startswith("time/")},
                   "waste": {k: v for k, v in metrics.items() if k.startswith("waste/")},
                   "lengths": lengths[:], "reward": metrics["reward"], "zero_std": metrics["frac_reward_zero_std"]})
        lengths.clear()
    conn.send(peaks())


def peaks() -> dict:
    import torch

    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {"peak_rss": peak_rss_mib(), "peak_gpu": gpu}


def trl_worker(conn, args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.models.bundled import bundled_model_path
    from grpokit.rewards.reward_set import get_reward_function
    from grpokit.tasks.arithmetic import ArithmeticTask

    PROMPTS_PER_STEP, GENERATIONS = args.prompts, args.generations
    task = ArithmeticTask(seed=0, eval_size=0)
    stream = task.train_stream()
    # The prompts grpokit draws, in its order (TRL must not shuffle them).
    rows = [next(stream) for _ in range(PROMPTS_PER_STEP * args.steps)]
    dataset = Dataset.from_list([{"prompt": e.prompt, **e.columns} for e in rows])
    folder = bundled_model_path() if args.model == "smollm2-135m-instruct" else args.model
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    names, weights = zip(*task.reward_functions)
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl-run"), use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16",
        fp16=False, seed=0,
        # A step's completions in micro-batches of trl_micro_batch (gradients accumulated), or all at once.
        per_device_train_batch_size=getattr(args, "trl_micro_batch", None) or PROMPTS_PER_STEP * GENERATIONS,
        num_generations=GENERATIONS,
        gradient_accumulation_steps=PROMPTS_PER_STEP * GENERATIONS // (getattr(args, "trl_micro_batch", None)
                                                                       or PROMPTS_PER_STEP * GENERATIONS), max_completion_length=args.max_completion_length, loss_type="dapo",
        beta=args.beta, scale_rewards="group", epsilon=0.2, max_grad_norm=1.0, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, temperature=1.0, top_p=1.0, max_steps=args.steps,
        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, reward_weights=list(weights), shuffle_dataset=False, dataloader_num_workers=0,
    )
    out = {}

    class TakeTurns(TrainerCallback):
        def on_step_begin(self, *a, **k):
            conn.recv()
            out["start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            out["wall"] = time.perf_counter() - out["start"]

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "num_tokens" in logs and "wall" in out:
                conn.send({"wall": out.pop("wall"), "tokens": logs["num_tokens"],
                           "generated": logs["completions/mean_length"] * PROMPTS_PER_STEP * GENERATIONS,
                           "reward": logs["reward"]})

    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=config, train_dataset=dataset,
                          reward_funcs=[get_reward_function(n) for n in names], callbacks=[TakeTurns()])
    trainer.remove_callback(PrinterCallback)  # its per-step log lines; the benchmark prints its own
    conn.send("ready")
    trainer.train()
    conn.send(peaks())


def take_turns(runs: dict, args) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Each run of `runs` ({name: (worker, extra arguments)}) in a process of its own, taking turns a
    step at a time (A B A B), each alone on the machine's cores while the others wait: each run's
    rows (one a step, as its worker sends them) and its peak memory."""
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        ctx = mp.get_context("spawn")
        workers = {}
        for name, (target, extra) in runs.items():
            mine, theirs = ctx.Pipe()
            process = ctx.Process(target=target, args=(theirs, args, *extra), daemon=True)
            process.start()
            workers[name] = (process, mine)
        for name, (_, conn) in workers.items():
            assert conn.recv() == "ready", name
        steps = {name: [] for name in workers}
        for step in range(1, args.steps + 1):
            for name, (_, conn) in workers.items():  # one at a time
                conn.send("go")
                steps[name].append(conn.recv())
            print(f"step {step:3d}: " + "   ".join(f"{n} {rows[-1]['wall']:6.2f} s" for n, rows in steps.items()),
                  flush=True)
        peaks = {name: conn.recv() for name, (_, conn) in workers.items()}
        for process, _ in workers.values():
            process.join(timeout=60)
    return steps, peaks


def write_table(lines: list[str], out: str) -> None:
    """Print the table's lines and write them to `out`."""
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(table)
    print(f"written to {out}")


def summary(steps: list[dict]) -> dict:
    """Median and 10-90th percentile of step wall time over the steps after the first; rates."""
    later = steps[1:]
    walls = sorted(s["wall"] for s in later)
    q = statistics.quantiles(walls, n=10, method="inclusive") if len(walls) > 1 else [walls[0]] * 9
    # num_tokens is cumulative: each step's trained tokens are its increase.
    trained = [b["tokens"] - a["tokens"] for a, b in zip(steps, steps[1:])]
    return {"median": statistics.median(walls), "p10": q[0], "p90": q[-1],
            "generated_per_s": sum(s["generated"] for s in later) / sum(walls),
            "trained_per_s": sum(trained) / sum(walls)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient of both (0: no reference model)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vs_trl.md"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="float32", help="model.dtype of both (bfloat16 on a GPU)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the bundled model, or a model folder")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--decoder", default="auto", help="grpokit's rollout.decoder (auto: the device's default)")
    parser.add_argument("--logprob-chunk-size", type=int, default=None,
                        help="grpokit's train.logprob_chunk_size (a memory knob; 0: all at once; default: the device's)")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # both train on the CPU, even on a machine with a GPU
    import trl  # noqa: F401 - fail before anything starts: pip install 'grpokit[bench]'

    from grpokit.models.bundled import bundled_model_path

    if args.model == "smollm2-135m-instruct":
        bundled_model_path()  # converted once here, not inside a timed process
    steps, peaks = take_turns({"grpokit": (grpokit_worker, ()), "TRL": (trl_worker, ())}, args)

    s = {name: summary(rows) for name, rows in steps.items()}
    later = steps["grpokit"][1:]
    parts = {k.removeprefix("time/"): statistics.median(r["parts"][k] for r in later) for k in later[0]["parts"]}
    parts["overhead"] = statistics.median(r["wall"] - sum(r["parts"].values()) for r in later)
    import torch
    import transformers
    import trl as trl_module

    lines = [
        f"{args.steps} steps each, alternated; {args.prompts * args.generations} completions of at most "
        f"{args.max_completion_length} tokens per step; loss_type dapo, beta {args.beta:g}; {args.model}, {args.dtype}, "
        f"grpokit's rollout.decoder={args.decoder} and train.logprob_chunk_size={args.logprob_chunk_size}, "
        + (f"{torch.cuda.get_device_name()}; " if args.device == "cuda" else f"{args.threads} CPU threads; ")
        + f"torch {torch.__version__}, "
        f"transformers {transformers.__version__}, TRL {trl_module.__version__}.",
        "",
        "| | grpokit | TRL GRPOTrainer | TRL / grpokit |",
        "|---|---|---|---|",
        f"| step time, median (s) | {s['grpokit']['median']:.2f} | {s['TRL']['median']:.2f} | "
        f"**{s['TRL']['median'] / s['grpokit']['median']:.1f}x** |",
        f"| step time, 10th-90th percentile (s) | {s['grpokit']['p10']:.2f}-{s['grpokit']['p90']:.2f} | "
        f"{s['TRL']['p10']:.2f}-{s['TRL']['p90']:.2f} | |",
        f"| generated tokens / s | {s['grpokit']['generated_per_s']:.0f} | {s['TRL']['generated_per_s']:.0f} | |",
        f"| trained tokens / s | {s['grpokit']['trained_per_s']:.0f} | {s['TRL']['trained_per_s']:.0f} | |",
        f"| peak resident memory (MiB) | {peaks['grpokit']['peak_rss']:.0f} | {peaks['TRL']['peak_rss']:.0f} | "
        f"{peaks['TRL']['peak_rss'] / peaks['grpokit']['peak_rss']:.2f}x |",
        *([f"| peak GPU memory allocated (MiB) | {peaks['grpokit']['peak_gpu']:.0f} | {peaks['TRL']['peak_gpu']:.0f} | "
           f"{peaks['TRL']['peak_gpu'] / peaks['grpokit']['peak_gpu']:.2f}x |"] if args.device == "cuda" else []),
        f"| mean reward over the steps | {statistics.mean(r['reward'] for r in steps['grpokit']):.3f} | "
        f"{statistics.mean(r['reward'] for r in steps['TRL']):.3f} | |",
        "",
        *([] if args.beta else [
            "With beta 0, a completion whose advantage is exactly 0 (every member of a group scored alike) adds "
            "exactly 0 to the loss and the gradient: grpokit skips its forward and backward, TRL computes them. "
            f"Here {statistics.mean(r['zero_std'] for r in steps['grpokit']):.0%} of grpokit's groups were such.",
            ""]),
        "grpokit's step, median seconds by phase (metrics.jsonl's time/*; overhead: the rest of the step, "
        "rewards and bookkeeping): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + ".",
    ]
    write_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
