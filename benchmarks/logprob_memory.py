"""Peak memory of the log-prob step, with and without train.logprob_chunk_size.

The bundled SmolLM2-135M-Instruct (vocabulary 49,152), float32 on CPU, in training mode with
activation checkpointing (model.gradient_checkpointing), so that what is left to grow with the
sequence is mostly the output layer's logits: one completion of L tokens after a 16-token prompt,
forward and backward of grpokit.models.logprobs.completion_logprobs.

Every measurement runs in a fresh process. Its figure is the peak resident memory during the step
minus the resident memory just before it, after a 16-token warm-up step (the first backward
faults in library code and workspaces) and with the parameters' gradient buffers already
allocated (the trainer allocates them once, at start): the peak is reset first (writing 5 to
/proc/self/clear_refs resets VmHWM) and read from /proc/self/status after.

    python benchmarks/logprob_memory.py                 # L = 512, 2048, 8192; chunks of 1024 tokens
    python benchmarks/logprob_memory.py --lengths 512 --chunk 256
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


def measure(length: int, chunk: int | None) -> dict:
    import torch

    from grpokit.models.bundled import BUNDLED
    from grpokit.models.loading import enable_activation_checkpointing, load_model
    from grpokit.models.logprobs import completion_logprobs

    torch.manual_seed(0)
    model = load_model(BUNDLED).train()
    enable_activation_checkpointing(model)
    for p in model.parameters():  # as the trainer does at start: gradients live outside the step
        p.grad = torch.zeros_like(p)
    prompt = torch.randint(0, 49152, (1, 16))
    completion = torch.randint(0, 49152, (1, length))

    def step(completion):
        logps = completion_logprobs(model, prompt, torch.ones_like(prompt), completion, chunk_size=chunk,
                                    share_prompt=False)
        logps.sum().backward()

    step(completion[:, :16])  # warm-up: the first backward faults in ~1 GB of library code and workspaces
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident memory
    before = _kib("VmRSS")
    start = time.perf_counter()
    step(completion)
    seconds = time.perf_counter() - start
    return {"length": length, "chunk": chunk, "peak_mib": (_kib("VmHWM") - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # length chunk|none: the child process
    args = parser.parse_args()
    if args.one:
        length, chunk = int(args.one[0]), None if args.one[1] == "none" else int(args.one[1])
        print(json.dumps(measure(length, chunk)))
        return
    rows = []
    for length in args.lengths:
        for chunk in (None, args.chunk):
            out = subprocess.run([sys.executable, __file__, "--one", str(length), str(chunk or "none")],
                                 capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"L={r['length']:>5}  chunk={str(r['chunk']):>5}: peak +{r['peak_mib']:8.0f} MiB  {r['seconds']:6.1f} s",
                  flush=True)
    print("\n| completion tokens | logits alone (L x 49,152 x 4 B) | peak, all at once | peak, chunks of "
          f"{args.chunk} | time, all at once | time, chunked |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        whole, chunked = (next(r for r in rows if r["length"] == length and r["chunk"] == c) for c in (None, args.chunk))
        print(f"| {length} | {length * 49152 * 4 / 2**20:.0f} MiB | {whole['peak_mib']:.0f} MiB | "
              f"{chunked['peak_mib']:.0f} MiB | {whole['seconds']:.1f} s | {chunked['seconds']:.1f} s |")


if __name__ == "__main__":
    main()
