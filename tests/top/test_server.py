"""rollout.engine=server against a real `grpokit serve` on 127.0.0.1: the run equals the in-process
engine's, bit for bit; every push is verified by checksum; a server killed and restarted mid-run is
survived; a wrong model, a server that is down or mute, and malformed requests give clear errors
within bounded time."""

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from support.processes import TESTS, free_port, run_grpokit, torchrun, train_in_background, wait_for_rows
from support.runs import (assert_close_metrics, assert_same_final_weights, assert_same_run, completions_log,
                          untimed_metrics)
from support.servers import SERVER_RUN, get_health
from support.trained_replies import tool_caller
from safetensors.torch import load_file

from grpokit.cli import main
from grpokit.engines.weights import checksum, named_weights

pytest.importorskip("fastapi", reason="the server needs: pip install 'grpokit[server]'")


def post(url: str, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.process
def test_a_server_run_equals_the_in_process_run(server, tmp_path):
    s = server()
    assert main(["train", *SERVER_RUN, "train.max_steps=3", f"train.output_dir={tmp_path / 'local'}"]) == 0
    assert main(["train", *SERVER_RUN, "train.max_steps=3", "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={tmp_path / 'served'}"]) == 0
    # Same seeds, same weights (each push verified), the same sampling code: the same run, bit for bit.
    assert_same_run(tmp_path / "served", tmp_path / "local")
    from grpokit.models.loading import load_model

    start = dict(named_weights(load_model("tiny-random")))
    served = load_file(tmp_path / "served" / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], v) for k, v in served.items() if k in start)  # training moved them
    health = get_health(s.url)
    # Pushes: before the step-0 evaluation, then after each of the 3 updates; the last one verified
    # against the trainer's final weights, here recomputed from the saved model.
    assert health["weights_version"] == 4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "served" / "final")
    assert health["checksum"] == checksum(named_weights(model))


def test_the_trainer_checks_every_push(tmp_path, monkeypatch, capsys):
    """A server that generates with other weights than those pushed is caught at the first push."""
    import uvicorn

    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.engines.weights import fingerprint
    from grpokit.models.loading import eos_token_ids, load_model, load_tokenizer
    from grpokit.server import RolloutService, make_app

    class Corrupting(TransformersEngine):
        def load_weights(self, pairs):
            def changed():
                for name, tensor in pairs:
                    yield name, tensor + (1e-3 if name.endswith("norm.weight") else 0)
            return super().load_weights(changed())

    model, tokenizer = load_model("tiny-random"), load_tokenizer("tiny-random")
    engine = Corrupting(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer))
    port = free_port()
    app = make_app(RolloutService(engine, "transformers", "tiny-random", fingerprint(model), 49152))
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        while not http.started:
            time.sleep(0.05)
        code = main(["train", *SERVER_RUN, "train.max_steps=1", "rollout.engine=server",
                     f"rollout.server_url=http://127.0.0.1:{port}", f"train.output_dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err
        assert re.search(r"grpokit: the run stopped: after weight push 1 the rollout server at \S+ reports checksum "
                         r".* the trainer's weights have", err), err
    finally:
        http.should_exit = True
        thread.join(timeout=10)


@pytest.mark.process
def test_a_server_killed_and_restarted_mid_run_is_survived(server, tmp_path):
    s = server()
    steps = ["train.max_steps=12", "data.eval_size=0"]
    trainer = train_in_background(*SERVER_RUN, *steps, "rollout.engine=server", f"rollout.server_url={s.url}",
                                  "rollout.server_timeout=20", f"train.output_dir={tmp_path / 'served'}")
    wait_for_rows(trainer, tmp_path / "served", 3)
    s.kill()
    time.sleep(1.0)  # the trainer meets a dead server and retries
    s.start()
    out, err = trainer.communicate(timeout=180)
    assert trainer.returncode == 0, err[-3000:]
    assert "restarted" in err and "pushing the weights again" in err
    assert len(untimed_metrics(tmp_path / "served")) == 12
    # The new server got the same weights, so the run is the uninterrupted one.
    assert main(["train", *SERVER_RUN, *steps, f"train.output_dir={tmp_path / 'local'}"]) == 0
    assert_same_run(tmp_path / "served", tmp_path / "local")


@pytest.mark.process
def test_a_mismatched_model_is_refused(server, tmp_path, capsys):
    s = server("--dtype", "float64")
    code = main(["train", *SERVER_RUN, "train.max_steps=1", "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "does not match model.name" in err and "dtype: 'float32' in the trainer, 'float64' here" in err
    # The server refuses such a request by itself, too.
    fp = {**get_health(s.url)["fingerprint"], "vocab_size": 32000}
    status, body = post(s.url, "/generate", {"fingerprint": fp, "session": None, "weights_version": 0,
                                             "prompts": [[1, 2]], "n": [1], "seeds": [0],
                                             "sampling": {"max_tokens": 2, "temperature": 1, "top_p": 1, "top_k": 0}})
    assert status == 409 and "vocab_size: 32000 in the request, 49152 here" in body["detail"]


@pytest.mark.process
def test_malformed_requests_get_422_with_the_reason(server, tiny):
    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.client import RolloutServerError, ServerEngine

    s = server()
    model, tokenizer = tiny
    trainer = ServerEngine(s.url, model, tokenizer.pad_token_id, timeout_s=30)
    trainer.generate([[1, 2]], 1, SamplingParams(2), [0])  # joins a weight group and pushes
    pushed = trainer.servers[0]  # its one server's connection
    good = {"fingerprint": get_health(s.url)["fingerprint"], "session": pushed.session,
            "weights_version": pushed.version, "prompts": [[1, 2, 3]], "n": [2], "seeds": [5, 6],
            "sampling": {"max_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    status, body = post(s.url, "/generate", good)  # `good` has no min_p, as trainers from before it send
    assert status == 200 and len(body["completions"]) == 2
    assert all(len(c["token_ids"]) == len(c["logprobs"]) <= 3 for c in body["completions"])
    # min_p reaches the server's sampler: the in-process engine's completions and log-probs.
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.models.loading import eos_token_ids

    # So do the alternatives an agent's request asks for (top_logprobs), minus those min-p dropped.
    params = SamplingParams(4, temperature=0.7, min_p=0.5, top_logprobs=3)
    served = trainer.generate([[1, 2, 3]], 3, params, [5, 6, 7])
    local = TransformersEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer)).generate(
        [[1, 2, 3]], 3, params, [5, 6, 7])
    assert torch.equal(served.completion_ids, local.completion_ids)
    torch.testing.assert_close(served.sampling_logps, local.sampling_logps)
    kept = local.top_logps > float("-inf")  # (N, T, 3)
    assert kept[..., 0].all() and not kept.all()
    torch.testing.assert_close(served.top_logps[kept], local.top_logps[kept])
    assert torch.equal(served.top_ids[kept], local.top_ids[kept]) and (served.top_logps[~kept] == float("-inf")).all()
    for bad, reason in [
        (b"{not json", "JSON decode error"),
        ({**good, "prompts": "hello"}, "prompts"),
        ({**good, "prompts": [[1, 99999999]]}, "prompt token ids must be"),
        ({**good, "n": [2, 2]}, "n must hold one count"),
        ({**good, "seeds": [1]}, "one seed per completion"),
        ({**good, "sampling": {**good["sampling"], "top_p": 0}}, "top_p"),
        ({**good, "sampling": {**good["sampling"], "min_p": 1}}, "min_p"),
        ({**good, "sampling": {**good["sampling"], "min_q": 0.1}}, "min_q"),  # unknown: refused, not ignored
        ({**good, "sampling": {**good["sampling"], "top_logprobs": 21}}, "top_logprobs"),
    ]:
        status, body = post(s.url, "/generate", bad)
        assert status == 422 and reason in json.dumps(body), (reason, body)
    status, body = post(s.url, "/generate", {**good, "weights_version": 3})
    assert status == 409 and body["detail"] == "stale weights"

    # One server, one trainer: a second one takes it over, and the first is told so (no retry loop).
    second = ServerEngine(s.url, model, tokenizer.pad_token_id, timeout_s=30)
    second.generate([[1, 2]], 1, SamplingParams(2), [0])
    trainer.weights_updated()
    with pytest.raises(RolloutServerError, match="another trainer joined"):
        trainer.generate([[1, 2]], 1, SamplingParams(2), [0])
    status, body = post(s.url, "/generate", good)
    assert status == 409 and "another trainer joined" in body["detail"]
    second.close()


def test_a_server_that_is_down_or_mute_is_a_clear_error_in_bounded_time(tmp_path, capsys):
    port = free_port()  # nothing listens there
    start = time.monotonic()
    code = main(["train", *SERVER_RUN, "train.max_steps=1", "rollout.engine=server",
                 f"rollout.server_url=http://127.0.0.1:{port}", "rollout.server_timeout=2",
                 f"train.output_dir={tmp_path / 'down'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"the rollout server at http://127.0.0.1:{port} cannot be reached" in err
    assert f"grpokit serve --model <model.name> --port {port}" in err
    assert time.monotonic() - start < 30
    with socket.socket() as mute:  # accepts connections, never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        start = time.monotonic()
        code = main(["train", *SERVER_RUN, "train.max_steps=1", "rollout.engine=server",
                     f"rollout.server_url=http://127.0.0.1:{mute.getsockname()[1]}", "rollout.server_timeout=2",
                     f"train.output_dir={tmp_path / 'mute'}"])
    assert code == 2 and "did not answer /health within rollout.server_timeout=2 s" in capsys.readouterr().err
    assert time.monotonic() - start < 30


PARTIAL = ["rollout.partial=true", "rollout.partial_tokens=3", "rollout.max_completion_length=12"]


@pytest.mark.process
@pytest.mark.parametrize("sampling", [["rollout.max_staleness=0"], ["rollout.max_staleness=1"], PARTIAL,
                                      [*PARTIAL, "rollout.max_staleness=1"]],
                         ids=["in-turn", "generated-ahead", "partial", "partial-generated-ahead"])
def test_two_trainer_processes_share_one_server(server, tmp_path, sampling):
    """Process 0 alone talks to the server; process 1 gets its rows. The 2-process run equals the
    1-process run (float64: the sums over processes agree to rounding), generated ahead or not, or
    with partial rollouts (process 0's rounds handed to both, which carry the same groups)."""
    s = server("--dtype", "float64")
    args = [*SERVER_RUN, "model.dtype=float64", "train.max_steps=2", "rollout.engine=server",
            f"rollout.server_url={s.url}", *sampling]
    for nproc in (1, 2):
        torchrun(nproc, ["-m", "grpokit", "train", *args, f"train.output_dir={tmp_path / f'p{nproc}'}"], tmp_path)
    one, two = untimed_metrics(tmp_path / "p1"), untimed_metrics(tmp_path / "p2")
    assert len(one) == len(two) == 4  # evaluations at steps 0 and 2, steps 1 and 2
    if "rollout.partial=true" in sampling:
        assert max(r.get("partial/lag_max", 0) for r in one) >= 1  # a completion went on under new weights
    assert_close_metrics(one, two)


@pytest.mark.process
def test_a_server_that_dies_for_good_stops_the_run_with_the_command_that_resumes(server, tmp_path):
    """Killed and not restarted: one `grpokit:` line naming the server, and the command that resumes;
    resumed with a new server, the run is the uninterrupted one."""
    s = server()
    steps = ["train.max_steps=4", "data.eval_size=0", "train.save_every=2"]
    served = tmp_path / "served"
    trainer = train_in_background(*SERVER_RUN, *steps, "rollout.engine=server", f"rollout.server_url={s.url}",
                                  "rollout.server_timeout=1", f"train.output_dir={served}")
    wait_for_rows(trainer, served, 2)
    s.kill()
    _, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert f"grpokit: the run stopped: the rollout server at {s.url} cannot be reached" in err
    assert f"with: grpokit train --config {served / 'config.yaml'}" in err
    s.start()
    assert main(["train", *SERVER_RUN, *steps, "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={served}"]) == 0
    assert main(["train", *SERVER_RUN, *steps, f"train.output_dir={tmp_path / 'local'}"]) == 0
    assert_same_run(served, tmp_path / "local")


@pytest.mark.process
def test_serve_on_a_busy_port_says_so_before_loading_the_model(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_grpokit("serve", "--model", "tiny-random", "--port", str(port), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"grpokit: grpokit serve cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "on http://" not in result.stdout  # it never claimed to serve


def test_decode_slots_reach_the_served_engine_or_are_refused(capsys):
    from grpokit.settings.schema import Config, ModelConfig, RolloutConfig
    from grpokit.training import setup

    served = Config(model=ModelConfig(name="tiny-random", dtype="float32"), rollout=RolloutConfig(decode_slots=3))
    assert setup.build(served, "serve").engine.slots == 3
    for args in (["--decode-slots", "0"], ["--decode-slots", "4", "--engine", "vllm"]):
        assert main(["serve", "--model", "tiny-random", *args]) == 2
        assert f"--decode-slots {args[1]}: must be >= 1, with --engine transformers" in capsys.readouterr().err
    for args in (["--quantization", "nf3"], ["--quantization", "nf4", "--engine", "vllm"]):
        assert main(["serve", "--model", "tiny-random", *args]) == 2
        assert f"--quantization {args[1]}: must be one of none, nf4, fp4, int8, and other than none with --engine " \
               "transformers alone" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-random", "--quantization", "nf4", "--dtype", "float64"]) == 2
    assert "--quantization nf4 with --dtype float64: bitsandbytes computes in" in capsys.readouterr().err


@pytest.mark.process
def test_a_multi_turn_server_run_equals_the_in_process_run(server, tmp_path):
    """Conversations with a tool, each turn generated by the server from the whole context as token
    ids: the same run as in process, bit for bit. A random model never calls a tool: this one is
    trained to (support/trained_replies.py)."""
    from grpokit.tasks.calculator import question

    questions = ((347, 58), (512, 33))
    model = tool_caller(tmp_path / "model", questions)
    s = server("--model", str(model))
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": question(a, b)}], "answer": a * b}) + "\n"
        for a, b in questions))
    run = ["--no-progress", f"model.name={model}", f"data.path={tmp_path / 'data.jsonl'}", "data.eval_size=0",
           "rollout.tools=[grpokit.tasks.calculator:calculator]", f"reward.functions=[{TESTS / 'support' / 'rewards.py'}:brevity]",
           "train.prompts_per_step=1", "rollout.num_generations=2", "rollout.max_completion_length=72",
           "train.max_steps=1", "train.learning_rate=1e-4"]
    assert main(["train", *run, f"train.output_dir={tmp_path / 'local'}"]) == 0
    assert main(["train", *run, "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={tmp_path / 'served'}"]) == 0
    local = untimed_metrics(tmp_path / "local")
    assert local[0]["tools/calls_per_rollout"] > 0 and local[0]["turns/mean"] > 1  # conversations did happen
    assert local[0]["reward_std"] > 0  # and the update moved the weights
    assert_same_run(tmp_path / "served", tmp_path / "local")


def assert_same_but_entropy(a: list[dict], b: list[dict]) -> None:
    """Equal rows, bit for bit, but for `entropy`: the engine measures it from its own logits, whose
    last bits depend on how many completions share a batch (the CPU's matrix kernels), so a step
    split over two servers measures it to float rounding only."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k != "entropy"} == {k: v for k, v in y.items() if k != "entropy"}
        assert ("entropy" in x) == ("entropy" in y) and x.get("entropy", 0) == pytest.approx(y.get("entropy", 0), rel=1e-6)


@pytest.mark.process
def test_two_servers_give_the_run_of_one(server, tmp_path):
    """Each step's prompt groups split over two servers, the weights pushed to both: every completion
    samples from its own seed, so the run is the one-server run: the same completions, the same
    weights bit for bit. The second server decodes at most 2 completions at once (--decode-slots):
    the others wait for the places of those that end, and sample what they sample all at once."""
    first, second = server(), server("--decode-slots", "2")
    run = [*SERVER_RUN, "train.prompts_per_step=3", "train.max_steps=3", "rollout.engine=server",
           "monitor.log_completions=1"]
    assert main(["train", *run, f"rollout.server_url={first.url}", f"train.output_dir={tmp_path / 'one'}"]) == 0
    assert main(["train", *run, f"rollout.server_url=[{first.url},{second.url}]", f"train.output_dir={tmp_path / 'two'}"]) == 0
    assert completions_log(tmp_path / "two") == completions_log(tmp_path / "one")
    assert_same_but_entropy(untimed_metrics(tmp_path / "two"), untimed_metrics(tmp_path / "one"))
    assert_same_final_weights(tmp_path / "one", tmp_path / "two")
    # Both generated, each with every push verified: before the step-0 evaluation, then after each update.
    assert get_health(first.url)["weights_version"] == get_health(second.url)["weights_version"] == 4


@pytest.mark.process
def test_a_server_killed_mid_run_leaves_its_share_to_the_other(server, tmp_path):
    first, second = server(), server()
    run = [*SERVER_RUN, "train.prompts_per_step=3", "train.max_steps=6", "data.eval_size=0", "rollout.engine=server",
           "monitor.log_completions=1"]
    out = tmp_path / "two"
    trainer = train_in_background(*run, f"rollout.server_url=[{first.url},{second.url}]", "rollout.server_timeout=3",
                                  f"train.output_dir={out}")
    wait_for_rows(trainer, out, 2)
    second.kill()
    _, err = trainer.communicate(timeout=180)
    assert trainer.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert f"the rollout server at {second.url} cannot be reached" in err
    assert f"leaving the rollout server at {second.url} out for the rest of the run: its share moves to the other 1" in err
    # The other server generated the rest: the same completions and weights as a one-server run.
    assert main(["train", *run, f"rollout.server_url={first.url}", f"train.output_dir={tmp_path / 'one'}"]) == 0
    assert completions_log(out) == completions_log(tmp_path / "one")
    assert_same_but_entropy(untimed_metrics(out), untimed_metrics(tmp_path / "one"))
    assert_same_final_weights(tmp_path / "one", out)


@pytest.mark.process
def test_a_server_of_the_list_that_is_down_at_start_is_named(server, tmp_path, capsys):
    first = server()
    down = f"http://127.0.0.1:{free_port()}"
    code = main(["train", *SERVER_RUN, "train.max_steps=1", "rollout.engine=server",
                 f"rollout.server_url=[{first.url},{down}]", "rollout.server_timeout=1",
                 f"train.output_dir={tmp_path / 'run'}"])
    assert code == 2 and f"the rollout server at {down} cannot be reached" in capsys.readouterr().err  # checked at start


def test_prompt_groups_are_split_by_expected_tokens():
    from grpokit.engines.balance import split_groups

    assert split_groups([10, 10, 10, 10], 2) == [[0, 2], [1, 3]]
    assert split_groups([40, 10, 10, 10, 10], 2) == [[0], [1, 2, 3, 4]]  # the costly group alone
    assert split_groups([5, 7], 3) == [[1], [0], []]
    shares = split_groups(list(range(1, 30)), 4)
    loads = [sum(i + 1 for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(29)) and max(loads) - min(loads) <= 29


def test_requests_whose_clients_went_away_are_not_generated_on(tiny):
    """A client that gives up (a judge's or a trainer's timeout) frees the server: the generation in
    hand stops at its next token, and the requests queued behind it are dropped, on /generate and
    on the plain chat route a judge uses; the next request is answered at once."""
    import httpx
    import uvicorn

    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.engines.weights import fingerprint
    from grpokit.server import RolloutService, make_app

    class Slow(TransformersEngine):  # 10 ms a token, and no EOS: a long request takes 30 s
        def _next_logits(self, *args):
            time.sleep(0.01)
            return super()._next_logits(*args)

    model, tokenizer = tiny
    engine = Slow(model, tokenizer.pad_token_id, [-1])
    service = RolloutService(engine, "transformers", "tiny-random", fingerprint(model), 49152, tokenizer, [-1])
    service.session = "s"  # (as if a trainer had joined: /generate takes its weights)
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(make_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=http.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "temperature": 0}
    generate = {"fingerprint": service.fingerprint, "session": "s", "weights_version": 0,
                "prompts": [tokenizer.encode("hi")], "n": [2], "seeds": [1, 2],
                "sampling": {"max_tokens": 3000, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}

    def given_up(path, body):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + path, json=body, timeout=0.5)

    try:
        while not http.started:
            time.sleep(0.05)
        askers = [threading.Thread(target=given_up, args=a) for a in
                  [("/v1/chat/completions", chat)] * 3 + [("/generate", generate)] * 2]
        for a in askers:
            a.start()
        for a in askers:
            a.join()
        started = time.monotonic()
        answer = httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 5}, timeout=20).json()
        assert time.monotonic() - started < 10 and answer["usage"]["completion_tokens"] == 5
        # Five requests of 3000 tokens or more each: those begun stopped within a second of their
        # client's going, the others never began.
        assert engine.decoded_tokens < 1000, engine.decoded_tokens
    finally:
        http.should_exit = True
