"""Where the transformers engine's generation time goes on a GPU: seconds per decoded token, the
model's bare forward for comparison, and torch.profiler's table (CPU time against CUDA time).

    python benchmarks/profile_generate.py --model <folder> [--dtype bfloat16] [--tokens 128] [--decoder static]

A model folder made from a config with random weights does (the work does not depend on them).
--decoder is rollout.decoder (dynamic: the cache grown token by token; static: a cache sized once,
each step replayed as a CUDA graph). Printed: the time per decoded token, the bare forward's, and,
from a profiled generation of 32 tokens, kernel launches per token (a graph replay counted as one),
host (CPU) time against GPU time, and the profiler's table.
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
    parser.add_argument("--decoder", default="dynamic", choices=("dynamic", "static"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from torch.profiler import ProfilerActivity, profile

    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.transformers_engine import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = TransformersEngine(model, tokenizer.pad_token_id or 0, [tokenizer.eos_token_id], decoder=args.decoder)
    prompts = [[1 + i] * 40 for i in range(args.prompts)]
    n = args.prompts * args.generations
    seeds = list(range(n))
    engine.generate(prompts, args.generations, SamplingParams(args.tokens), seeds)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, args.generations, SamplingParams(args.tokens), seeds)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    print(f"decoder {args.decoder}: generate {n} x {args.tokens} tokens: {took:.2f} s, "
          f"{took / args.tokens * 1000:.1f} ms per token step, peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
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
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                        "cuLaunchKernelEx", "cudaGraphLaunch"))
    graphs = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    gpu = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / 1e6
    print(f"profiled generate of 32 tokens: {launches / 32:.0f} launches per token ({graphs} graph replays), "
          f"host {events.self_cpu_time_total / 1e6:.3f} s, GPU {gpu:.3f} s")
    print(events.table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=40))


if __name__ == "__main__":
    main()
