"""What one decoding step costs against the completions in it: why dropping ended completions
saves less time than tokens on a CPU.

The bundled SmolLM2-135M-Instruct in float32, a key/value cache of 100 prompt tokens per row, one
decoding step (a token per row through the model) timed over 10 steps, for batches of 1 to 64
rows. Each step reads every weight once whatever the rows, so a step of one row costs a good part
of a step of 32: a decoder that drops the completions that ended computes fewer tokens, but still
takes one step per token of the longest completion.

    python benchmarks/decode_rows.py            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    from grpokit.models.bundled import BUNDLED
    from grpokit.models.loading import load_model
    from grpokit.models.logprobs import cache_inputs

    model = load_model(BUNDLED).eval()
    print(f"{args.threads} threads; ms per decoding step (median of {STEPS}, after 2 not counted), and per row in it:")
    for rows in args.rows:
        with torch.no_grad():
            cache = DynamicCache()
            cached = cache_inputs(model, cache)
            model(input_ids=torch.randint(0, 49152, (rows, 100)), **cached)
            token = torch.randint(0, 49152, (rows, 1))
            times = []
            for i in range(2 + STEPS):
                start = time.perf_counter()
                model(input_ids=token, position_ids=torch.full((rows, 1), 100 + i), **cached)
                times.append(time.perf_counter() - start)
            step = statistics.median(times[2:])
        print(f"{rows:3d} rows: {step * 1000:6.1f} ms a step, {step * 1000 / rows:6.1f} ms a row", flush=True)


if __name__ == "__main__":
    main()
