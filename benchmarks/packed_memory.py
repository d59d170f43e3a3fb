"""Peak memory of the training pass, packed (train.micro_batch_tokens) against padded
(train.micro_batch_size), as the longest completion grows.

The bundled SmolLM2-135M-Instruct, float32 on CPU, in training mode: the forward and backward
passes of one update (models/logprobs.py LogProbs, micro-batch by micro-batch as the trainer's
update runs them) over a ragged batch of 4 prompts x 8 completions: 28 short ones (5 to 60
tokens) and 4 that reach the cap L. A packed micro-batch holds at most --budget tokens, so its peak
follows the budget; a padded one holds --micro-batch completions padded to the longest, so its peak
follows L.

Every measurement runs in a fresh process; its figure is the peak resident memory during the passes
minus the resident memory just before them, after a warm-up pass and with the gradient buffers
already allocated (as benchmarks/logprob_memory.py measures).

    python benchmarks/packed_memory.py                 # L = 256 and 512; about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def ragged_batch(cap: int, tokenizer):
    import torch

    from grpokit.engines.batch import RolloutBatch
    from grpokit.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=0, eval_size=0)
    prompts = [tokenizer.apply_chat_template(task.train_example(i).prompt, add_generation_prompt=True) for i in range(4)]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    lengths = [5 + (7 * i) % 56 for i in range(28)] + [cap] * 4
    lengths = [lengths[(5 * i) % 32] for i in range(32)]  # the long ones spread over the groups
    width, N = max(map(len, prompts)), 32
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.zeros((N, width), dtype=torch.long)
    prompt_mask = torch.zeros((N, width), dtype=torch.long)
    completion_ids = torch.randint(0, 49152, (N, cap), generator=generator)
    completion_mask = torch.zeros((N, cap), dtype=torch.long)
    for i, n in enumerate(lengths):
        p = prompts[i // 8]
        prompt_ids[i, width - len(p):] = torch.tensor(p)
        prompt_mask[i, width - len(p):] = 1
        completion_mask[i, :n] = 1
    return RolloutBatch(torch.arange(N) // 8, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        torch.zeros((N, cap)), None, ["stop"] * N)


def measure(cap: int, budget: int | None, micro_batch: int) -> dict:
    import torch

    from grpokit.models.bundled import BUNDLED
    from grpokit.models.loading import load_model, load_tokenizer
    from grpokit.models.logprobs import LogProbs

    torch.manual_seed(0)
    model = load_model(BUNDLED).train()
    for p in model.parameters():  # as the trainer does at start: gradients live outside the step
        p.grad = torch.zeros_like(p)
    batch = ragged_batch(cap, load_tokenizer(BUNDLED))
    passes = LogProbs(model, None, 1.0, None, False, False, micro_batch, torch.device("cpu"),
                      micro_batch_tokens=budget)
    rows = torch.arange(32)

    def update(rows):
        for mb in passes.micro_batches(batch, rows):
            logps = passes.of(model, batch, mb)  # (M, T)
            (logps * batch.completion_mask[mb]).sum().backward()

    update(rows[:2])  # warm-up: the first backward faults in library code and workspaces
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident memory
    before = _kib("VmRSS")
    start = time.perf_counter()
    update(rows)
    return {"cap": cap, "budget": budget, "micro_batch": micro_batch, "peak_mib": (_kib("VmHWM") - before) / 1024,
            "seconds": time.perf_counter() - start, "tokens": int(batch.completion_mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # cap budget|none micro_batch: the child
    args = parser.parse_args()
    if args.one:
        cap, budget, micro_batch = int(args.one[0]), None if args.one[1] == "none" else int(args.one[1]), int(args.one[2])
        print(json.dumps(measure(cap, budget, micro_batch)))
        return
    rows = []
    for cap in args.caps:
        for budget in (args.budget, None):
            out = subprocess.run([sys.executable, __file__, "--one", str(cap), str(budget or "none"),
                                  str(args.micro_batch)], capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            kind = f"packed, budget {budget}" if budget else f"padded, {args.micro_batch} a micro-batch"
            print(f"L={cap:>5} {kind:>24}: peak +{r['peak_mib']:7.0f} MiB  {r['seconds']:6.1f} s", flush=True)
    print(f"\n| longest completion L | packed ({args.budget} tokens) peak | padded ({args.micro_batch} completions) "
          "peak | packed time | padded time |")
    print("|---|---|---|---|---|")
    for cap in args.caps:
        packed, padded = (next(r for r in rows if r["cap"] == cap and r["budget"] == b) for b in (args.budget, None))
        print(f"| {cap} | {packed['peak_mib']:.0f} MiB | {padded['peak_mib']:.0f} MiB | {packed['seconds']:.1f} s | "
              f"{padded['seconds']:.1f} s |")


if __name__ == "__main__":
    main()
