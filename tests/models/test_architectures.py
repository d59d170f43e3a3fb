"""The architecture matrix: tiny random builds of the families people train (support/architectures.py),
each with what sets it apart switched on (a window of 8 tokens beside global layers, sinks, q/k
norms, layers without RoPE, top-k experts, linear-attention and convolution layers), through every
log-prob pass and both decoders, against a plain forward of each whole sequence, in float64.

A pass that cannot be exact for a family is refused, with the reason, and never chosen by default:
packed rows and an agent's rows of several sequences under one 4D mask for a model whose layers
carry a state (its several sequences are split into rows of their own instead), the chunked head
for a model whose head does more than its output layer, the static decoder for windowed and hybrid
models. docs/models.md is this matrix, written by benchmarks/architectures.py."""

import pytest
import torch
from support.architectures import FAMILIES, build
from support.passes import DECODERS, PASSES, mask_of, pass_logprobs, plain_logprobs, ragged_batch, sampled

from grpokit.engines.static_decoder import static_decoding_problem
from grpokit.models.architecture import layers_of
from grpokit.models.logprobs import LogProbs, check_chunkable
from grpokit.models.packing import AUTO

# The agreement of a pass with the plain forward in float64: the last bits (~1e-15), except where
# the architecture's own kernels compute in float32 inside a float64 model: Qwen3.5's Gated
# DeltaNet computes its decay in float32, DeepSeek-V3's router its scores.
FLOOR = {"qwen3_5": 1e-7, "qwen3_5_moe": 1e-7, "deepseek_v3": 1e-8}
EXACT = 1e-12
# The decoders draw from float32 logits (engines/decoding.py sample_next), whatever the model's dtype.
SAMPLED = 1e-5


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(family):
        if family not in built:
            built[family] = build(family)
        return built[family]

    return get


def _chunkable(model) -> bool:
    try:
        check_chunkable(model)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_every_log_prob_pass_is_a_plain_forward(models, family):
    model = models(family)
    problem = layers_of(model).mask_problem()
    for several, after in ((False, False), (True, False), (True, True)):
        batch = ragged_batch(several_sequences=several, after_prompt=after)
        plain, where = plain_logprobs(model, batch, 0.7), mask_of(batch)
        for name in PASSES:
            label = f"{family}, {name}{', several sequences' if several else ''}{' after the prompt' if after else ''}"
            if name.startswith("packed") and problem:  # refused, with the reason
                with pytest.raises(ValueError, match="train.micro_batch_tokens packs completions"):
                    pass_logprobs(model, batch, name, 0.7)
                continue
            if name == "chunked" and not _chunkable(model):  # refused at start-up (load_policy), never picked
                continue
            got = pass_logprobs(model, batch, name, 0.7)
            assert ((got.double() - plain).abs() * where).max() < FLOOR.get(family, EXACT), label


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_packs_only_where_packing_is_exact(models, family):
    """A ragged step packs by default (packing.AUTO), except for a model whose layers carry a state."""
    model = models(family)
    passes = LogProbs(model, None, 1.0, None, False, False, 6, torch.device("cpu"), micro_batch_tokens=AUTO)
    batch = ragged_batch(lengths=[40, 2, 3, 1, 4, 2])  # one padded pass would be mostly padding
    assert (passes.budget(batch) is None) == bool(layers_of(model).stateful)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_decoders_sample_with_the_trainers_logprobs(models, family):
    model = models(family)
    for decoder in DECODERS:
        if decoder == "static" and static_decoding_problem(model.config):
            with pytest.raises(ValueError, match="rollout.decoder=static: this model"):
                sampled(model, decoder, 0.8)
            continue
        batch = sampled(model, decoder, 0.8)
        assert batch.completion_mask.sum() > 20
        plain, where = plain_logprobs(model, batch, 0.8), batch.completion_mask.bool()
        assert ((batch.sampling_logps.double() - plain).abs() * where).max() < SAMPLED, f"{family}, {decoder}"
        # and the step's own pass over what was sampled (packed or padded, as the default picks)
        trained = pass_logprobs(model, batch, "packed" if not layers_of(model).stateful else "shared prompt", 0.8)
        assert ((trained.double() - plain).abs() * where).max() < FLOOR.get(family, EXACT), f"{family}, {decoder}"


# ------------------------------------------------------------------------------ a step, LoRA, resume

# The families whose caches and masks differ from the bundled model's in kind: a window beside
# global layers (Gemma 3), linear attention (Qwen3.5), experts with a load-balancing loss (Qwen3-MoE),
# sinks and windowed experts (GPT-OSS). The suite runs the step tests on these; `-m slow` on all.
DISTINCT = ("gemma3", "qwen3_5", "qwen3_moe", "gpt_oss")
EVERY = [f if f in DISTINCT else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
# Gradients of one update in float64 agree to this (relative): transformers' RMSNorm layers compute in
# float32 inside a float64 model, so gradients that meet in another order round apart at ~1e-8.
GRADIENTS = 1e-6


def _trainer(tmp_path, family, *overrides, model=None):
    from support.architectures import with_tokenizer

    from grpokit.config.loading import load_config
    from grpokit.training.trainer import Trainer

    built, tokenizer = with_tokenizer(family)
    config = load_config(None, [
        "model.dtype=float64", "reward.functions=[support.rewards:shortness]", "data.eval_size=0",
        "train.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_completion_length=10",
        "train.learning_rate=1e-3", "algorithm.beta=0.04", "algorithm.num_iterations=2",
        f"train.output_dir={tmp_path / family / '-'.join(overrides or ['base'])}", *overrides])
    return Trainer(config, progress=False, model=model or built, tokenizer=tokenizer)


def _gradients(trainer) -> list:
    """Each optimizer update's gradient (flattened), recorded as the update applies it."""
    grads, step = [], trainer.parallel.step

    def recording(optimizer, params, *args):
        grads.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).clone())
        return step(optimizer, params, *args)

    trainer.parallel.step = recording
    return grads


def _ragged(trainer):
    from support.exact import cut_ragged

    examples = [next(trainer.sampler.stream) for _ in range(trainer.config.train.prompts_per_step)]
    batch = trainer.sampler.engine.generate([trainer.sampler.kind.encoder(e) for e in examples],
                                             trainer.config.rollout.num_generations, trainer.sampler.sampling,
                                             seeds=range(8))
    return examples, cut_ragged(batch, trainer.tokenizer.eos_token_id)


@pytest.mark.parametrize("family", EVERY)
def test_the_micro_batches_never_change_a_step(tmp_path, family):
    """One step of two passes with a KL term (and, for a mixture of experts, the model's own
    load-balancing loss): padded as one micro-batch, in micro-batches of 3, packed in rows of at
    most 40 tokens (refused at start-up where packing is not exact) and as the default picks: the
    same gradients, loss and metrics."""
    from support.exact import step_on

    from grpokit.runtime.errors import ConfigError

    runs = {}
    for knobs in ([], ["train.micro_batch_size=3"], ["train.micro_batch_tokens=40"], ["train.micro_batch_size=8"]):
        if knobs == ["train.micro_batch_tokens=40"] and layers_of(build(family)).stateful:
            with pytest.raises(ConfigError, match="train.micro_batch_tokens packs completions into rows"):
                _trainer(tmp_path, family, *knobs)
            continue
        trainer = _trainer(tmp_path, family, *knobs)
        examples, batch = _ragged(trainer)
        grads = _gradients(trainer)
        metrics = step_on(trainer, examples, batch)
        runs[tuple(knobs)] = grads, metrics
    (whole, whole_metrics), routed = runs[("train.micro_batch_size=8",)], "aux_loss" in runs[()][1]
    assert len(whole) == 2 and whole[0].norm() > 0
    assert routed == (family in ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "mixtral"))
    for knobs, (grads, metrics) in runs.items():
        for a, b in zip(grads, whole):
            assert (a - b).norm() <= GRADIENTS * b.norm(), (family, knobs)
        for key in ("loss", "kl", *(("aux_loss", "router/max_load") if routed else ())):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-7, abs=1e-12), (family, knobs, key)


MOE = ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "deepseek_v3", "mixtral")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A model folder of each family's tiny build over SmolLM2's tokenizer, as model.name takes one."""
    from support.architectures import with_tokenizer

    from grpokit.models.loading import save_model

    made = {}

    def get(family):
        if family not in made:
            model, tokenizer = with_tokenizer(family, torch.float32)
            made[family] = tmp_path_factory.mktemp(family)
            save_model(model, tokenizer, made[family])
        return made[family]

    return get


def _run(folders, family, out, *overrides) -> int:
    from grpokit.cli import main

    return main(["train", "--no-progress", f"model.name={folders(family)}", "reward.functions=[support.rewards:shortness]",
                 "data.eval_size=0", "train.prompts_per_step=2", "rollout.num_generations=4",
                 "rollout.max_completion_length=10", "train.learning_rate=1e-2", "algorithm.beta=0.04",
                 "train.save_every=1", f"train.output_dir={out}", *overrides])


@pytest.mark.parametrize("family", EVERY)
def test_lora_trains_the_adapters_and_final_loads_merged(folders, tmp_path, family):
    """LoRA on every linear layer of the language model (and a mixture of experts' routed experts
    and routers): its passes are the adapted model's plain forward, only adapters train, and final/
    loads as the base with the adapters merged, giving the trained model's logits."""
    from grpokit.models.loading import load_adapter, load_model

    lora = ["model.lora_rank=4", *(["model.lora_target_parameters=experts,router"] if family in MOE else [])]
    assert _run(folders, family, tmp_path / "run", *lora, "train.max_steps=2") == 0
    base = load_model(str(folders(family)), "float64")
    adapted = load_adapter(load_model(str(folders(family)), "float64"), str(tmp_path / "run" / "final"))
    targets = {n.split(".lora_A")[0] for n, _ in adapted.named_parameters() if ".lora_A" in n}
    linear = {f"base_model.model.{n}" for n, m in base.get_decoder().named_modules(prefix="model")
              if isinstance(m, torch.nn.Linear)}
    assert linear <= {t.replace(".base_layer", "") for t in targets}  # every linear layer, shared experts included
    if family in MOE:
        assert any(t.endswith("experts") for t in targets) and any("gate" in t or "router" in t for t in targets)
    merged = load_model(str(tmp_path / "run" / "final"), "float64").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        trained, plain = adapted.eval()(input_ids=ids).logits, merged(input_ids=ids).logits
        assert (trained - base.eval()(input_ids=ids).logits).abs().max() > 1e-6  # the adapters moved
        assert (trained - plain).abs().max() < 1e-9
    batch = ragged_batch(vocab=1000, several_sequences=True)
    for name in ("shared prompt", "packed"):
        if name == "packed" and layers_of(adapted).stateful:
            continue
        got = pass_logprobs(adapted, batch, name)
        assert ((got - plain_logprobs(adapted, batch)).abs() * mask_of(batch)).max() < FLOOR.get(family, EXACT), name


@pytest.mark.parametrize("family", EVERY)
def test_a_stopped_run_resumes_exactly(folders, tmp_path, family):
    from safetensors.torch import load_file
    from support.runs import untimed_metrics

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _run(folders, family, straight, "train.max_steps=3") == 0
    assert _run(folders, family, resumed, "train.max_steps=1") == 0
    assert _run(folders, family, resumed, "train.max_steps=3") == 0
    assert untimed_metrics(resumed) == untimed_metrics(straight) and len(untimed_metrics(straight)) == 3
    a, b = (load_file(r / "final" / "model.safetensors") for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# (DeepSeek-V3 routes by its scores plus a balancing bias in groups, not the top-k of its logits.)
@pytest.mark.parametrize("family", [f for f in MOE if f != "deepseek_v3"])
def test_a_sampled_token_is_routed_in_training_as_when_it_was_sampled(models, family):
    """The in-process engine's routing of every sampled token (each MoE layer's top-k experts) is
    the training pass's routing of the position that predicts it (recorded from the routers)."""
    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.models.routers import RouterLogits, router_modules

    model, k = models(family), models(family).config.num_experts_per_tok
    routers = [m for _, m in router_modules(model)[0]]
    calls = []  # each forward call's router logits, layer by layer: (rows * positions, E)
    hooks = [r.register_forward_hook(lambda m, i, out: calls.append(out[0] if isinstance(out, tuple) else out))
             for r in routers]
    try:  # no EOS in the vocabulary: every completion runs to the end, every row in every decoding step
        engine = TransformersEngine(model, pad_id=0, eos_ids=[10**6])
        batch = engine.generate([[5, 6, 7, 8, 9], [10, 11, 12]], 3, SamplingParams(12, temperature=1.0), seeds=range(6))
    finally:
        for h in hooks:
            h.remove()
    L, (N, T) = len(routers), batch.completion_ids.shape
    prefill = torch.stack(calls[:L]).view(L, 2, 5, -1)[:, :, -1][:, batch.prompt_index]  # (L, N, E): token 0
    steps = [torch.stack(calls[L * s: L * (s + 1)]).view(L, N, -1) for s in range(1, T)]  # tokens 1 .. T-1
    sampled = torch.stack([prefill, *steps], 2).topk(k, -1).indices.sort(-1).values  # (L, N, T, k)
    passes = LogProbs(model, None, 1.0, None, False, False, 6, torch.device("cpu"), routed=(0, k))
    with torch.no_grad():
        _, trained = passes.of(model, batch, torch.arange(N), routers=RouterLogits(model))  # (L, N, T, E)
    assert torch.equal(trained.topk(k, -1).indices.sort(-1).values, sampled)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_config_asking_for_router_logits_decodes(family):
    """output_router_logits: true in a model's config (for transformers' own training, its auxiliary
    loss) made its forward compute that loss against the decoding step's mask, and crash."""
    from grpokit.models.loading import fit_for_passes

    model = build(family, dtype=torch.float32)
    model.config.output_router_logits = True
    fit_for_passes(model)  # as loading does
    assert sampled(model, "dynamic").completion_mask.sum() > 0


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_a_hybrid_and_a_windowed_model_train_with_tools(tmp_path, family):
    """3 steps with the calculator tool, of a Qwen3.5-shaped and a Gemma 3-shaped random model (two
    layers) trained to call it or to answer at once: completions of 2 tokens beside conversations that run
    to the budget, so a step would pack. The windowed model's passes pack (their waste near 1); the
    hybrid's are padded, their several turns' state kept in its cache."""
    import json

    from support.processes import TESTS
    from support.runs import training_rows
    from support.trained_replies import tool_caller

    from grpokit.cli import main
    from grpokit.tasks.calculator import question

    questions = ((347, 58), (512, 33))
    model = tool_caller(tmp_path / "model", questions, steps=120, family=family, answers=True)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": question(a, b)}], "answer": a * b}) + "\n"
        for a, b in questions))
    assert main(["train", "--no-progress", f"model.name={model}", f"data.path={tmp_path / 'data.jsonl'}",
                 "data.eval_size=0", "rollout.tools=[grpokit.tasks.calculator:calculator]",
                 f"reward.functions=[{TESTS / 'support' / 'rewards.py'}:brevity]", "train.prompts_per_step=2",
                 "rollout.num_generations=4", "rollout.max_completion_length=72", "train.max_steps=3",
                 "train.learning_rate=1e-4", f"train.output_dir={tmp_path / 'run'}"]) == 0
    steps = training_rows(tmp_path / "run")
    shown = [{k: s[k] for k in ("tools/calls_per_rollout", "turns/mean", "completions/min_length",
                                 "completions/max_length")} for s in steps]
    assert len(steps) == 3 and all(s["tools/calls_per_rollout"] > 0 and s["turns/mean"] > 1 for s in steps), shown
    assert all(s["completions/min_length"] < 5 and s["completions/max_length"] > 20 for s in steps), shown  # ragged
    packed = [s["waste/passes"] < 1.5 for s in steps]
    assert packed == [family == "gemma3"] * 3, [s["waste/passes"] for s in steps]


@pytest.mark.parametrize("family,settings,refused", [
    ("qwen3_5", ["train.micro_batch_tokens=512"], "train.micro_batch_tokens packs completions into rows under one "
     "attention mask, but for this model its linear_attention layers carry a state"),
    ("lfm2", ["train.micro_batch_tokens=512"], "its conv layers carry a state"),
    ("llama", ["algorithm.router_aux_loss_coef=0.01"], "algorithm.router_aux_loss_coef=0.01: the model has no routers"),
    ("deepseek_v3", ["algorithm.router_aux_loss_coef=0.01"], "has no output_router_logits"),
    ("gemma3", ["rollout.decoder=static"], "rollout.decoder=static: this model has layers of other kinds"),
])
def test_the_start_up_checks_refuse_what_a_model_cannot_take(family, settings, refused):
    """Said at start-up from the model's config alone (grpokit config --check, train, eval, serve)."""
    from grpokit.config.checks import Facts, check, model_facts
    from grpokit.config.loading import load_config
    from grpokit.runtime.errors import ConfigError

    model = build(family, dtype=torch.float32)
    with pytest.raises(ConfigError, match=refused):
        check(load_config(None, settings), Facts(model=model_facts("a model", model, tokenizer=object())))
    check(load_config(None, []), Facts(model=model_facts("a model", model, tokenizer=object())))  # the defaults pass


def test_a_mixture_of_experts_checkpoint_that_does_not_fit_is_refused(tmp_path):
    """transformers writes a mixture of experts' weights one expert at a time; resuming converts them
    back, and a checkpoint with one missing is refused, not filled at random."""
    from safetensors.torch import load_file, save_file

    from grpokit.rundir.checkpoint import load_weights

    saved = build("qwen3_moe", dtype=torch.float32)
    saved.save_pretrained(tmp_path)
    model = build("qwen3_moe", dtype=torch.float32, seed=1)
    load_weights(model, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    weights = load_file(tmp_path / "model.safetensors")
    dropped = next(k for k in weights if ".experts.0." in k)
    save_file({k: v for k, v in weights.items() if k != dropped}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not fit the model"):
        load_weights(model, tmp_path)


def test_all_linear_is_every_linear_layer_but_the_head_and_the_routers():
    """peft's linear layers (transformers' Conv1D too: GPT-2), not the output layer, and not a
    router that is a linear layer (Llama 4's, whose logits are the second of its outputs): routers
    are model.lora_target_parameters=router's."""
    import transformers

    from grpokit.models.loading import lora_modules, lora_parameters
    from grpokit.models.routers import router_modules

    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4,
                                                                                 vocab_size=96))
    assert {n.split(".", 3)[-1] for n in lora_modules(gpt2, "all-linear")} == {"attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                                "mlp.c_proj"}
    llama4 = transformers.AutoModelForCausalLM.from_config(transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=96, num_local_experts=4, num_experts_per_tok=1))
    routers, index = router_modules(llama4)
    assert index == 1 and [n for n, _ in routers] == [f"model.layers.{i}.feed_forward.router" for i in range(2)]
    modules = lora_modules(llama4, "all-linear")
    assert "model.layers.0.feed_forward.shared_expert.up_proj" in modules and not any("router" in m for m in modules)
    assert lora_parameters(llama4, "router") == [f"model.layers.{i}.feed_forward.router.weight" for i in range(2)]
