"""Continuous batching (rollout.decode_slots): what a cap on the completions decoded at once costs
in time and saves in key/value cache, on long, ragged completions.

The workload of benchmarks/ragged.py's first step: the bundled SmolLM2-135M-Instruct in float32
on CPU, 4 prompts of the built-in arithmetic task x 8 completions, at most 256 tokens, temperature
1, the same seeds for every setting. For each --slots setting (all: every completion at once, the
default), one generation by the transformers engine, timed; its completions must equal the first
setting's token for token (the run stops if not). Printed: seconds, decoding steps (forward
calls), the most rows in a step, the largest key/value cache a step held (every layer's keys and
values, MiB), decoding's waste (token positions run / tokens kept), and how many completions
are not, token for token, the first setting's (float32 rounding; tests/engines/test_decoding.py
checks they are the same in float64).

    python benchmarks/decode_slots.py         # slots all, 16, 8, 4; about 6 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def differing(batch, first) -> int:
    """How many completions of `batch` are not, token for token, those of `first`."""
    same = [torch.equal(a[a != -1], b[b != -1]) for a, b in zip(
        batch.completion_ids.masked_fill(batch.completion_mask == 0, -1),
        first.completion_ids.masked_fill(first.completion_mask == 0, -1))]
    return len(same) - sum(same)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", nargs="+", default=["all", "16", "8", "4"])
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_slots.md"))
    args = parser.parse_args()
    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.models.bundled import BUNDLED
    from grpokit.models.loading import eos_token_ids, load_model, load_tokenizer
    from grpokit.tasks.arithmetic import ArithmeticTask

    model, tokenizer = load_model(BUNDLED), load_tokenizer(BUNDLED)
    task = ArithmeticTask(seed=0, eval_size=0)
    prompts = [tokenizer.apply_chat_template(task.train_example(i).prompt, add_generation_prompt=True)
               for i in range(args.prompts)]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    params = SamplingParams(args.max_completion_length, 1.0)
    N = args.prompts * args.generations
    rows, first = [], None
    for setting in args.slots:
        engine = TransformersEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer),
                                    slots=None if setting == "all" else int(setting))
        seen = {"steps": 0, "rows": 0, "cache": 0}
        forward = engine._next_logits

        def counted(tok, attn, next_pos, cached, forward=forward, seen=seen):
            cache = cached[next(iter(cached))]
            held = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values)
                       if x is not None)
            seen.update(steps=seen["steps"] + 1, rows=max(seen["rows"], len(tok)), cache=max(seen["cache"], held))
            return forward(tok, attn, next_pos, cached)

        engine._next_logits = counted
        start = time.perf_counter()
        batch = engine.generate(prompts, args.generations, params, seeds=list(range(N)))
        seconds = time.perf_counter() - start
        if first is None:
            first = batch
            lengths = batch.completion_mask.sum(-1)
            print(f"{N} completions: mean {lengths.float().mean():.1f} tokens, longest {int(lengths.max())}", flush=True)
        rows.append((setting, seconds, seen["steps"], seen["rows"], seen["cache"] / 2**20,
                     engine.decoded_positions / engine.decoded_tokens, differing(batch, first)))
        print(f"slots {setting}: {seconds:.1f} s, {seen['steps']} steps, at most {seen['rows']} rows, "
              f"key/value cache at most {seen['cache'] / 2**20:.1f} MiB, waste {rows[-1][-2]:.2f}, "
              f"{rows[-1][-1]} completions not token for token the first setting's", flush=True)
    table = ["| slots | seconds | decoding steps | most rows in a step | largest key/value cache (MiB) | waste/decode "
             f"| completions that differ from {args.slots[0]}'s |", "|---|---|---|---|---|---|---|"]
    table += [f"| {s} | {t:.1f} | {n} | {r} | {c:.1f} | {w:.2f} | {d} |" for s, t, n, r, c, w, d in rows]
    lengths = first.completion_mask.sum(-1)
    text = (f"{N} completions ({args.prompts} prompts x {args.generations}) of at most {args.max_completion_length} "
            f"tokens, temperature 1, bundled model in float32 on {torch.get_num_threads()} CPU threads; mean "
            f"{lengths.float().mean():.1f} tokens, longest {int(lengths.max())}. A completion that differs drew, "
            "at some token, another token than with the first setting: in float32 a batch of other rows rounds "
            "otherwise, and a draw at the edge of two tokens can go the other way (in float64 they are the "
            "same).\n\n" + "\n".join(table) + f"\n\ntorch {torch.__version__}\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
