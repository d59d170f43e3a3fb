"""LoRA through peft: only the adapters train and are checkpointed; the reference is the base model
(adapters off), no second copy; a stopped LoRA run resumes exactly; final/ loads for evaluation and
--merge writes the merged model; a rollout server gets the merged weights."""

import pytest
import torch
from support.runs import metric_rows, train_only_adapters, untimed_metrics
from support.servers import get_health
from safetensors.torch import load_file

from grpokit.cli import main
from grpokit.models.loading import load_model

pytest.importorskip("peft", reason="LoRA needs: pip install 'grpokit[lora]'")

RUN = ["--no-progress", "model.name=tiny-random", "model.lora_rank=4", "reward.functions=[length]",
       "train.prompts_per_step=2", "rollout.num_generations=4", "data.eval_size=2", "algorithm.beta=0.04",
       "train.learning_rate=1e-2"]


def test_only_adapters_train_and_the_reference_is_the_base_model(tmp_path):
    from grpokit.config.loading import load_config
    from grpokit.training.trainer import Trainer

    config = load_config(None, [*RUN[1:], "train.max_steps=2", f"train.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(config, progress=False)
    assert trainer.reference is None  # no copy of the weights for the KL term
    train_only_adapters(trainer)
    # The adapters' off-switch gives the base model's log-probs exactly.
    base = load_model("tiny-random").requires_grad_(False)  # frozen, as under the adapters (same CPU kernels)
    batch = trainer.sampler.sample(trainer.sampler.next_prompts())
    active = torch.ones(len(batch.finish_reasons), dtype=torch.bool)
    ref = trainer.logprobs.ref(batch, active)
    assert torch.equal(ref, trainer.logprobs.frozen(base, batch, active))

    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    assert not (checkpoint / "model.safetensors").exists()
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # the adapters alone


def test_a_stopped_lora_run_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *RUN, "train.max_steps=4", f"train.output_dir={straight}"]) == 0
    assert main(["train", *RUN, "train.max_steps=2", f"train.output_dir={resumed}"]) == 0
    assert main(["train", *RUN, "train.max_steps=4", f"train.output_dir={resumed}"]) == 0
    # (The 2-step run also evaluated at step 2.)
    train = lambda run: [r for r in untimed_metrics(run) if "loss" in r]  # noqa: E731
    assert train(resumed) == train(straight) and len(train(straight)) == 4
    a, b = (load_file(r / "final" / "adapter_model.safetensors") for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_final_loads_for_evaluation_and_merges(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *RUN, "train.max_steps=2", "--merge", f"train.output_dir={run}"]) == 0
    assert f"merged model: {run / 'final' / 'merged'}" in capsys.readouterr().out
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(load_model("tiny-random"), str(run / "final")).eval()
    merged = load_model(str(run / "final" / "merged")).eval()
    assert not hasattr(merged, "peft_config")  # a plain transformers model
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert main(["eval", "--model", str(run / "final")]) == 0
    assert "eval" not in capsys.readouterr().err.lower()


def test_merge_without_lora_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--no-progress", "model.name=tiny-random", "--merge", f"train.output_dir={tmp_path}"]) == 2
    assert "--merge merges LoRA adapters" in capsys.readouterr().err


def test_a_rollout_engine_gets_the_merged_weights_under_the_base_names(tiny):
    """What a server or vLLM receives: W + scale * B @ A under the plain model's names, computed
    apart (the policy's base weights are left untouched)."""
    from grpokit.config.loading import load_config
    from grpokit.engines.weights import fingerprint, named_weights
    from grpokit.models.loading import apply_lora

    model = load_model("tiny-random")
    config = load_config(None, ["model.lora_rank=4"])
    peft_model = apply_lora(model, config.model, "tiny-random")
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    base_before = {n: t.clone() for n, t in named_weights(peft_model.get_base_model()) if "lora_" not in n}
    merged = dict(named_weights(peft_model))
    plain = dict(named_weights(tiny[0]))
    assert merged.keys() == plain.keys()
    assert fingerprint(peft_model) == fingerprint(tiny[0])
    reference = load_model("tiny-random")
    reference.load_state_dict({**reference.state_dict(), **merged})
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    assert all(torch.equal(t, base_before[n]) for n, t in named_weights(peft_model.get_base_model()) if n in base_before)
    # In bf16 the adapters stay float32 (peft's default): the merged weights come back in bf16.
    bf16 = apply_lora(load_model("tiny-random", "bfloat16"), config.model, "tiny-random")
    assert {t.dtype for _, t in named_weights(bf16)} == {torch.bfloat16}


@pytest.mark.process
def test_a_lora_run_through_a_rollout_server_pushes_its_adapters_alone(tmp_path, server):
    """The server puts the same adapters on its own base: each push carries the adapters alone
    (checked by checksum), `weights/push_bytes` says their size, and the run is the in-process run
    bit for bit (the server computes base + adapters as the trainer's forward does)."""
    pytest.importorskip("fastapi")
    from grpokit.engines.weights import adapter_tensors, checksum, named_weights
    from grpokit.models.loading import load_adapter

    s = server()
    served, local = tmp_path / "served", tmp_path / "local"
    assert main(["train", *RUN, "train.max_steps=2", f"train.output_dir={local}"]) == 0
    assert main(["train", *RUN, "train.max_steps=2", "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={served}"]) == 0
    health = get_health(s.url)
    assert health["adapters"] and health["weights_version"] == 3  # before the first evaluation, after each of 2 updates
    trained = load_adapter(load_model("tiny-random"), str(served / "final"))
    assert health["checksum"] == checksum(adapter_tensors(trained))
    # (step 1 samples with the weights pushed before the step-0 evaluation: it pushes nothing)
    pushed = [r.get("weights/push_bytes") for r in metric_rows(served) if "loss" in r]
    adapters = sum(t.numel() * t.element_size() for _, t in adapter_tensors(trained))
    whole = sum(t.numel() * t.element_size() for _, t in named_weights(load_model("tiny-random")))
    assert pushed == [None, adapters] and adapters < whole / 10
    assert untimed_metrics(served) == untimed_metrics(local)
    assert load_file(served / "final" / "adapter_model.safetensors").keys() == \
        load_file(local / "final" / "adapter_model.safetensors").keys()
    for k, v in load_file(served / "final" / "adapter_model.safetensors").items():
        assert torch.equal(v, load_file(local / "final" / "adapter_model.safetensors")[k]), k


@pytest.mark.process
def test_adapter_pushes_sample_as_merged_pushes(tmp_path, server):
    """After 2 steps, a float64 server given the adapters alone samples the same tokens with the same
    log-probs (to rounding) as one given the merged weights, and as the trainer computes them."""
    pytest.importorskip("fastapi")
    from grpokit.config.loading import load_config
    from grpokit.engines.client import ServerEngine
    from grpokit.training.trainer import Trainer

    adapters, merged = server("--dtype", "float64"), server("--dtype", "float64")
    config = load_config(None, [*RUN[1:], "model.dtype=float64", "train.max_steps=2", "rollout.engine=server",
                                f"rollout.server_url={adapters.url}", f"train.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(config, progress=False)
    trainer.train()
    policy = trainer.policy
    engines = [ServerEngine(url, policy, trainer.tokenizer.pad_token_id, 60.0) for url in (adapters.url, merged.url)]
    assert engines[0].adapter_only
    engines[1].adapter_only, engines[1].servers[0].adapters = False, None  # as to an engine that takes whole weights
    examples, rollouts = trainer.sampler.next_prompts(), trainer.sampler
    batches = [rollouts.kind.generate(e, examples, [4] * len(examples), rollouts.sampling, list(range(4 * len(examples))))
               for e in engines]
    assert engines[0].pushed[0] < engines[1].pushed[0] / 10
    assert torch.equal(batches[0].completion_ids, batches[1].completion_ids)
    mask = batches[0].completion_mask.bool()
    torch.testing.assert_close(batches[0].sampling_logps[mask], batches[1].sampling_logps[mask], rtol=0, atol=1e-12)
    active = torch.ones(len(batches[0].finish_reasons), dtype=torch.bool)
    own = trainer.logprobs.frozen(policy, batches[0], active)  # float64; a server's arrive as float32
    torch.testing.assert_close(batches[0].sampling_logps[mask], own[mask].float(), rtol=1.2e-7, atol=0)
    for e in engines:
        e.close()


@pytest.mark.process
def test_a_server_refuses_adapters_onto_another_base_or_of_settings_it_cannot_make(tmp_path, server, capsys):
    """Adapters sample from the base they were trained on: a server whose base was changed by a push of
    whole weights is refused at start-up; settings its peft cannot make are refused (422), and the
    right ones are taken after."""
    pytest.importorskip("fastapi")
    from grpokit.config.loading import load_config
    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.client import RolloutServerError, ServerEngine
    from grpokit.engines.weights import adapter_tensors, checksum
    from grpokit.models.loading import apply_lora, load_tokenizer

    s = server()
    full = [a for a in RUN if not a.startswith("model.lora_rank")]
    served = ["train.max_steps=1", "rollout.engine=server", f"rollout.server_url={s.url}"]
    assert main(["train", *full, *served, f"train.output_dir={tmp_path / 'full'}"]) == 0  # its weights pushed
    capsys.readouterr()
    assert main(["train", *RUN, *served, f"train.output_dir={tmp_path / 'lora'}"]) == 2
    assert "its base weights are not the trainer's" in capsys.readouterr().err

    fresh = server()
    policy = apply_lora(load_model("tiny-random"), load_config(None, ["model.lora_rank=4"]).model, "tiny-random")
    pad, params = load_tokenizer("tiny-random").pad_token_id, SamplingParams(max_tokens=4)
    engine = ServerEngine(fresh.url, policy, pad, 30.0)
    good = engine.servers[0].adapters
    engine.servers[0].adapters = {**good, "no_such_setting": 1}
    with pytest.raises(RolloutServerError, match="cannot be put on tiny-random"):
        engine.generate([[1, 2, 3]], 2, params, seeds=[1, 2])
    assert get_health(fresh.url)["weights_version"] == -1  # what it holds is unknown: no generation until a push
    again = ServerEngine(fresh.url, policy, pad, 30.0)
    assert again.generate([[1, 2, 3]], 2, params, seeds=[1, 2]).completion_ids.shape[0] == 2
    assert get_health(fresh.url)["checksum"] == checksum(adapter_tensors(policy))


@pytest.mark.process
def test_lora_generated_ahead_pushes_copies_of_its_adapters(tmp_path, server, monkeypatch):
    """rollout.max_staleness=1: the copies pushed ahead are the adapters alone, and the float64 run is
    the run whose pushes are the merged weights, to rounding."""
    pytest.importorskip("fastapi")
    from support.runs import assert_close_metrics

    from grpokit.engines.client import RolloutServer

    args = [*RUN, "model.dtype=float64", "train.max_steps=3", "rollout.engine=server", "rollout.max_staleness=1"]
    s = server("--dtype", "float64")
    assert main(["train", *args, f"rollout.server_url={s.url}", f"train.output_dir={tmp_path / 'adapters'}"]) == 0
    rows = metric_rows(tmp_path / "adapters")
    assert [r["staleness"] for r in rows if "loss" in r] == [0, 1, 1]
    from grpokit.engines.weights import adapter_tensors
    from grpokit.models.loading import load_adapter

    trained = load_adapter(load_model("tiny-random", "float64"), str(tmp_path / "adapters" / "final"))
    adapters = sum(t.numel() * t.element_size() for _, t in adapter_tensors(trained))
    assert {r["weights/push_bytes"] for r in rows if "weights/push_bytes" in r} == {adapters}
    checked = RolloutServer._check_server
    monkeypatch.setattr(RolloutServer, "_check_server", lambda self: {**checked(self), "adapters": False})
    whole = server("--dtype", "float64")
    assert main(["train", *args, f"rollout.server_url={whole.url}", f"train.output_dir={tmp_path / 'merged'}"]) == 0
    assert_close_metrics(untimed_metrics(tmp_path / "merged"), untimed_metrics(tmp_path / "adapters"))
