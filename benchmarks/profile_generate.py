"""Where the transformers engine's generation time goes on a GPU: seconds per decoded token, the
model's bare forward for comparison, and torch.profiler's table (CPU time against CUDA time).

    python benchmarks/profile_generate.py --model <folder> [--dtype bfloat16] [--tokens 128]

A model folder made from a config with random weights does (the work does not depend on them).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from torch.profiler import ProfilerActivity, profile

    from grpokit.rollout import SamplingParams
    from grpokit.rollout.transformers_engine import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = TransformersEngine(model, tokenizer.pad_token_id or 0, [tokenizer.eos_token_id])
    prompts = [[1 + i] * 40 for i in range(args.prompts)]
    n = args.prompts * args.generations
    seeds = list(range(n))
    engine.generate(prompts, args.generations, SamplingParams(args.tokens), seeds)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, args.generations, SamplingParams(args.tokens), seeds)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    print(f"generate {n} x {args.tokens} tokens: {took:.2f} s, {took / args.tokens * 1000:.1f} ms per token step")
    ids = torch.randint(0, model.config.vocab_size, (n, 1), device="cuda")
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(args.tokens):
            model(input_ids=ids)
        torch.cuda.synchronize()
    print(f"the model's bare forward on {n} tokens: {(time.perf_counter() - start) / args.tokens * 1000:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, args.generations, SamplingParams(32), seeds)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=40))


if __name__ == "__main__":
    main()
