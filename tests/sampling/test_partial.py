"""Partial rollouts (sampling/partial.py): each carried token's sampling log-prob is its log-prob
under the weights version that sampled it, given everything before it (float64, tokens of up to
three versions in one completion); a budget at least the longest completion is today's run, bit for
bit; a stopped run resumes with its carried completions, bit for bit; what it does not go with is
refused."""

import copy

import pytest
import torch
from support.runs import assert_same_run, metric_rows, untimed_metrics

from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.engines.batch import SamplingParams
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.models.logprobs import completion_logprobs
from grpokit.runtime.errors import ConfigError
from grpokit.sampling.partial import Partial
from grpokit.tasks.task import Example

RUN = ["--no-progress", "model.name=tiny-random", "reward.functions=[length]", "train.prompts_per_step=2",
       "rollout.num_generations=4", "rollout.max_completion_length=12", "data.eval_size=0", "train.learning_rate=1e-2"]


def without_partial(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("partial/")} for r in rows]


@pytest.mark.parametrize("decoder, stops", [("dynamic", False), ("static", False), ("dynamic", True)],
                         ids=["dynamic", "static", "stopped-when-enough-ended"])
def test_each_token_s_logprob_is_that_of_the_weights_that_sampled_it(decoder, stops):
    """Six steps of a float64 model, the weights moved between them; many ids end a completion, so
    that lengths differ and some completions are carried over two steps. Every trained token's
    recorded sampling log-prob is its log-prob under the weights of its version given the prompt and
    the tokens before it, and not under another's: the continuation samples from the new weights,
    its prefix recomputed under them."""
    policy, tokenizer = load_model("tiny-random", "float64"), load_tokenizer("tiny-random")
    ends = list(range(0, 3000))  # about 6% of the vocabulary: completions of every length
    engine = TransformersEngine(policy, tokenizer.pad_token_id, ends, decoder=decoder)
    config = load_config(None, ["rollout.partial=true", "rollout.partial_tokens=2", "rollout.max_completion_length=24",
                                "train.prompts_per_step=2", "rollout.num_generations=3", "rollout.partial_spare=4"])
    partial = Partial(config, tokenizer.pad_token_id, torch.device("cpu"))
    prompts = iter(range(1000))
    draw = lambda k: [Example(f"question {next(prompts)}") for _ in range(k)]  # noqa: E731
    encode = lambda e: tokenizer(e.prompt)["input_ids"]  # noqa: E731
    stream = torch.Generator().manual_seed(0)
    seeds = lambda n: torch.randint(0, 2**62, (n,), generator=stream)  # noqa: E731
    params = SamplingParams(24, temperature=1.0)
    weights, spans = {}, set()
    torch.manual_seed(0)
    for version in range(6):
        weights[version] = copy.deepcopy(policy)
        done = partial.step(version, engine, encode, draw, seeds, params, stops=stops)
        assert done.metrics["partial/rounds"] <= 2 or not stops  # the second runs until enough ended
        batch = done.batch
        for row, versions in enumerate(done.versions):
            spans.add(len(set(versions)))
            assert batch.completion_mask[row].sum() == len(versions)
            under = {v: completion_logprobs(weights[v], batch.prompt_ids[row:row + 1], batch.prompt_mask[row:row + 1],
                                            batch.completion_ids[row:row + 1])[0] for v in weights}  # (T,) each
            for v in set(versions):
                at = torch.tensor([u == v for u in versions] + [False] * (batch.completion_ids.shape[1] - len(versions)))
                # (the engine samples from float32 logits: its log-probs are the float64 model's to float32 rounding)
                torch.testing.assert_close(batch.sampling_logps[row][at].double(), under[v][at], rtol=0, atol=2e-5)
                for other in set(weights) - {v}:  # and not another version's: the weights moved
                    assert (batch.sampling_logps[row][at].double() - under[other][at]).abs().max() > 1e-3
        with torch.no_grad():  # the update: every weight moves
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert 3 in spans  # a completion carried over two steps: tokens of three versions


def test_a_budget_at_least_the_longest_completion_is_today_s_run(tmp_path):
    assert main(["train", *RUN, "train.max_steps=3", f"train.output_dir={tmp_path / 'today'}"]) == 0
    assert main(["train", *RUN, "train.max_steps=3", "rollout.partial=true", "rollout.partial_tokens=12",
                 f"train.output_dir={tmp_path / 'partial'}"]) == 0
    rows = metric_rows(tmp_path / "partial")
    assert [r["partial/rounds"] for r in rows if "loss" in r] == [1, 1, 1]
    assert without_partial(untimed_metrics(tmp_path / "partial")) == untimed_metrics(tmp_path / "today")
    from support.runs import assert_same_final_weights

    assert_same_final_weights(tmp_path / "partial", tmp_path / "today")


def test_a_stopped_run_resumes_with_its_carried_completions_bit_for_bit(tmp_path):
    ends = ["rollout.partial=true", "rollout.partial_tokens=3", "train.save_every=1"]
    assert main(["train", *RUN, *ends, "train.max_steps=4", f"train.output_dir={tmp_path / 'straight'}"]) == 0
    carried = [r["partial/carried_groups"] for r in metric_rows(tmp_path / "straight") if "loss" in r]
    lags = [r["partial/lag_max"] for r in metric_rows(tmp_path / "straight") if "loss" in r]
    assert any(carried) and max(lags) >= 1  # completions went on under new weights
    assert main(["train", *RUN, *ends, "train.max_steps=2", f"train.output_dir={tmp_path / 'stopped'}"]) == 0
    assert main(["train", *RUN, *ends, "train.max_steps=4", f"train.output_dir={tmp_path / 'stopped'}"]) == 0
    assert_same_run(tmp_path / "stopped", tmp_path / "straight", steps=4)


@pytest.mark.process
def test_killed_at_a_random_moment_a_run_resumes_with_its_carried_completions(tmp_path):
    """SIGKILL anywhere (in a step's rounds, its update, a checkpoint's write), then resume: the
    uninterrupted run, bit for bit."""
    import random
    import time

    from support.processes import grpokit
    from grpokit.rundir.folder import read_metrics

    args = ["train", *RUN, "rollout.partial=true", "rollout.partial_tokens=3", "train.save_every=2",
            "train.max_steps=12"]
    assert main([*args, f"train.output_dir={tmp_path / 'straight'}"]) == 0
    rng = random.Random()  # (the module's random is seeded per test)
    out, at, then = tmp_path / "killed", rng.randrange(3, 9), rng.uniform(0, 0.3)
    print(f"killed {then:.3f} s after step {at}")
    process = grpokit(*args, f"train.output_dir={out}")
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and sum("loss" in r for r in read_metrics(out / "metrics.jsonl")) >= at):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before the moment chosen"
        time.sleep(0.01)
    time.sleep(then)  # anywhere in the following step
    assert process.poll() is None
    process.kill()
    process.wait()
    assert not (out / "final").exists()
    assert main([*args, f"train.output_dir={out}"]) == 0
    assert_same_run(out, tmp_path / "straight", steps=12)


@pytest.mark.parametrize("setting, message", [
    (["rollout.partial=true", "rollout.is_correction=false"], "the importance weights are what corrects for that"),
    (["rollout.partial=true", "rollout.dynamic_sampling=true"], "rollout.partial with rollout.dynamic_sampling"),
    (["rollout.partial=true", "rollout.tools=[calculator]"], "rollout.partial with tools, environments or agents"),
    (["rollout.partial=true", "rollout.partial_tokens=0"], "rollout.partial_tokens=0: must be >= 1"),
    (["rollout.partial_tokens=8"], "rollout.partial_tokens=8 is set but rollout.partial=false"),
])
def test_what_partial_rollouts_do_not_go_with_is_refused(setting, message):
    with pytest.raises(ConfigError) as refused:
        load_config(None, setting)
    assert message in str(refused.value)


@pytest.mark.process
def test_partial_rollouts_through_a_rollout_server_are_the_in_process_run(server, tmp_path, monkeypatch):
    """A continuation is a generation from the prompt and the tokens so far: a server samples it as
    the in-process engine does, under the weights pushed after the update (the in-process engine
    run in rounds of partial_tokens here, as a server's are: not stopped when enough groups ended)."""
    pytest.importorskip("fastapi")
    from grpokit.sampling import sampler

    monkeypatch.setattr(sampler, "TransformersEngine", type("NoEarlyStop", (), {}))
    s = server()
    ends = ["rollout.partial=true", "rollout.partial_tokens=3", "train.max_steps=3"]
    assert main(["train", *RUN, *ends, f"train.output_dir={tmp_path / 'local'}"]) == 0
    assert main(["train", *RUN, *ends, "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={tmp_path / 'served'}"]) == 0
    assert max(r["partial/lag_max"] for r in metric_rows(tmp_path / "served") if "loss" in r) >= 1
    assert_same_run(tmp_path / "served", tmp_path / "local")


@pytest.mark.process
def test_partial_rollouts_generated_ahead_resume_bit_for_bit(server, tmp_path):
    """rollout.max_staleness=1 with partial rollouts: step n's rounds run on the server while step
    n - 1 trains, with the weights after step n - 2, and end when enough groups have (no step waits
    for its longest completion); a run stopped with steps queued and groups carried resumes as the
    straight run, bit for bit."""
    pytest.importorskip("fastapi")
    s = server()
    ahead = ["rollout.partial=true", "rollout.partial_tokens=3", "rollout.engine=server", f"rollout.server_url={s.url}",
             "rollout.max_staleness=1", "train.save_every=1"]
    assert main(["train", *RUN, *ahead, "train.max_steps=4", f"train.output_dir={tmp_path / 'straight'}"]) == 0
    rows = [r for r in metric_rows(tmp_path / "straight") if "loss" in r]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]  # the schedule's weights
    assert any(r["partial/carried_groups"] for r in rows) and max(r["partial/lag_max"] for r in rows) >= 2
    assert all(r["partial/lag_mean"] >= r["staleness"] for r in rows)  # counted from the trainer's weights
    import time

    from support.processes import grpokit

    # Killed once its step-2 checkpoint is written (step 3 queued then, and groups carried), resumed.
    stopped = tmp_path / "stopped"
    process = grpokit("train", *RUN, *ahead, "train.max_steps=4", f"train.output_dir={stopped}")
    deadline = time.monotonic() + 120
    while not (stopped / "checkpoints" / "step-2" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.01)
    process.kill()
    process.wait()
    assert main(["train", *RUN, *ahead, "train.max_steps=4", f"train.output_dir={stopped}"]) == 0
    assert_same_run(stopped, tmp_path / "straight", steps=4)


@pytest.mark.process
def test_partial_rollouts_generated_ahead_take_weight_pushes_in_flight(server, tmp_path):
    """rollout.in_flight_updates with partial rollouts: a round's tokens keep the weights the
    server tagged them with (some newer than the schedule's), and the lag counts from the trainer's."""
    pytest.importorskip("fastapi")
    s = server()
    run = tmp_path / "run"
    assert main(["train", *RUN, "rollout.partial=true", "rollout.partial_tokens=32", "rollout.max_completion_length=96",
                 "rollout.engine=server", f"rollout.server_url={s.url}", "rollout.max_staleness=1",
                 "rollout.in_flight_updates=true", "train.max_steps=4", f"train.output_dir={run}"]) == 0
    rows = [r for r in metric_rows(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0 <= r["partial/lag_mean"] <= r["partial/lag_max"] <= 1 + 4  # staleness + partial_max_lag


def test_carried_completions_train_alike_in_any_micro_batches(tmp_path, monkeypatch):
    """float64: a run with carried completions is the same run, to rounding, whatever its micro-batch
    size (the trained batch is a batch like any other)."""
    from support.exact import rmsnorm_in_input_dtype
    from support.runs import assert_close_metrics
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)  # float64 throughout

    ends = ["model.dtype=float64", "rollout.partial=true", "rollout.partial_tokens=3", "train.max_steps=3"]
    for size in (8, 2):
        assert main(["train", *RUN, *ends, f"train.micro_batch_size={size}", f"train.output_dir={tmp_path / str(size)}"]) == 0
    rows = untimed_metrics(tmp_path / "8")
    assert max(r["partial/lag_max"] for r in rows if "loss" in r) >= 1
    assert_close_metrics(rows, untimed_metrics(tmp_path / "2"))
