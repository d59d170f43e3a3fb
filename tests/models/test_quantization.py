"""model.quantization (QLoRA): the base model's linear layers hold bitsandbytes' 4-bit (NF4, FP4) or
int8 codes, LoRA's adapters train beside them in float32. Only the adapters change; the reference is
the quantized base with its adapters off; the in-process engine samples with the very model the
trainer computes log-probs with; the update does not depend on the micro-batch size nor on the
process count; a stopped run resumes bit for bit; final/ holds the adapter, says which base it
was trained on, and loads (and merges) onto that base's weights as the adapters saw them."""

import json

import pytest
import torch
from safetensors.torch import load_file
from support.exact import cut_ragged, step_on, update_difference
from support.processes import run_worker
from support.runs import measured, metric_rows, train_only_adapters, untimed_metrics

from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.models.loading import QUANTIZATION_FILE, load_model
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.training.trainer import Trainer

pytest.importorskip("peft", reason="QLoRA needs: pip install 'grpokit[quantization]'")
bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs: pip install 'grpokit[quantization]'")

RUN = ["model.name=tiny-random", "model.lora_rank=4", "reward.functions=[length]", "train.prompts_per_step=2",
       "rollout.num_generations=4", "rollout.max_completion_length=8", "data.eval_size=1", "algorithm.beta=0.04",
       "train.learning_rate=1e-2"]
LAYERS = {"nf4": bnb.nn.Linear4bit, "fp4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}


def trainer_of(tmp_path, *overrides, name="run"):
    return Trainer(load_config(None, [*RUN, f"train.output_dir={tmp_path / name}", *overrides]), progress=False)


@pytest.mark.parametrize("quantization", [
    "nf4", pytest.param("fp4", marks=pytest.mark.slow), "int8"])  # (fp4: nf4's layer, another code book)
def test_adapters_train_on_a_quantized_base_that_samples_and_scores_alike(tmp_path, quantization):
    trainer = trainer_of(tmp_path, f"model.quantization={quantization}", "train.max_steps=2", "data.eval_size=0")
    base = trainer.policy.get_base_model()
    q_proj = base.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q_proj, LAYERS[quantization]) and trainer.reference is None  # no copy for the KL term
    assert not isinstance(base.lm_head, LAYERS[quantization])  # the output layer stays in model.dtype
    train_only_adapters(trainer)

    # The engine's sampling log-probs are the trainer's (both decoders): no importance correction.
    batch = trainer.sampler.sample(trainer.sampler.next_prompts())
    active = torch.ones(len(batch.finish_reasons), dtype=torch.bool)
    mask = batch.completion_mask.bool()
    training = trainer.logprobs.frozen(trainer.policy, batch, active)
    torch.testing.assert_close(batch.sampling_logps[mask], training[mask], atol=2e-5, rtol=0)
    trainer.sampler.engine.decoder = "static"
    static = trainer.sampler.sample(trainer.sampler.next_prompts())
    mask = static.completion_mask.bool()
    torch.testing.assert_close(static.sampling_logps[mask],
                               trainer.logprobs.frozen(trainer.policy, static, active)[mask], atol=2e-5, rtol=0)
    # The reference: the adapters switched off, the same quantized base.
    with trainer.policy.disable_adapter():
        off = trainer.logprobs.frozen(trainer.policy, batch, active)
    assert torch.equal(trainer.logprobs.ref(batch, active), off) and not torch.equal(off, training)

    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # the adapters alone
    assert json.loads((checkpoint / QUANTIZATION_FILE).read_text()) == {"quantization": quantization}


@pytest.mark.parametrize("quantization", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_micro_batch_size_never_changes_a_quantized_update(tmp_path, quantization):
    """Whole, half and single-completion micro-batches on a fixed batch: the same loss, gradient
    norm and update (float32: to its rounding). Two passes, the second off-policy, so that the
    adapters' B (zero at first) has moved before the update that is compared."""
    knobs = [f"model.quantization={quantization}", "algorithm.num_iterations=2", "rollout.max_completion_length=6"]
    first = trainer_of(tmp_path, *knobs, name="whole")
    examples = [next(first.sampler.stream) for _ in range(2)]
    batch = cut_ragged(first.sampler.engine.generate([first.sampler.kind.encoder(e) for e in examples], 4,
                                                      first.sampler.sampling, seeds=range(8)), first.tokenizer.eos_token_id)
    runs = {}
    for m in (8, 4, 1):
        trainer = first if m == 8 else trainer_of(tmp_path, *knobs, f"train.micro_batch_size={m}", name=f"m{m}")
        start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}
        metrics = step_on(trainer, examples, batch)
        runs[m] = start, {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}, metrics
    start, whole, whole_metrics = runs[8]
    assert whole_metrics["grad_norm"] > 0
    for m in (4, 1):
        _, params, metrics = runs[m]
        assert update_difference(start, whole, params) < 1e-4, f"micro_batch_size={m}"
        for key in ("loss", "grad_norm", "kl"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-7), (m, key)


@pytest.mark.process
def test_two_processes_compute_the_one_process_quantized_update(tmp_path):
    """Every group split over the two processes; float32 compute on the fixed quantized weights."""
    overrides = ["model.dtype=float32", "model.lora_rank=4", "model.quantization=nf4", "train.prompts_per_step=2",
                 "rollout.num_generations=4", "algorithm.beta=0.04", "algorithm.num_iterations=2",
                 "train.micro_batch_size=2", "ragged"]
    one, two = run_worker(tmp_path, "learn", overrides)
    for name in one["params"]:
        assert torch.equal(two[0]["params"][name], two[1]["params"][name]), name  # lockstep, bit for bit
    trained = [k for k in one["start"] if "lora_" in k]
    assert update_difference({k: one["start"][k] for k in trained}, {k: one["params"][k] for k in trained},
                             {k: two[0]["params"][k] for k in trained}) < 1e-4
    for key, value in one["metrics"].items():
        if not measured(key):
            assert two[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key


def test_a_stopped_quantized_run_resumes_bit_for_bit_and_final_loads_onto_its_base(tmp_path, capsys):
    args = ["train", "--no-progress", *RUN, "model.quantization=nf4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*args, "train.max_steps=2", f"train.output_dir={straight}"]) == 0
    assert main([*args, "train.max_steps=1", f"train.output_dir={resumed}"]) == 0
    assert main([*args, "train.max_steps=2", "--merge", f"train.output_dir={resumed}"]) == 0
    train = lambda run: [r for r in untimed_metrics(run) if "loss" in r]  # noqa: E731
    assert train(resumed) == train(straight) and len(train(straight)) == 2
    a, b = (load_file(r / "final" / "adapter_model.safetensors") for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # final/ names its base's quantization; it loads as that base's weights as the adapters saw them
    # (dequantized), the adapters merged in: the trained model's logits.
    final = resumed / "final"
    assert json.loads((final / QUANTIZATION_FILE).read_text()) == {"quantization": "nf4"}
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(load_model("tiny-random", quantization="nf4"), str(final)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        trained = adapted(input_ids=ids).logits
        for loaded in (load_model(str(final)), load_model(str(final / "merged"))):
            assert not hasattr(loaded, "peft_config") and not getattr(loaded, "is_quantized", False)
            torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
        plain = PeftModel.from_pretrained(load_model("tiny-random"), str(final)).eval()(input_ids=ids).logits
        assert (plain - trained).abs().max() > 1e-3  # the unquantized base is another model
    assert "grpokit train --merge" in (final / "README.md").read_text()
    assert main(["eval", "--model", str(final)]) == 0


@pytest.mark.parametrize("overrides, message", [
    (["model.quantization=nf4"], "model.quantization=nf4 is set but model.lora_rank=0 trains every weight, which "
                                 "quantized weights cannot: set model.lora_rank > 0"),
    (["model.quantization=nf3", "model.lora_rank=4"], "model.quantization=nf3: must be one of none, nf4, fp4, int8"),
    (["model.quantization=int8", "model.lora_rank=4", "model.dtype=float64"], "bitsandbytes computes in float32"),
    (["model.quantization=nf4", "model.lora_rank=4", "rollout.engine=vllm"], "vLLM holding the same bitsandbytes-quantized base is not built"),
])
def test_contradictory_quantization_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    assert message in str(refused.value)


@pytest.mark.process
def test_a_quantized_server_takes_the_adapters_and_samples_as_the_trainer(tmp_path, server, capsys):
    """`grpokit serve --quantization nf4` holds the same quantized base: the trainer pushes its
    adapters alone, and the run is the in-process run bit for bit. A server of the unquantized
    model is refused, by name."""
    pytest.importorskip("fastapi")
    s = server("--quantization", "nf4")
    args = ["train", "--no-progress", *RUN, "model.quantization=nf4", "train.max_steps=2"]
    assert main([*args, f"train.output_dir={tmp_path / 'local'}"]) == 0
    assert main([*args, "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={tmp_path / 'served'}"]) == 0
    pushed = [r["weights/push_bytes"] for r in metric_rows(tmp_path / "served") if "weights/push_bytes" in r]
    assert pushed and all(0 < b < 100_000 for b in pushed)  # the adapters alone (the base: megabytes)
    assert untimed_metrics(tmp_path / "served") == untimed_metrics(tmp_path / "local")
    plain = server()
    assert main([*args, "rollout.engine=server", f"rollout.server_url={plain.url}",
                 f"train.output_dir={tmp_path / 'refused'}"]) == 2
    assert "quantization: 'nf4' in the trainer, 'none' here" in capsys.readouterr().err


def test_a_missing_bitsandbytes_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # import fails
    with pytest.raises(StartupError, match=r"model.quantization=nf4 needs bitsandbytes: pip install 'grpokit\[quantization\]'"):
        trainer_of(tmp_path, "model.quantization=nf4")
