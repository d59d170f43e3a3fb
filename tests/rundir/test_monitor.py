"""Weights & Biases: online only when the server answers and this machine is logged in, else offline;
a real run's offline W&B file holds the same numbers as metrics.jsonl."""

import json
import socket
import struct
import time

import pytest

from grpokit.cli import main
from grpokit.rundir.monitor import wandb_mode


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No W&B settings from the machine running the tests; `server(listening)` points W&B at a local port."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    sockets = []

    def server(listening: bool) -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        if listening:
            s.listen()
        sockets.append(s)  # an unbound-but-not-listening port refuses connections
        port = s.getsockname()[1]
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
        return port

    yield server
    for s in sockets:
        s.close()


def test_wandb_mode_is_online_only_when_reachable_and_logged_in(wandb_env, tmp_path, monkeypatch):
    wandb_env(listening=False)
    assert wandb_mode() == ("offline", "127.0.0.1 cannot be reached")
    wandb_env(listening=True)
    mode, why = wandb_mode()
    assert mode == "offline" and "not logged in" in why
    (tmp_path / "netrc").write_text("machine 127.0.0.1\n  login user\n  password abc\n")
    assert wandb_mode() == ("online", "logged in to 127.0.0.1")
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode()[0] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's own choice wins
    assert wandb_mode() == ("disabled", "WANDB_MODE is set")


def _history(path) -> list[dict]:
    """The logged rows of a .wandb file: LevelDB-log framed records (a 7-byte file header, 32 KiB
    blocks, each chunk: crc32 4, length 2, type 1) holding wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunk, rows = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _written_history(path, rows: int, wait_s: float = 60) -> list[dict]:
    """_history(path) once it holds `rows` rows, or what it holds after wait_s seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            logged = _history(path)
        except Exception:  # noqa: BLE001 - a record still being written
            logged = []
        if len(logged) >= rows or time.monotonic() > deadline:
            return logged
        time.sleep(0.5)


def test_a_run_without_network_logs_to_wandb_offline(wandb_env, tmp_path, capsys):
    pytest.importorskip("wandb", reason="wandb is in the test extra: pip install -e '.[test]'")
    wandb_env(listening=False)
    out = tmp_path / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "train.prompts_per_step=2",
                 "rollout.num_generations=3", "data.eval_size=2", "train.max_steps=3", "monitor.wandb=true",
                 f"train.output_dir={out}"]) == 0
    printed = capsys.readouterr()
    assert "W&B: offline (127.0.0.1 cannot be reached)" in printed.out + printed.err
    (offline,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process may still be writing the file after finish() returned (seen on a busy
    # machine: the history there a moment later).
    logged = _written_history(offline, rows=4)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in metrics if "loss" in r}
    evals = {r["step"]: r for r in metrics if "eval/reward" in r}
    assert sorted({r["_step"] for r in logged}) == [0, 1, 2, 3]
    for row in logged:
        source = {**train.get(row["_step"], {}), **evals.get(row["_step"], {})}
        for key in ("reward", "grad_norm", "entropy", "eval/reward"):
            if key in row:
                assert row[key] == pytest.approx(source[key], rel=1e-6), key
    assert {"reward", "grad_norm", "eval/reward"} <= {k for r in logged for k in r}


def test_wandb_missing_is_a_clear_startup_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb raises ImportError
    assert main(["train", "--no-progress", "model.name=tiny-random", "train.max_steps=1", "monitor.wandb=true",
                 f"train.output_dir={tmp_path / 'run'}"]) == 2
    assert "monitor.wandb=true needs the wandb package: pip install wandb" in capsys.readouterr().err


@pytest.mark.process
def test_trackio_logs_every_metric_locally(tmp_path):
    """monitor.trackio=true: Trackio's local database holds what metrics.jsonl holds."""
    pytest.importorskip("trackio", reason="trackio is in the test extra: pip install -e '.[test]'")
    import subprocess
    import sys

    from support.processes import run_grpokit, same_threads_env

    # Read when trackio is imported: in the trainer's own process (forked before any import of it).
    env = {**same_threads_env(), "TRACKIO_DIR": str(tmp_path / "trackio")}
    out = tmp_path / "run"
    result = run_grpokit("train", "--no-progress", "model.name=tiny-random", "train.prompts_per_step=2",
                         "rollout.num_generations=3", "data.eval_size=2", "train.max_steps=3", "monitor.trackio=true",
                         "monitor.trackio_project=tests", f"train.output_dir={out}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    read = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('tests', sys.argv[1])))")
    logged = json.loads(subprocess.run([sys.executable, "-c", read, "run"], env=env, check=True,
                                       capture_output=True, text=True).stdout)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {}
    for row in metrics:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                expected[(row["step"], key)] = value
    got = {(row["step"], key): value for row in logged for key, value in row.items()
           if key not in ("step", "timestamp") and isinstance(value, (int, float))}
    assert got == pytest.approx(expected)
    assert {step for step, _ in got} == {0, 1, 2, 3} and any(key == "eval/reward" for _, key in got)


def test_a_tracker_switched_on_or_off_on_resume_is_the_same_run(tmp_path):
    import yaml

    from grpokit.config.loading import load_config
    from grpokit.rundir.folder import check_resumable
    from grpokit.runtime.errors import ConfigError

    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(load_config(values={"train.output_dir": str(tmp_path)}).to_dict()))
    for tracker in ("trackio", "wandb", "tensorboard"):
        check_resumable(saved, load_config(values={"train.output_dir": str(tmp_path), f"monitor.{tracker}": True}))
    check_resumable(saved, load_config(values={"train.output_dir": str(tmp_path), "monitor.trackio_project": "p"}))
    with pytest.raises(ConfigError, match="algorithm.beta: 0.0 in the run, 0.1 now"):
        check_resumable(saved, load_config(values={"train.output_dir": str(tmp_path), "algorithm.beta": 0.1}))
