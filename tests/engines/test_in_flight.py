"""In-flight weight updates (engines/in_flight.py): a push lands between two decode steps of a
generation, which goes on without dropping a completion; every token's sampling log-prob is its
log-prob under the weights that sampled it, given everything before it (float64, three versions in
one completion); a push of unchanged weights leaves the completions as they were; a trainer
generating ahead pushes into the servers' generations in flight."""

import copy
import threading
import time

import pytest
import torch
from support.runs import metric_rows
from support.servers import SERVER_RUN, get_health

from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.engines.batch import SamplingParams
from grpokit.engines.in_flight import Pushes
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.models.logprobs import completion_logprobs
from grpokit.runtime.errors import ConfigError

PROMPTS = [[1, 2, 3, 4], [5, 6]]


def pushed_at(policy, pushes: Pushes, lock: threading.Lock, calls: set[int], change) -> dict[int, torch.nn.Module]:
    """Push into the generation at its forward calls `calls`: change(policy) under the lock, as a
    server loads a push. The weights of each version (0: before any push), as they were."""
    versions, count = {0: copy.deepcopy(policy)}, [0]

    def push():
        with pushes.arriving(), lock:
            with torch.no_grad():
                change(policy)
            versions[len(versions)] = copy.deepcopy(policy)

    def hook(*_):
        count[0] += 1
        if count[0] in calls:
            threading.Thread(target=push).start()
            while pushes.waiting == 0:  # arrived: the generation stops at its next token
                time.sleep(0.001)

    policy.register_forward_hook(hook)
    return versions


def generate(engine, pushes, lock, versions, params, seeds):
    return pushes.generate(engine, lock, PROMPTS, [2, 2], params, seeds, lambda: len(versions) - 1)


def test_each_token_s_logprob_is_that_of_the_weights_that_sampled_it():
    """(A generation that takes pushes decodes dynamically, whatever rollout.decoder says.)"""
    policy, tokenizer = load_model("tiny-random", "float64"), load_tokenizer("tiny-random")
    engine = TransformersEngine(policy, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    pushes, lock = Pushes(), threading.Lock()
    torch.manual_seed(0)
    versions = pushed_at(policy, pushes, lock, {4, 10},
                         lambda model: [p.add_(torch.randn_like(p) * 0.05) for p in model.parameters()])
    out = generate(engine, pushes, lock, versions, SamplingParams(16, temperature=1.0), [11, 12, 13, 14])
    assert len(versions) == 3  # two pushes landed
    assert all(len(c["token_ids"]) == 16 and c["finish_reason"] == "length" for c in out)  # none dropped
    prompts = [p for p in PROMPTS for _ in range(2)]
    for prompt, c in zip(prompts, out):
        assert sorted(set(c["weights_steps"])) == [0, 1, 2]  # three versions in one completion
        ids = torch.tensor([c["token_ids"]])
        under = {v: completion_logprobs(w, torch.tensor([prompt]), torch.ones((1, len(prompt)), dtype=torch.long),
                                        ids)[0] for v, w in versions.items()}  # (T,) each
        logps = torch.tensor(c["logprobs"], dtype=torch.float64)
        for v in versions:
            at = torch.tensor([u == v for u in c["weights_steps"]])
            # (the engine samples from float32 logits: the float64 model's log-probs to float32 rounding)
            torch.testing.assert_close(logps[at], under[v][at], rtol=0, atol=2e-5)
            for other in set(versions) - {v}:  # and not another version's: the weights moved
                assert (logps[at] - under[other][at]).abs().max() > 1e-3


def test_a_push_of_unchanged_weights_leaves_the_completions_as_they_were():
    """A continued completion draws its seed's uniforms from its length on: under the same weights
    it samples the tokens of the uninterrupted generation."""
    policy, tokenizer = load_model("tiny-random", "float64"), load_tokenizer("tiny-random")
    engine = TransformersEngine(policy, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    params, seeds = SamplingParams(16, temperature=1.0), [21, 22, 23, 24]
    straight = engine.generate(PROMPTS, [2, 2], params, seeds)
    pushes, lock = Pushes(), threading.Lock()
    versions = pushed_at(policy, pushes, lock, {3, 9}, lambda model: None)
    out = generate(engine, pushes, lock, versions, params, seeds)
    assert len(versions) == 3
    for i, c in enumerate(out):
        assert c["token_ids"] == straight.completion_ids[i].tolist()
        torch.testing.assert_close(torch.tensor(c["logprobs"]), straight.sampling_logps[i], rtol=0, atol=1e-5)


def test_in_flight_updates_need_generation_ahead_and_refuse_what_they_do_not_carry():
    with pytest.raises(ConfigError, match="rollout.in_flight_updates=true is set but rollout.max_staleness"):
        load_config(None, ["rollout.in_flight_updates=true"])
    ahead = ["rollout.in_flight_updates=true", "rollout.max_staleness=1", "rollout.engine=server",
             "rollout.server_url=http://127.0.0.1:8000"]
    with pytest.raises(ConfigError, match="rollout.agent=.* with rollout.in_flight_updates"):
        load_config(None, [*ahead, "rollout.agent=examples.agents.x:y"])
    with pytest.raises(ConfigError, match="rollout.in_flight_updates with a vision-language model or with tools"):
        load_config(None, [*ahead, "rollout.tools=[calculator]"])


@pytest.mark.process
def test_a_server_takes_a_push_in_the_middle_of_a_generation(server, tiny):
    """Over HTTP: a push sent while the server generates lands between two of its decode steps; the
    tokens after it are sampled by the pushed weights (their log-probs theirs, given the prefix)."""
    pytest.importorskip("fastapi")
    from grpokit.engines.client import ServerEngine
    from grpokit.engines.weights import named_weights

    s = server()
    policy, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    engine = ServerEngine(s.url, policy, tokenizer.pad_token_id, timeout_s=60)
    engine.in_flight = True
    before = [(n, t.detach().clone()) for n, t in named_weights(policy)]
    engine.use_weights(before, 0)
    for tokens in (200, 400, 800):  # until the push lands before the generation ends
        out = {}
        thread = threading.Thread(target=lambda: out.update(batch=engine.generate(
            PROMPTS, 2, SamplingParams(tokens, temperature=1.0), [1, 2, 3, 4])))
        thread.start()
        time.sleep(0.3)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.push([(n, t.detach().clone()) for n, t in named_weights(policy)], 1)
        thread.join()
        batch = out["batch"]
        if batch.versions[:, -1].eq(1).all():
            break
    assert batch.completion_mask.all() and batch.versions[:, 0].eq(0).all() and batch.versions[:, -1].eq(1).all()
    old = copy.deepcopy(policy)
    old.load_state_dict(dict(before), strict=False)
    for row in range(len(batch.finish_reasons)):
        for version, model in ((0, old), (1, policy)):
            at = batch.versions[row] == version
            expected = completion_logprobs(model, batch.prompt_ids[row:row + 1], batch.prompt_mask[row:row + 1],
                                           batch.completion_ids[row:row + 1])[0]
            torch.testing.assert_close(batch.sampling_logps[row][at], expected[at], rtol=0, atol=1e-4)


def test_a_push_the_server_gets_wrong_fails_the_generation_in_flight(tiny):
    """A push whose checksum is not the trainer's: the generation it landed in is not used (its
    later tokens came from weights nobody verified), and the run's error names the checksums."""
    pytest.importorskip("fastapi")
    import uvicorn
    from support.processes import free_port

    from grpokit.engines.client import RolloutServerError, ServerEngine
    from grpokit.engines.weights import fingerprint, named_weights
    from grpokit.models.loading import eos_token_ids
    from grpokit.server import RolloutService, make_app

    class CorruptingLater(TransformersEngine):
        loads = 0

        def load_weights(self, pairs):
            CorruptingLater.loads += 1
            bad = CorruptingLater.loads > 1
            return super().load_weights((n, t + (1e-3 if bad and n.endswith("norm.weight") else 0)) for n, t in pairs)

    served, tokenizer = load_model("tiny-random"), tiny[1]
    engine = CorruptingLater(served, tokenizer.pad_token_id, eos_token_ids(served, tokenizer))
    port = free_port()
    app = make_app(RolloutService(engine, "transformers", "tiny-random", fingerprint(served), 49152))
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=http.run, daemon=True).start()
    try:
        while not http.started:
            time.sleep(0.05)
        policy = copy.deepcopy(tiny[0])
        client = ServerEngine(f"http://127.0.0.1:{port}", policy, tokenizer.pad_token_id, timeout_s=60)
        client.in_flight = True
        client.use_weights([(n, t.detach().clone()) for n, t in named_weights(policy)], 0)
        out = {}

        def generate():
            try:
                out["batch"] = client.generate(PROMPTS, 2, SamplingParams(300, temperature=1.0), [1, 2, 3, 4])
            except RolloutServerError as e:
                out["error"] = e

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(0.3)
        client.push([(n, t.detach().clone() + 0.01) for n, t in named_weights(policy)], 1)
        thread.join()
        if "error" not in out:  # (the generation ended before the push): the next one fails
            generate()
        assert "reports checksum" in str(out["error"])
    finally:
        http.should_exit = True


@pytest.mark.process
def test_a_trainer_generating_ahead_pushes_into_the_generations_in_flight(server, tmp_path):
    """rollout.max_staleness=1: step n generates while step n - 1 trains; its weights are pushed as
    soon as it has trained, and long generations take them in flight: every token is tagged, none
    older than the schedule's weights nor newer than the trainer's."""
    pytest.importorskip("fastapi")
    s = server()
    assert get_health(s.url)["in_flight"] is True
    run = tmp_path / "run"
    assert main(["train", *SERVER_RUN, "train.max_steps=4", "data.eval_size=0", "rollout.max_completion_length=96",
                 "rollout.engine=server", f"rollout.server_url={s.url}", "rollout.max_staleness=1",
                 "rollout.in_flight_updates=true", f"train.output_dir={run}"]) == 0
    rows = [r for r in metric_rows(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0 <= r["staleness/token_mean"] <= r["staleness/token_max"] <= r["staleness"] <= 1
