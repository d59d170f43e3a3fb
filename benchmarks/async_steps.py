"""Synchronous against asynchronous steps (rollout.max_staleness 0 and 1; with --in-flight, 1 with
rollout.in_flight_updates too; with --partial, 1 with partial rollouts too) on the default task,
the trainer and one rollout server each pinned to a core of their own; then two servers against one.

    python benchmarks/async_steps.py [--steps 20] [--model NAME] [--no-pin] [--in-flight] [--partial] [section.field=value ...]

Each run: the bundled model, the built-in task, `train.max_steps` steps, held-out greedy accuracy
(eval/reward) before and after. The server runs `taskset -c 1` with 1 thread, the trainer
`taskset -c 0` with 1 thread (the machine's 2 cores; on a bigger machine pick the cores with
--trainer-core / --server-core; --no-pin leaves them unpinned, as on a GPU machine, and overrides
after the options go to every run). Printed: each run's median phase times and step time, the async /
sync ratio of median step times, and the held-out accuracy; then the two-server run against the
one-server synchronous run: equal, or the keys that differ. The runs are written to runs/async_steps/,
their metrics.jsonl copied to benchmarks/results/async_steps-*.metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MODEL = "smollm2-135m-instruct"
PHASES = ("time/generate", "time/logprobs", "time/update", "time/optimizer", "step_time")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(core: int | None, command: list[str]) -> list[str]:
    return command if core is None else ["taskset", "-c", str(core), *command]


def start_server(core: int | None, log: Path, model: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`grpokit serve --model model` (on CPU core `core` if given), its output in `log`, once it
    answers /health; env: its environment (default: this one's, one thread)."""
    port = free_port()
    process = subprocess.Popen(pinned(core, [sys.executable, "-m", "grpokit", "serve", "--model", model, "--port", str(port)]),
                               stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env=env or {**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return process, url
        except OSError:
            if process.poll() is not None:
                raise SystemExit(f"the server stopped: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    raise SystemExit("the server did not start in 300 s")


def train(out: Path, core: int | None, urls: list[str], staleness: int, steps: int, model: str,
          overrides: list[str], in_flight: bool = False, partial: bool = False) -> list[dict]:
    command = [sys.executable, "-m", "grpokit", "train", "--no-progress", f"model.name={model}", f"train.max_steps={steps}",
               "train.eval_every=0", "rollout.engine=server", f"rollout.server_url=[{','.join(urls)}]",
               f"rollout.max_staleness={staleness}", f"train.output_dir={out}", *overrides,
               *(["rollout.in_flight_updates=true"] if in_flight else []), *(["rollout.partial=true"] if partial else [])]
    started = time.monotonic()
    result = subprocess.run(pinned(core, command), capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    print(f"  {out.name}: {time.monotonic() - started:.0f} s in all", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(name: str, rows: list[dict]) -> dict:
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    out = {"run": name, **{k: statistics.median(r[k] for r in steps) for k in PHASES},
           "eval_start": evals[0]["eval/reward"], "eval_end": evals[-1]["eval/reward"],
           # the trained tokens' staleness, mean over the steps after the first (in flight: each token's)
           "token_staleness": statistics.mean(r.get("staleness/token_mean", r.get("partial/lag_mean", r.get("staleness", 0)))
                                              for r in steps[1:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/async_steps"), help="the runs' folder")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="where the metrics are copied")
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--skip-two-servers", action="store_true")
    parser.add_argument("--in-flight", action="store_true", help="another run: max_staleness 1, in-flight updates")
    parser.add_argument("--partial", action="store_true", help="another run: max_staleness 1, partial rollouts")
    parser.add_argument("--model", default=MODEL, help="model.name of every run and server")
    parser.add_argument("--no-pin", action="store_true", help="no taskset: trainer and servers share the machine")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="config settings of every run")
    args = parser.parse_args()
    if args.no_pin:
        args.trainer_core = args.server_core = None
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*/"):
        subprocess.run(["rm", "-rf", str(old)], check=True)
    servers = []
    try:
        server, url = start_server(args.server_core, args.out / "server.log", args.model)
        servers.append(server)
        runs = {k: train(args.out / f"staleness-{k}", args.trainer_core, [url], k, args.steps, args.model, args.overrides)
                for k in (0, 1)}
        names = {0: "max_staleness=0", 1: "max_staleness=1"}
        if args.in_flight:
            runs["in-flight"] = train(args.out / "staleness-in-flight", args.trainer_core, [url], 1, args.steps,
                                      args.model, args.overrides, in_flight=True)
            names["in-flight"] = "max_staleness=1, in_flight_updates"
        if args.partial:
            runs["partial"] = train(args.out / "staleness-partial", args.trainer_core, [url], 1, args.steps,
                                    args.model, args.overrides, partial=True)
            names["partial"] = "max_staleness=1, partial"
        table = [summary(names[k], rows) for k, rows in runs.items()]
        where = ("unpinned" if args.no_pin else
                 f"trainer on core {args.trainer_core}, server on core {args.server_core}, 1 thread each")
        print(f"\n{args.steps} steps of {args.model} {' '.join(args.overrides)} ({where}; medians over steps, seconds):\n")
        print("| run | time/generate | time/logprobs | time/update | time/optimizer | step_time | token staleness | "
              "eval/reward start -> end |")
        print("|---|---|---|---|---|---|---|---|")
        for r in table:
            print(f"| {r['run']} | " + " | ".join(f"{r[k]:.2f}" for k in PHASES)
                  + f" | {r['token_staleness']:.2f} | {r['eval_start']:.2f} -> {r['eval_end']:.2f} |")
        for r in table[1:]:
            print(f"\n{r['run']} / max_staleness=0, median step time: {r['step_time'] / table[0]['step_time']:.2f}")
        for k, rows in runs.items():
            (args.results / f"async_steps-staleness-{k}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if args.skip_two_servers:
            return
        second, url2 = start_server(args.server_core, args.out / "server-2.log", args.model)
        servers.append(second)
        two = train(args.out / "two-servers", args.trainer_core, [url, url2], 0, args.steps, args.model, args.overrides)
        (args.results / "async_steps-two-servers.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in two))

        def plain(rows):  # times aside; the engine's entropy is measured on other batch shapes (float rounding)
            return [{k: v for k, v in r.items() if k not in PHASES and k != "entropy"} for r in rows]

        differ = sorted({k for a, b in zip(plain(runs[0]), plain(two)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
        entropy = max((abs(a["entropy"] - b["entropy"]) / abs(a["entropy"]) for a, b in zip(runs[0], two) if "entropy" in a),
                      default=0.0)
        from safetensors.torch import load_file

        weights = [load_file(args.out / name / "final" / "model.safetensors") for name in ("staleness-0", "two-servers")]
        same = weights[0].keys() == weights[1].keys() and all((weights[0][k] == weights[1][k]).all() for k in weights[0])
        print(f"\ntwo servers{'' if args.no_pin else f' (both on core {args.server_core})'} against one, synchronous: "
              + ("every metric equal (entropy aside: largest relative difference "
                 f"{entropy:.1e})" if not differ and len(two) == len(runs[0]) else f"DIFFERENT: {differ}")
              + f"; final weights {'equal, bit for bit' if same else 'DIFFERENT'}")
    finally:
        for s in servers:
            s.kill()


if __name__ == "__main__":
    main()
