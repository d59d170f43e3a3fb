"""grpokit in processes of its own: `grpokit train` and `grpokit serve` as a user runs them, several
processes of one run as torchrun or accelerate launch starts them, and a run SIGKILLed once its
checkpoint is in place.

A fresh interpreter spends seconds importing torch, transformers and grpokit before it runs a
line of the command (about 12 of a tiny run's 15 s on this suite's 2-core machine). So these
processes are forked from a process that has imported them once (a multiprocessing forkserver,
per pytest worker, `support/preload.py`), and run grpokit's own CLI (`cli.main`) with the
command's arguments, environment, folder and thread count: what `python -m grpokit ...` runs
once its imports are done. Several processes of one run get the environment their launcher gives
its workers (torchrun's; accelerate's, computed by accelerate's own launch code) and join their
process group as a launched worker does. A fresh interpreter is still what `python_m` and `launched`
start, for the tests whose subject is the launch itself (the console a user sees, torchrun's and
accelerate's launchers, a sitecustomize hook).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

TESTS = Path(__file__).parents[1]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_threads_env() -> dict:
    """This process's environment, OMP_NUM_THREADS set to its torch thread count: a server or
    trainer process started with it computes as this one does, so its runs equal in-process ones
    bit for bit."""
    import torch

    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


# ---------------------------------------------------------------- forked grpokit processes

_context = None


def _forkserver():
    """This pytest worker's forkserver, started with the preload imported. The forkserver is a
    fresh interpreter that imports the preload by name, and Python 3.11's ignores this process's
    sys.path (where pytest put tests/) and passes over an ImportError in silence: so it starts
    with tests/ on PYTHONPATH, and `_run` refuses a process forked without the preload."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["support.preload"])
        path = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
        with mock.patch.dict(os.environ, PYTHONPATH=path):
            multiprocessing.forkserver.ensure_running()
        _context = context
    return _context


def _run(target, args: list[str], env: dict, cwd: str | None, out: str, err: str) -> None:
    """In the forked process: the command's environment, folder, output files (appended to) and
    thread count, then `target(args)` (grpokit's CLI, or a script) and its exit status."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(handle, fd)
        os.close(handle)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    if "support.preload" not in sys.modules:  # each process would spend seconds importing
        sys.stderr.write("support/processes.py: the forkserver did not import support.preload\n")
        sys.exit(3)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    code = target(args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _cli(args: list[str]) -> int:
    from grpokit.cli import main

    return main(args)


def _script(args: list[str]) -> int:
    import runpy

    sys.argv = list(args)
    runpy.run_path(args[0], run_name="__main__")
    return 0


class Process:
    """A forked process with subprocess.Popen's ways: pid, poll(), wait(), send_signal(), kill(),
    returncode, and its output as text (stdout and stderr, each in a file of its own, or both
    appended to `log`)."""

    def __init__(self, target, args: list[str], env: dict | None = None, cwd: str | Path | None = None,
                 log: Path | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix="grpokit-process-"))
        self.out, self.err = (log, log) if log is not None else (self.folder / "stdout", self.folder / "stderr")
        env = dict(same_threads_env() if env is None else env)
        self.process = _forkserver().Process(target=_run, args=(target, list(args), env, None if cwd is None else str(cwd),
                                                                 str(self.out), str(self.err)))
        self.process.start()
        self.pid = self.process.pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def stdout(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    @property
    def stderr(self) -> str:
        return "" if self.err == self.out else self.err.read_text() if self.err.exists() else ""

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout, self.stderr


def grpokit(*args: str, env: dict | None = None, cwd: str | Path | None = None, log: Path | None = None) -> Process:
    """`python -m grpokit *args` started (forked: module docstring), in `env` (default: this
    process's, with its thread count) and folder `cwd`; its output appended to `log` if given."""
    return Process(_cli, list(args), env, cwd, log)


def run_grpokit(*args: str, env: dict | None = None, cwd: str | Path | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m grpokit *args` run to its end: its exit status and output, as subprocess.run gives them."""
    process = grpokit(*args, env=env, cwd=cwd)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
        raise
    return subprocess.CompletedProcess(list(args), process.returncode, process.stdout, process.stderr)


def python_m(*args: str, env: dict | None = None, cwd: str | Path | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m *args` in a fresh interpreter (the launch itself under test)."""
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=same_threads_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- runs killed and waited for


def kill_once_saved(args: list[str], run: Path, step: int, timeout: float = 120) -> None:
    """Start `grpokit *args` (a `grpokit train` writing to `run`) and SIGKILL it once its
    checkpoint of step `step` is in place (written whole, then renamed into place), the trainer
    still running, at most `timeout` seconds after the start."""
    trainer = grpokit(*args)
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / f"step-{step}").is_dir():
        assert time.monotonic() < deadline and trainer.poll() is None, trainer.communicate()
        time.sleep(0.01)
    trainer.kill()
    trainer.wait(timeout=30)


def train_in_background(*args: str) -> Process:
    """`grpokit train *args` in its own process."""
    return grpokit("train", *args)


def wait_for_rows(trainer: Process, run: Path, rows: int) -> None:
    """Until the run's metrics.jsonl holds `rows` rows (at most 120 s; the trainer still running)."""
    log, deadline = run / "metrics.jsonl", time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= rows):
        assert time.monotonic() < deadline and trainer.poll() is None, trainer.communicate()
        time.sleep(0.01)


# ---------------------------------------------------------------- several processes of one run


def _worker_env(base: dict, nproc: int, rank: int, port: int) -> dict:
    """What torchrun gives worker `rank` of `nproc` on one machine."""
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none",
            "OMP_NUM_THREADS": "1"}


def processes_of_one_run(nproc: int, target, args: list[str], env: dict | None = None, cwd: str | Path | None = None,
                         timeout: float = 300, launched: bool = True) -> subprocess.CompletedProcess:
    """`nproc` processes of one run, each with its worker's environment (torchrun's; with
    `launched` False, the one process of a plain `python` run), running `target(args)`; the run's
    exit status (the first nonzero of its processes) and their output."""
    port, base = free_port(), dict(same_threads_env() if env is None else env)
    workers = [Process(target, args, _worker_env(base, nproc, rank, port) if launched else base, cwd)
               for rank in range(nproc)]
    deadline = time.monotonic() + timeout
    try:
        for w in workers:
            w.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for w in workers:
            w.kill()
    codes = [w.returncode for w in workers]
    return subprocess.CompletedProcess(args, next((c for c in codes if c), 0), "".join(w.stdout for w in workers),
                                       "".join(w.stderr for w in workers))


def torchrun(nproc: int, args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc args` (a script, or -m grpokit ...), its workers forked; an
    exit status of 0 asserted, with the output on failure."""
    if args[0] == "-m":
        assert args[1] == "grpokit", args
        result = processes_of_one_run(nproc, _cli, args[2:], env, cwd)
    else:
        result = processes_of_one_run(nproc, _script, args, {**same_threads_env(), "PYTHONPATH": str(TESTS),
                                                             **(env or {})}, cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def accelerate_env(config: Path, nproc: int | None = None, *flags: str) -> tuple[int, dict, bool]:
    """What `accelerate launch --config_file config [--num_processes nproc] *flags -m grpokit` starts: how
    many processes, the environment accelerate gives them (computed by accelerate's own launch code:
    its config file read, checked and turned into environment variables), and whether torchrun
    starts them (a distributed launch) rather than a plain `python` (one process)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    argv = ["--config_file", str(config), *([f"--num_processes={nproc}"] if nproc else []), *flags, "-m", "grpokit"]
    args, defaults, precision_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed and not args.cpu:  # as accelerate's launch_command chooses its launcher
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * precision_from_config)
        _, env = prepare_deepspeed_cmd_env(args)
        launched = True
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        env, launched = prepare_multi_gpu_env(args), True
    else:
        (_, env), launched = prepare_simple_launcher_cmd_env(args), False
    return args.num_processes, {k: str(v) for k, v in env.items()}, launched


def accelerated(config: Path, args: list[str], cwd: Path, nproc: int | None = None,
                timeout: float = 600, script: Path | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file config -m grpokit *args` (or `script *args`, a script that
    runs grpokit's CLI): its processes forked with the environment accelerate gives them
    (accelerate_env); their exit status and output."""
    n, env, launched = accelerate_env(config, nproc)
    target, args = (_cli, args) if script is None else (_script, [str(script), *args])
    return processes_of_one_run(n, target, args, {**same_threads_env(), **env}, cwd, timeout, launched)


def run_worker(tmp_path, mode, overrides):
    """update_worker.py on 1 and on 2 processes, at the same time (one thread each)."""
    with ThreadPoolExecutor(2) as pool:
        for nproc in (1, 2):
            (tmp_path / f"p{nproc}").mkdir()
        runs = [pool.submit(torchrun, nproc, [str(TESTS / "support" / "update_worker.py"), str(tmp_path / f"p{nproc}"),
                                              mode, json.dumps(overrides)], tmp_path) for nproc in (1, 2)]
        for run in runs:
            run.result()
    import torch

    one = torch.load(tmp_path / "p1" / "rank0.pt")
    two = [torch.load(tmp_path / "p2" / f"rank{r}.pt") for r in (0, 1)]
    return one, two
