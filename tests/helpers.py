"""What several test modules use: reading a run's metrics, comparing two runs, a rollout server in
its own process, free ports, shared reward functions, the loss on a random batch, synthetic runs.
Test modules import from here (and from conftest.py's fixtures), never from one another.

conftest.py imports it, so grpokit's modules are imported inside the functions that use them (a
grpokit module that fails to import fails the tests that use it, not the collection of every one).
`grpokit train` processes load it by its path for its reward ("<tests>/helpers.py:shortness")."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

TESTS = Path(__file__).parent


# ---------------------------------------------------------------- rewards


def shortness(completions, **columns):
    """A reward with variance on a random model: shorter completions score higher."""
    return [-float(len(c[0]["content"])) for c in completions]


# ---------------------------------------------------------------- a run's metrics


def metric_rows(run: Path) -> list[dict]:
    """Every row of `run`/metrics.jsonl, as JSON reads it ("nan" stays a string)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def untimed_metrics(run: Path) -> list[dict]:
    """metric_rows without any key that holds "time" (step_time, time/generate, ...): what two runs of
    the same computation log alike, bit for bit."""
    return [{k: v for k, v in r.items() if "time" not in k} for r in metric_rows(run)]


def training_rows(run: Path) -> list[dict]:
    """The rows of `run`/metrics.jsonl that mention a loss: the training steps' (evaluations log none)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def completions_log(run: Path) -> list[dict]:
    """Every row of `run`/completions.jsonl (monitor.log_completions)."""
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- comparing two runs


def assert_same_final_weights(a: Path, b: Path) -> None:
    """Runs `a` and `b` ended with the same weights, bit for bit."""
    wa, wb = (load_file(run / "final" / "model.safetensors") for run in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def assert_same_run(a: Path, b: Path, steps: int | None = None) -> None:
    """Runs `a` and `b` are the same run, bit for bit: the same metrics (timings aside,
    untimed_metrics) and the same final weights; with `steps`, their training steps are 1..steps."""
    rows = untimed_metrics(a), untimed_metrics(b)
    assert rows[0] == rows[1]
    if steps is not None:
        assert [r["step"] for r in rows[0] if "loss" in r] == list(range(1, steps + 1))
    assert_same_final_weights(a, b)


def assert_close_metrics(reference: list[dict], rows: list[dict]) -> None:
    """The same metric rows, with the same keys, to float64 rounding (rel 1e-9, abs 1e-12) on every
    value but timings: two ways of computing the same float64 run (process counts, micro-batches)."""
    assert len(reference) == len(rows)
    for a, b in zip(reference, rows):
        assert a.keys() == b.keys()
        for key in a:
            if "time" not in key:
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key


def assert_same_run_to_rounding(run: Path, reference: Path, weights_tol: float = 2e-5, evals: bool = True) -> None:
    """The same metrics (to float32 reduction order) and final weights; the same optimizer state.
    evals=False: the training rows only (a run stopped at max_steps also evaluated there).
    weights_tol is 2% of one update (learning rate 1e-3): a sharded run's log-prob pass splits the
    sequence elsewhere (logprobs.py), FSDP2 steps torch's per-weight AdamW where one process steps
    the fused one, and chunked log-probs sum in another order; all float32 rounding, which AdamW's
    division by tiny second moments amplifies. A wrong update is off by a whole update."""
    mine, theirs = untimed_metrics(run), untimed_metrics(reference)
    if not evals:
        mine, theirs = ([r for r in rows if "loss" in r] for rows in (mine, theirs))
    assert [r["step"] for r in mine] == [r["step"] for r in theirs]
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    w, v = load_file(run / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert w.keys() == v.keys()
    assert max((w[k] - v[k]).abs().max().item() for k in w) < weights_tol
    step = max(r["step"] for r in theirs)
    o, p = (torch.load(r / "checkpoints" / f"step-{step}" / "optimizer.pt", weights_only=True)["optimizer"]
            for r in (run, reference))
    assert o["state"].keys() == p["state"].keys() and len(o["state"]) > 0
    for name in o["state"]:
        assert o["state"][name]["step"] == p["state"][name]["step"]
        for moment in ("exp_avg", "exp_avg_sq"):
            mine, theirs = o["state"][name][moment], p["state"][name][moment]
            assert (mine - theirs).norm() <= 1e-3 * theirs.norm(), (name, moment)


# ---------------------------------------------------------------- processes and servers


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_threads_env() -> dict:
    """This process's environment, OMP_NUM_THREADS set to its torch thread count: a server or
    trainer process started with it computes as this one does, so its runs equal in-process ones
    bit for bit."""
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


# The tiny run of the rollout server tests (test_server.py, test_pipeline.py).
SERVER_RUN = ["--no-progress", "model.name=tiny-random", "reward.functions=[length]", "train.prompts_per_step=2",
              "rollout.num_generations=4", "data.eval_size=4", "train.eval_every=2"]


def get_health(url: str) -> dict:
    """A rollout server's /health answer."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


class Server:
    """`grpokit serve` in its own process: `kill()` kills it (SIGKILL), `start()` starts it again on
    the same port. Tests take one from the `server` fixture (conftest.py), which stops it afterwards."""

    def __init__(self, *args: str):
        self.args, self.port = args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "grpokit", "serve", "--model", "tiny-random", "--port", str(self.port), *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=same_threads_env())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                return get_health(self.url)
            except (urllib.error.URLError, ConnectionError):
                assert self.process.poll() is None, self.process.stdout.read()
                time.sleep(0.2)
        raise AssertionError("the server did not start in 120 s")

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self):
        if self.process.poll() is None:
            self.kill()


# An agent (rollout/agents.py) of two requests, the second continuing the first: a reward with
# variance on a random model. Python source, for the agent files tests write.
FOLLOW_UP_AGENT = '''
async def follow_up(client, model, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Shorter?"}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    return -len(second.choices[0].message.content or "") / 10
'''


def kill_once_saved(command: list[str], run: Path, step: int, timeout: float = 120) -> None:
    """Start `command` (a `grpokit train` writing to `run`, in same_threads_env) and SIGKILL it once
    its checkpoint of step `step` is in place (written whole, then renamed into place), the trainer
    still running, at most `timeout` seconds after the start."""
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=same_threads_env())
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / f"step-{step}").is_dir():
        assert time.monotonic() < deadline and trainer.poll() is None, trainer.communicate()
        time.sleep(0.01)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=30)


def train_in_background(*args: str) -> subprocess.Popen:
    """`grpokit train *args` in its own process (same_threads_env), its stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "grpokit", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=same_threads_env())


def wait_for_rows(trainer: subprocess.Popen, run: Path, rows: int) -> None:
    """Until the run's metrics.jsonl holds `rows` rows (at most 120 s; the trainer still running)."""
    log, deadline = run / "metrics.jsonl", time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= rows):
        assert time.monotonic() < deadline and trainer.poll() is None, trainer.communicate()
        time.sleep(0.01)


# ---------------------------------------------------------------- the loss on a random batch (test_loss, test_variants)


def loss_of(logps, old, ref, adv, mask, *, loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=None,
            kl_estimator="k3", max_completion_length=None, num_sequences=None, num_tokens=None,
            sampling_logps=None, is_cap=2.0, policy_mask=None, **settings):
    """The loss `loss_type` on one micro-batch, and its metrics as the trainer reports them for an
    update made of it: token sums over the update's token count (the importance weight's over the
    micro-batch's own tokens)."""
    from grpokit.loss import IS_MAX, IS_MEAN, IS_OUTSIDE, LossInputs, LossSettings, compute_loss

    out = compute_loss(loss_type, LossInputs(logps, mask, adv, old, ref, sampling_logps, num_sequences, num_tokens,
                                             max_completion_length, policy_mask),
                       LossSettings(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, kl_estimator=kl_estimator,
                                    is_cap=is_cap, **settings))
    denom = max(mask.sum().item() if num_tokens is None else num_tokens, 1.0)
    corrected = (IS_MEAN, *IS_OUTSIDE.values())
    metrics = {k: v / denom for k, v in out.token_sums.items() if k not in corrected}
    if IS_MEAN in out.token_sums:
        for k in corrected:
            if k in out.token_sums:
                metrics[k] = out.token_sums[k] / mask.sum()
        metrics[IS_MAX] = out.token_max[IS_MAX]
    return out.loss, metrics


def random_batch(B=6, T=7, seed=0):
    """Float64 log-probs (policy, old, reference), advantages and a ragged mask (row 0 whole)."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logps, old, ref, adv, mask


# ---------------------------------------------------------------- multi-turn rollouts


def tool_call(name, **arguments) -> str:
    """A tool call as the model writes it (scripted_engine.SCRIPT replies)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---------------------------------------------------------------- synthetic runs (test_diagnose, test_report)

SYNTHETIC_STEPS = 80


def healthy_row(step: int, rng: random.Random) -> dict:
    """A run that learns: reward rising, steady grad_norm, few zero-std groups, short completions."""
    return {
        "step": step,
        "loss": rng.gauss(0, 0.01),
        "reward": 0.1 + 0.8 * step / SYNTHETIC_STEPS + rng.gauss(0, 0.02),
        "reward_std": 0.4 + rng.gauss(0, 0.02),
        "frac_reward_zero_std": 0.2 + rng.gauss(0, 0.05),
        "grad_norm": 1.0 + rng.gauss(0, 0.1),
        "clip_ratio/region_mean": 0.01 + abs(rng.gauss(0, 0.005)),
        "completions/clipped_ratio": 0.1 + abs(rng.gauss(0, 0.03)),
        "kl": 0.01 + abs(rng.gauss(0, 0.002)),
    }


def with_failure(kind: str, step: int, row: dict, rng: random.Random) -> dict:
    """`row` of a healthy run, with the failure `kind` set in from halfway."""
    late = step > SYNTHETIC_STEPS // 2  # the failure sets in halfway
    if kind == "grad_norm" and late:
        row["grad_norm"] = 1.0 + 0.15 * (step - SYNTHETIC_STEPS // 2)  # climbing, while the reward still rises
    if kind == "clip_ratio" and late:
        row["clip_ratio/region_mean"] = 0.3 + rng.gauss(0, 0.02)
    if kind == "zero_std" and late:
        row["frac_reward_zero_std"] = 0.7 + rng.gauss(0, 0.05)
    if kind == "reward_flat" and late:
        row["reward"] = 0.5 + rng.gauss(0, 0.02)  # stalled after halfway
    if kind == "truncation" and late:
        row["completions/clipped_ratio"] = 0.8 + rng.gauss(0, 0.03)
    if kind == "kl" and late:
        row["kl"] = 0.02 * 1.1 ** (step - SYNTHETIC_STEPS // 2)
    return row


def write_synthetic_run(folder: Path, kind: str | None, beta: float = 0.0) -> list[dict]:
    """A run folder (config.yaml, metrics.jsonl) of SYNTHETIC_STEPS steps, healthy or with the
    failure `kind` from halfway, evaluated every 10 steps; its rows."""
    from grpokit.config import Config

    rng = random.Random(0)
    folder.mkdir()
    config = Config()
    config.algorithm.beta = beta
    config.train.max_steps = SYNTHETIC_STEPS
    (folder / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    rows = []
    for step in range(1, SYNTHETIC_STEPS + 1):
        row = healthy_row(step, rng)
        rows.append(with_failure(kind, step, row, rng) if kind else row)
        if step % 10 == 0:  # evaluations follow the reward's trend
            trend = 0.5 if kind == "reward_flat" and step > SYNTHETIC_STEPS // 2 else 0.1 + 0.8 * step / SYNTHETIC_STEPS
            rows.append({"step": step, "eval/reward": trend})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# ---------------------------------------------------------------- multi-process runs (update_worker.py)

TESTS = Path(__file__).parent


def launch(nproc: int, args: list[str], cwd: Path, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
               f"--main_process_port={free_port()}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def run_worker(tmp_path, mode, overrides):
    """update_worker.py on 1 and on 2 processes, at the same time (one thread each)."""
    with ThreadPoolExecutor(2) as pool:
        for nproc in (1, 2):
            (tmp_path / f"p{nproc}").mkdir()
        runs = [pool.submit(launch, nproc, [str(TESTS / "update_worker.py"), str(tmp_path / f"p{nproc}"), mode,
                                            json.dumps(overrides)], tmp_path) for nproc in (1, 2)]
        for run in runs:
            run.result()
    one = torch.load(tmp_path / "p1" / "rank0.pt")
    two = [torch.load(tmp_path / "p2" / f"rank{r}.pt") for r in (0, 1)]
    return one, two
