"""The short runs a change that must not change behaviour is checked with, bit for bit.

    python tools/reference_runs.py --src /tmp/before/src --out /tmp/runs-before
    python tools/reference_runs.py --src src --out /tmp/runs-after
    python tools/reference_runs.py --compare /tmp/runs-before /tmp/runs-after

Each run is `grpokit train` (or `accelerate launch`, `torchrun`) with the code under --src first on
PYTHONPATH, one thread per process, so that two trees' runs compute alike; the rollout servers a
run needs are `grpokit serve` processes of the same tree on 127.0.0.1. --compare runs
tools/compare_runs.py on each pair (metrics, final weights, every checkpoint) and prints a line a
run. What each run reaches is in RUNS; `--only name,name` picks some.

`--resume-src OTHER` adds the run `agent-ahead-resumed`: the agent run generated ahead
(`agent-ahead`) started with the code under --src, SIGKILLed once its step-3 checkpoint is in
place, and resumed with the code under OTHER: compared with --src's uninterrupted `agent-ahead`,
it says whether a checkpoint of one tree (its pickled conversations and agents' outcomes
included) resumes on the other.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from async_steps import free_port, start_server  # noqa: E402 - benchmarks/ and tests/ are not packages
from support.conversations import FOLLOW_UP_AGENT  # noqa: E402

# A reward with variance on a random model (shorter completions score higher), written beside the
# runs: its file's name is in the metrics' keys (rewards/helpers.py:shortness/mean).
SHORTNESS = "reward.functions=[{out}/helpers.py:shortness]"
SHORTNESS_PY = '''
def shortness(completions, **columns):
    return [-float(len(c[0]["content"])) for c in completions]
'''
SMALL = ["train.prompts_per_step=4", "rollout.num_generations=4", "data.eval_size=8", "train.eval_every=2",
         "train.save_every=2", "train.keep_checkpoints=null"]
TINY = ["model.name=tiny-random", SHORTNESS, "train.learning_rate=1e-3", *SMALL]
FSDP2 = ROOT / "examples" / "accelerate" / "cpu-2-processes-fsdp2.yaml"
ZERO3 = ROOT / "examples" / "accelerate" / "cpu-2-processes-zero3.yaml"

# name -> (launcher, servers, arguments): launcher "python" (one process), "torchrun" (2 processes)
# or an accelerate config; servers: how many `grpokit serve` of tiny-random the run is given
# (rollout.server_url lists them, unless an argument names the first, {server0}: the judge's).
RUNS = {
    "default": ("python", 0, ["train.max_steps=8", "train.eval_every=4", "data.eval_size=20", "train.save_every=4"]),
    "dapo": ("python", 0, ["train.max_steps=3", *SMALL, "algorithm.loss_type=dapo", "algorithm.beta=0.01",
                           "algorithm.num_iterations=2", "train.updates_per_step=2", "train.micro_batch_size=3",
                           "train.learning_rate=1e-4"]),
    "two-processes": ("torchrun", 0, ["train.max_steps=3", *TINY, "algorithm.beta=0.04", "train.micro_batch_size=2"]),
    "dynamic-sampling": ("python", 0, ["train.max_steps=3", *SMALL, "rollout.dynamic_sampling=true",
                                       "train.learning_rate=1e-4"]),
    "tools": ("python", 0, ["--config", str(ROOT / "examples" / "calculator.yaml"), "train.max_steps=3",
                            "train.prompts_per_step=2", "data.eval_size=4", "train.eval_every=2", "train.save_every=2",
                            "train.keep_checkpoints=null", "rollout.max_completion_length=48"]),
    "agent": ("python", 0, ["train.max_steps=3", *TINY, "rollout.agent={out}/agent.py:follow_up",
                            "rollout.max_completion_length=24"]),
    "verifiers": ("python", 0, ["train.max_steps=3", *SMALL, "train.learning_rate=1e-4",
                                f"rollout.environment=verifiers:{ROOT / 'examples' / 'verifiers_arithmetic.py'}"
                                ":load_environment"]),
    "vision": ("python", 0, ["--config", str(ROOT / "examples" / "vision.yaml"), "model.name=tiny-random-vlm",
                             "train.max_steps=3", "train.prompts_per_step=2", "data.eval_size=4", "train.eval_every=2",
                             "train.save_every=2", "train.keep_checkpoints=null", "model.freeze_language_model=false",
                             "train.learning_rate=1e-3"]),
    "two-servers-ahead": ("python", 2, ["train.max_steps=4", *TINY, "rollout.engine=server",
                                        "rollout.max_staleness=1"]),
    "agent-ahead": ("python", 1, ["train.max_steps=6", *TINY, "train.save_every=3", "rollout.engine=server",
                                  "rollout.max_staleness=1", "rollout.agent={out}/agent.py:follow_up",
                                  "rollout.max_completion_length=24"]),
    # LoRA on every linear layer, with a KL term (the reference is the base without its adapters),
    # ragged completions of up to 24 tokens (so the step picks packed passes).
    "lora": ("python", 0, ["train.max_steps=3", *TINY, "model.lora_rank=8", "algorithm.beta=0.04",
                           "rollout.max_completion_length=24"]),
    # A teacher's per-token signal (distill.teacher), and the built-in judge reward asking a
    # `grpokit serve` of tiny-random (its replies rarely parse: judge/failed, None rewards).
    "teacher": ("python", 0, ["train.max_steps=3", *TINY, "distill.teacher=tiny-random"]),
    "judge": ("python", 1, ["train.max_steps=3", *TINY[:1], *TINY[2:],
                            "reward.functions=[judge,{out}/helpers.py:shortness]", "reward.judge_url={server0}/v1",
                            "reward.judge_retries=0", "reward.judge_timeout=30"]),
    "fsdp2": (str(FSDP2), 0, ["train.max_steps=3", *TINY, "algorithm.beta=0.04", "train.micro_batch_size=2"]),
    "zero3": (str(ZERO3), 0, ["train.max_steps=3", *TINY, "algorithm.beta=0.04", "train.micro_batch_size=2"]),
}


def environment(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}


def command(name: str, out: Path, urls: list[str]) -> list[str]:
    launcher, _, args = RUNS[name]
    named = any("{server0}" in a for a in args)
    args = [a.format(out=out, server0=urls[0] if urls else "") for a in args] + \
        ["--no-progress", f"train.output_dir={out / name}"]
    if urls and not named:
        args.append(f"rollout.server_url=[{','.join(urls)}]")
    if launcher == "python":
        return [sys.executable, "-m", "grpokit", "train", *args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "-m", "grpokit", "train", *args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launcher,
            f"--main_process_port={free_port()}", "-m", "grpokit", "train", *args]


def run(name: str, src: Path, out: Path, resume_src: Path | None = None) -> float:
    """Make run `name` under `out` with the code under `src`: its seconds."""
    servers = [start_server(None, out / f"{name}-server{i}.log", "tiny-random", environment(resume_src or src))
               for i in range(RUNS[name][1])]
    start = time.monotonic()
    try:
        cmd = command(name, out, [url for _, url in servers])
        with (out / f"{name}.log").open("w") as log:
            if resume_src is not None:  # killed once its step-3 checkpoint is in place, resumed by other code
                first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environment(src))
                while not (out / "agent-ahead" / "checkpoints" / "step-3").is_dir():
                    if first.poll() is not None:
                        raise SystemExit(f"{name}: the first part ended before its step-3 checkpoint")
                    time.sleep(0.01)
                first.send_signal(signal.SIGKILL)
                first.wait()
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=environment(resume_src or src))
        if done.returncode:
            raise SystemExit(f"{name} failed ({done.returncode}): {(out / f'{name}.log').read_text()[-3000:]}")
    finally:
        for server, _ in servers:
            server.kill()
            server.wait()
    return time.monotonic() - start


def compare(before: Path, after: Path, names: list[str]) -> int:
    failed = 0
    for name in names:
        a, b = before / name, after / name
        if name == "agent-ahead-resumed":
            a = before / "agent-ahead"
        if not (a.is_dir() and b.is_dir()):
            print(f"{name}: missing ({a if not a.is_dir() else b})")
            failed += 1
            continue
        result = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_runs.py"), str(a), str(b)],
                                capture_output=True, text=True)
        steps = sum("loss" in json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines())
        checkpoints = len(list((b / "checkpoints").glob("step-*")))
        verdict = "the same, bit for bit" if result.returncode == 0 else "DIFFERENT"
        print(f"{name}: {verdict} ({steps} steps, {checkpoints} checkpoints and final/ compared)")
        if result.returncode:
            print("   " + result.stdout.strip().replace("\n", "\n   ")[:3000])
            failed += 1
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, help="the src/ folder whose code runs")
    parser.add_argument("--out", type=Path, help="where the run folders go")
    parser.add_argument("--resume-src", type=Path, help="also agent-ahead-resumed: killed, then resumed by this code")
    parser.add_argument("--only", help="run names, separated by commas")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    if args.compare:
        return 1 if compare(*args.compare, names) else 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent.py").write_text(FOLLOW_UP_AGENT)
    (args.out / "helpers.py").write_text(SHORTNESS_PY)
    for name in names:
        if name != "agent-ahead-resumed":
            print(f"{name}: {run(name, args.src.resolve(), args.out):.0f} s", flush=True)
    if args.resume_src is not None:
        resumed = args.out / "resumed"
        resumed.mkdir(exist_ok=True)
        (resumed / "agent.py").write_text(FOLLOW_UP_AGENT)
        (resumed / "helpers.py").write_text(SHORTNESS_PY)
        seconds = run("agent-ahead", args.src.resolve(), resumed, args.resume_src.resolve())
        (args.out / "agent-ahead-resumed").unlink(missing_ok=True)
        (args.out / "agent-ahead-resumed").symlink_to(resumed / "agent-ahead")
        print(f"agent-ahead-resumed: {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
