"""Vision-language models, exact: images reach every pass, and micro-batch size and process count
never change the update. Checked in float64 on tiny random builds of Qwen2.5-VL (3-D rotary
positions), Idefics3 (the built-in tiny-random-vlm) and Gemma 3 (token_type_ids), on prompts of 0,
1 and 3 images and different lengths (so padding matters)."""

import json

import pytest
import torch
from support.exact import cut_ragged, float64_everywhere, step_on, update_difference
from support.processes import run_worker
from support.rewards import shortness
from support.runs import assert_same_run, measured
from support.servers import get_health
from support.vlms import BUILDS, image, messages

from grpokit.config.loading import load_config
from grpokit.engines import transformers_engine
from grpokit.engines.batch import SamplingParams
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.models.logprobs import completion_logprobs
from grpokit.models.vision import IMAGE_TOKEN, Vision
from grpokit.rewards.reward_set import REWARD_FUNCTIONS
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.tasks.task import DataError
from grpokit.training.trainer import Trainer

EXACT = 1e-9

# Prompts of 1, 0 and 3 images (of two sizes), and of different lengths.
ROWS = [(messages(1, "What colour is this?"), (image((255, 0, 0)),)),
        (messages(0, "Say something longer than the others please, thanks."), ()),
        (messages(3, "Count"), (image((0, 255, 0)), image((0, 0, 255), (90, 60)), image((9, 9, 9))))]


def alone(model, processor, vision, prompt, images, completion):
    """Log-probs of `completion` after `prompt` with `images`, the sequence run by itself through
    the model with the processor's own inputs (its last token is predicted, never an input)."""
    inputs = processor(text=[vision.render(prompt)], images=[list(images)] if images else None, return_tensors="pt",
                       add_special_tokens=False)
    n = inputs["input_ids"].shape[1]
    extra = {}
    for key, value in inputs.items():
        if key in ("token_type_ids", "mm_token_type_ids"):  # aligned with the ids: the completion's are text
            value = torch.cat([value, value.new_zeros(1, len(completion) - 1)], dim=1)
        if key not in ("input_ids", "attention_mask"):
            extra[key] = value.double() if value.is_floating_point() else value
    ids = torch.cat([inputs["input_ids"], torch.tensor([completion[:-1]], dtype=torch.long)], dim=1)
    logits = model(input_ids=ids, **extra).logits[0, n - 1:]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.fixture(scope="module", params=list(BUILDS))
def built(request):
    float64_everywhere()
    model, processor = BUILDS[request.param](torch.float64)
    return request.param, model.eval(), processor, Vision(processor)


def sampled(model, processor, vision, rows=ROWS, n=2, slots=None):
    prompts = [vision.encode(p, images) for p, images in rows]
    engine = TransformersEngine(model, processor.tokenizer.pad_token_id, [processor.tokenizer.eos_token_id],
                                vision=vision, slots=slots)
    return prompts, engine.generate(prompts, n, SamplingParams(6, 1.0), seeds=range(n * len(rows)),
                                    images=[images for _, images in rows])


@pytest.mark.parametrize("how", ["shared", "whole", "chunked"])
def test_logprobs_with_images_equal_each_sequence_alone(built, how):
    name, model, processor, vision = built
    prompts, batch = sampled(model, processor, vision)
    first = torch.tensor([0, 2, 4])
    logps = completion_logprobs(model, batch.prompt_ids[first], batch.prompt_mask[first], batch.completion_ids,
                                batch.prompt_index, vision=vision, images=[images for _, images in ROWS],
                                share_prompt=how != "whole", chunk_size=5 if how == "chunked" else None)
    for i, p in enumerate(batch.prompt_index.tolist()):
        expected = alone(model, processor, vision, *ROWS[p], batch.completion_ids[i].tolist())
        torch.testing.assert_close(logps[i], expected, rtol=0, atol=1e-12)
        # Sampling saw the images as well (its log-probs are float32's).
        torch.testing.assert_close(batch.sampling_logps[i], expected.float(), rtol=0, atol=1e-5)
    assert batch.images == [ROWS[p][1] for p in batch.prompt_index.tolist()]


def test_reference_logprobs_change_when_the_image_changes(built):
    """A pass that dropped the images, or gave a row another row's, would fail this."""
    name, model, processor, vision = built
    _, batch = sampled(model, processor, vision)
    first = torch.tensor([0, 2, 4])

    def logps(images, share):
        return completion_logprobs(model, batch.prompt_ids[first], batch.prompt_mask[first], batch.completion_ids,
                                   batch.prompt_index, vision=vision, images=images, share_prompt=share)

    other = [(image((0, 0, 0)),), (), ROWS[2][1][:2] + (image((200, 200, 0)),)]
    for share in (True, False):
        same, changed = logps([images for _, images in ROWS], share), logps(other, share)
        assert (same[:2] - changed[:2]).abs().max() > 1e-3  # prompt 0's image changed
        assert torch.equal(same[2:4], changed[2:4])  # prompt 1 has no image
        assert (same[4:] - changed[4:]).abs().max() > 1e-3  # prompt 2's third image changed


def test_a_sampled_image_token_ends_its_completion_and_is_never_an_input(built, monkeypatch):
    name, model, processor, vision = built
    sample_next = transformers_engine.sample_next
    steps = iter(range(100))

    def with_an_image_token(logits, params, uniforms):
        tokens, logps, entropies, top = sample_next(logits, params, uniforms)
        if next(steps) == 2:  # the third token of completion 0
            tokens = tokens.clone()
            tokens[0] = vision.image_token_id
        return tokens, logps, entropies, top

    monkeypatch.setattr(transformers_engine, "sample_next", with_an_image_token)
    _, batch = sampled(model, processor, vision)
    assert batch.finish_reasons[0] == IMAGE_TOKEN and batch.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch.completion_ids[0, 2] == vision.image_token_id
    assert set(batch.finish_reasons[1:]) <= {"length", "stop"}
    first = torch.tensor([0, 2, 4])
    logps = completion_logprobs(model, batch.prompt_ids[first], batch.prompt_mask[first], batch.completion_ids,
                                batch.prompt_index, vision=vision, images=[images for _, images in ROWS])
    expected = alone(model, processor, vision, *ROWS[0], batch.completion_ids[0, :3].tolist())
    torch.testing.assert_close(logps[0, :3], expected, rtol=0, atol=1e-12)


def test_completions_waiting_for_a_slot_sample_what_they_would_all_at_once_with_images(built):
    """rollout.decode_slots with a vision-language model: a completion that joins the batch later
    starts from its prompt's cache (its images in it) and positions (mRoPE's included)."""
    name, model, processor, vision = built
    _, whole = sampled(model, processor, vision)
    _, slotted = sampled(model, processor, vision, slots=2)
    assert torch.equal(whole.completion_ids, slotted.completion_ids) and whole.finish_reasons == slotted.finish_reasons
    # (sampling computes in float32: equal with one thread, to its rounding with several)
    torch.testing.assert_close(slotted.sampling_logps, whole.sampling_logps, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- training


def write_rows(folder, rows=None) -> str:
    """A JSONL dataset of ROWS (images as PNG files beside it, named relative to it)."""
    lines = []
    for i, (prompt, images) in enumerate(rows or ROWS):
        names = []
        for j, im in enumerate(images):
            im.save(folder / f"{i}-{j}.png")
            names.append(f"{i}-{j}.png")
        text = prompt[0]["content"][-1]["text"]
        lines.append({"prompt": text, "images": names, "answer": str(i)})  # images placed before the text
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(folder / "rows.jsonl")


@pytest.fixture
def make_trainer(tmp_path, monkeypatch):
    monkeypatch.setitem(REWARD_FUNCTIONS, "shortness", shortness)
    data = write_rows(tmp_path)
    runs = iter(range(1000))

    def make(build, *overrides):
        float64_everywhere()
        model, processor = BUILDS[build](torch.float64)
        config = load_config(None, [
            f"model.name={build}", "model.dtype=float64", "reward.functions=[shortness]", f"data.path={data}",
            "data.eval_size=0", "train.prompts_per_step=3", "rollout.num_generations=2",
            "rollout.max_completion_length=6", "train.learning_rate=1e-3",
            f"train.output_dir={tmp_path / f'run{next(runs)}'}", *overrides,
        ])
        return Trainer(config, progress=False, model=model, tokenizer=processor)

    return make


def fixed_batch(trainer):
    examples = [next(trainer.sampler.stream) for _ in range(trainer.config.train.prompts_per_step)]
    assert sorted(len(e.images) for e in examples) == [0, 1, 3]
    batch = trainer.sampler.engine.generate([trainer.sampler.kind.encoder(e) for e in examples],
                                             trainer.config.rollout.num_generations, trainer.sampler.sampling,
                                             seeds=range(trainer.config.completions_per_step),
                                             images=[e.images for e in examples])
    return examples, cut_ragged(batch, trainer.tokenizer.eos_token_id)


def one_step(trainer, examples, batch):
    start = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    metrics = step_on(trainer, examples, batch)
    return start, {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}, metrics


@pytest.mark.parametrize("build", ["qwen2.5-vl", "idefics3"])
@pytest.mark.parametrize("knobs", [["algorithm.beta=0.04", "algorithm.num_iterations=2"],
                                   ["algorithm.loss_type=dapo", "model.gradient_checkpointing=true"]],
                         ids=["kl-two-passes", "dapo-checkpointed"])
def test_micro_batch_size_never_changes_a_vision_update(make_trainer, build, knobs):
    examples, batch = fixed_batch(make_trainer(build, *knobs))
    results = {m: one_step(make_trainer(build, *knobs, f"train.micro_batch_size={m}"), examples, batch)
               for m in (6, 3, 1)}
    start, whole, whole_metrics = results[6]
    assert whole_metrics["reward_std"] > 0 and update_difference(start, whole, start) > 0
    assert whole_metrics["images/per_prompt"] == pytest.approx(4 / 3)
    for m in (3, 1):
        _, params, metrics = results[m]
        assert update_difference(start, whole, params) < EXACT, f"micro_batch_size={m}"
        for key in ("loss", "grad_norm", *(("kl",) if "algorithm.beta=0.04" in knobs else ())):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-9, abs=1e-12), key


def test_the_vision_tower_trains_unless_frozen(make_trainer):
    examples, batch = fixed_batch(make_trainer("idefics3"))
    start, params, _ = one_step(make_trainer("idefics3"), examples, batch)
    moved = {k for k in start if not torch.equal(start[k], params[k])}
    assert any("vision_model" in k for k in moved) and any("text_model" in k for k in moved)
    start, params, _ = one_step(make_trainer("idefics3", "model.freeze_vision_tower=true"), examples, batch)
    moved = {k for k in start if not torch.equal(start[k], params[k])}
    assert not any("vision_model" in k for k in moved)
    assert any("connector" in k for k in moved) and any("text_model" in k for k in moved)


def test_a_frozen_language_model_leaves_the_vision_side_alone_to_learn(make_trainer, tmp_path):
    """model.freeze_language_model: only the vision encoder and the connector change (LLaVA's first stage)."""
    trainer = make_trainer("idefics3", "model.freeze_language_model=true")
    examples, batch = fixed_batch(trainer)
    start, params, _ = one_step(trainer, examples, batch)
    moved = {k for k in start if not torch.equal(start[k], params[k])}
    assert moved and all(".vision_model." in k or ".connector." in k for k in moved)
    assert any(".connector." in k for k in moved)
    with pytest.raises(StartupError, match="model.freeze_language_model=true, but tiny-random is a text model"):
        Trainer(load_config(None, ["model.name=tiny-random", "model.freeze_language_model=true",
                                   f"train.output_dir={tmp_path / 'text'}"]), progress=False)
    with pytest.raises(ConfigError, match="model.freeze_language_model with model.lora_rank=4"):
        load_config(None, ["model.freeze_language_model=true", "model.lora_rank=4"])


def test_lora_adapts_the_language_model_of_a_vision_model(make_trainer):
    trainer = make_trainer("qwen2.5-vl", "model.lora_rank=4", "algorithm.beta=0.04")
    adapted = {name.split(".lora_A")[0] for name, _ in trainer.policy.named_parameters() if ".lora_A" in name}
    assert adapted and all(".language_model." in name for name in adapted)
    assert any(name.endswith("mlp.down_proj") for name in adapted) and any("self_attn.q_proj" in n for n in adapted)
    examples, batch = fixed_batch(trainer)
    start, params, metrics = one_step(trainer, examples, batch)
    moved = {k for k in start if not torch.equal(start[k], params[k])}
    assert moved and all("lora_" in k for k in moved) and metrics["kl"] == 0.0  # the reference: adapters off


# ---------------------------------------------------------------------- bad input


def test_a_missing_image_file_names_the_row_and_the_file(tmp_path, make_trainer):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n" +
                    json.dumps({"prompt": "what?", "image": "nowhere.png", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:line 2: image file .*nowhere\.png does not exist"):
        make_trainer("idefics3", f"data.path={data}")
    (tmp_path / "broken.png").write_text("not a png")
    data.write_text(json.dumps({"prompt": "what?", "image": "broken.png", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:line 1: cannot read image .*broken\.png"):
        make_trainer("idefics3", f"data.path={data}")


def test_a_text_model_is_refused_data_with_images(tmp_path):
    data = write_rows(tmp_path)
    config = load_config(None, ["model.name=tiny-random", f"data.path={data}", "data.eval_size=0",
                                "reward.functions=[length]", f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r":line 1: a prompt has 1 image\(s\) .* and the model is a text model"):
        Trainer(config, progress=False)  # the row's file and line named, with data.max_prompt_length unset
    assert not (tmp_path / "run").exists()  # a refused start leaves no folder


def test_a_text_model_is_refused_message_parts(tmp_path):
    data = tmp_path / "parts.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) + "\n")
    config = load_config(None, ["model.name=tiny-random", f"data.path={data}", "data.eval_size=0",
                                "reward.functions=[length]", f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="messages whose content is a list of parts, and the model is a text model"):
        Trainer(config, progress=False)


def test_sharded_weights_with_a_vision_model_are_refused():
    from grpokit.config.checks import Facts, ModelFacts, check
    from grpokit.runtime.launch import Launch

    with pytest.raises(ConfigError, match="sharded weights .* with a vision-language model are not supported yet"):
        check(load_config(None, []), Facts(Launch(2, sharding="FSDP", fsdp_version="2"), ModelFacts(vision=True)))


def test_model_chat_template_renders_a_vision_model_s_prompts(tmp_path, make_trainer):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{% for p in m['content'] %}"
                        "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
                        "{% endfor %}ANSWER:")
    trainer = make_trainer("idefics3", f"model.chat_template={template}")
    assert trainer.vision.render(messages(0, "hi")) == "[user]hiANSWER:"


def test_more_image_parts_than_images_is_an_error_naming_the_row(tmp_path, make_trainer):
    image((1, 2, 3)).save(tmp_path / "a.png")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    data = tmp_path / "parts.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "image": "a.png", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"parts\.jsonl:line 1: the prompt has 2 image part\(s\).* but the row has 1"):
        make_trainer("idefics3", f"data.path={data}")


@pytest.mark.parametrize("build, length", [("idefics3", "512"), ("qwen2.5-vl", "512"), ("idefics3", "null")])
def test_an_image_token_written_in_a_row_s_text_is_an_error_naming_the_row(tmp_path, make_trainer, build, length):
    """The processor reads its image token in the text as a place for an image the row does not have;
    with data.max_prompt_length or without."""
    token = {"idefics3": "<image>", "qwen2.5-vl": "<|image_pad|>"}[build]
    data = tmp_path / "literal.jsonl"
    data.write_text("".join(json.dumps({"prompt": text, "answer": "1"}) + "\n" for text in ("fine", f"a {token} b")))
    with pytest.raises(ConfigError, match=r"literal\.jsonl:line 2: the model's processor cannot encode the prompt.*"
                                          r"remove it from the text, or give the row its image"):
        make_trainer(build, f"data.path={data}", "train.prompts_per_step=1", f"data.max_prompt_length={length}")


def test_tools_with_a_vision_model_are_refused_before_a_tools_template_is_asked_for(make_trainer):
    """Qwen2.5-VL's template here cannot express tools: the unsupported combination is what is said."""
    with pytest.raises(ConfigError, match="multi-turn rollouts .* with a vision-language model are not supported") as e:
        make_trainer("qwen2.5-vl", "rollout.tools=[calculator]")
    assert "template" not in str(e.value)


def test_a_prompt_whose_images_do_not_fit_is_an_error_or_left_out(tmp_path, make_trainer):
    data = write_rows(tmp_path)  # the 3-image prompt is the longest
    with pytest.raises(DataError, match=r"rows\.jsonl:line 3: the prompt is \d+ tokens with its 3 image\(s\), over "
                                        r"data\.max_prompt_length=25.*never cut"):
        make_trainer("idefics3", f"data.path={data}", "data.max_prompt_length=25", "data.long_prompts=truncate")
    trainer = make_trainer("idefics3", f"data.path={data}", "data.max_prompt_length=25", "data.long_prompts=drop",
                           "train.prompts_per_step=1")
    assert len(trainer.task.train_examples) == 2
    assert any("dropped 1 of 3 prompts" in note for note in trainer.task.notes)
    imaged = write_rows(tmp_path, [ROWS[2], ROWS[0]])
    with pytest.raises(DataError, match=r"every prompt is longer than data\.max_prompt_length=2: the shortest is "
                                        r"(\d+) tokens, ([1-9]\d*) of them for its 1 image\(s\) \(.*rows\.jsonl:line 2\)"):
        make_trainer("idefics3", f"data.path={imaged}", "data.max_prompt_length=2", "data.long_prompts=drop")


def test_a_vision_model_needs_its_processor(tmp_path, monkeypatch):
    from grpokit.models.loading import load_processor

    monkeypatch.setitem(REWARD_FUNCTIONS, "shortness", shortness)
    model, processor = BUILDS["idefics3"](torch.float64)
    config = load_config(None, ["model.name=x", "reward.functions=[shortness]", f"data.path={write_rows(tmp_path)}",
                                f"train.output_dir={tmp_path / 'r'}", "data.eval_size=0"])
    with pytest.raises(ConfigError, match="vision-language model but came with a tokenizer"):
        Trainer(config, progress=False, model=model, tokenizer=load_processor("tiny-random-vlm").tokenizer)


def test_placeholder_ids_are_the_prompt_as_the_tokenizer_alone_encodes_it(built):
    """What vLLM takes beside the images (verl and TRL hand it the same): each image's tokens folded
    back into the chat template's placeholder; the processor expands them into the prompt again."""
    _, _, processor, vision = built
    for prompt, images in [*ROWS, (messages(2, "\n\ntwo\n"), (image((1, 2, 3), (60, 90)), image((4, 5, 6))))]:
        ids = vision.encode(prompt, images)
        folded = vision.placeholder_ids(ids, images)
        assert folded == processor.tokenizer(vision.render(prompt), add_special_tokens=False)["input_ids"]
        assert vision.image_tokens(folded) < vision.image_tokens(ids) or not images
        assert vision.encode(processor.tokenizer.decode(folded), images) == ids
    with pytest.raises(ValueError, match="image 0 of a prompt: its tokens are not in the prompt"):
        vision.placeholder_ids(vision.encode(*ROWS[1]), (image((1, 1, 1)),))


@pytest.mark.process
@pytest.mark.parametrize("build", ["qwen2.5-vl", "idefics3"])
def test_two_processes_compute_the_one_process_vision_update(tmp_path, build):
    """Each process owns 3 of the 6 completions (a group split between them); its passes get its
    own rows' images."""
    overrides = [f"vision:{build}", f"data.path={write_rows(tmp_path)}", "train.prompts_per_step=3",
                 "rollout.num_generations=2", "algorithm.beta=0.04", "algorithm.num_iterations=2",
                 "train.micro_batch_size=1", "ragged"]
    one, two = run_worker(tmp_path, "learn", overrides)
    assert update_difference(one["start"], one["params"], one["start"]) > 0
    assert update_difference(one["start"], one["params"], two[0]["params"]) < EXACT
    for name in one["params"]:
        assert torch.equal(two[0]["params"][name], two[1]["params"][name]), name
    for key, value in one["metrics"].items():
        if not measured(key):
            assert two[0]["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


# ---------------------------------------------------------------------- the picture task, end to end


def test_the_shapes_task_draws_what_it_asks_about():
    from grpokit.tasks.shapes import COLOURS, ShapesTask

    task = ShapesTask(seed=3, eval_size=6)
    assert [e.columns["question"] for e in task.eval_examples] == ["colour", "shape", "count"] * 2
    assert task.train_example(5).images[0].tobytes() == ShapesTask(seed=3).train_example(5).images[0].tobytes()
    for i in range(40):
        e = task.train_example(i)
        assert e.images[0].size == (64, 64) and e.columns["answer"] in e.columns["options"]
        if e.columns["question"] == "colour":  # the shape's pixels are the answer's colour
            assert COLOURS[e.columns["answer"]] in {c for _, c in e.images[0].getcolors()}


def test_named_answer_takes_the_answer_named_alone():
    from grpokit.rewards.word_answer import named_answer

    replies = ["Red.", "The shape is red", "red or blue", "It is blue", "reddish", "RED"]
    assert named_answer([[{"role": "assistant", "content": r}] for r in replies], ["red"] * 6,
                        [["red", "green", "blue", "yellow"]] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.process
def test_the_vision_example_config_trains_evaluates_and_reports(tmp_path):
    """examples/vision.yaml for 2 steps on tiny-random-vlm through the CLI: completions.jsonl names each prompt's image
    (a PNG in the run folder), the report shows it, and `grpokit eval` scores the saved model."""
    from support.processes import TESTS, run_grpokit

    example = TESTS.parent / "examples" / "vision.yaml"
    run = tmp_path / "run"
    result = run_grpokit("train", "--no-progress", "--config", str(example), "model.name=tiny-random-vlm",
                         "train.max_steps=2", "train.eval_every=2", "data.eval_size=4", "monitor.log_completions=1",
                         f"train.output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 2 and all(r["images/per_prompt"] == 1.0 for r in trained)
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert samples and all(len(s["images"]) == 1 and (run / s["images"][0]).is_file() for s in samples)
    assert (run / "final" / "processor_config.json").is_file()
    report = run_grpokit("report", str(run))
    assert report.returncode == 0, report.stderr[-2000:]
    assert 'class="thumb" src="data:image/png;base64,' in (run / "report.html").read_text()
    scored = run_grpokit("eval", "--model", str(run / "final"), "--config", str(run / "config.yaml"))
    assert scored.returncode == 0 and "reward:" in scored.stdout, scored.stderr[-2000:]


def vision_run(tmp_path, out, *extra) -> int:
    """examples/vision.yaml for 2 steps on tiny-random-vlm, in this process."""
    from support.processes import TESTS

    from grpokit.cli import main

    example = TESTS.parent / "examples" / "vision.yaml"
    return main(["train", "--no-progress", "--config", str(example), "model.name=tiny-random-vlm", "train.max_steps=2",
                 "train.eval_every=2", "data.eval_size=4", "train.prompts_per_step=2", "rollout.num_generations=4",
                 f"train.output_dir={tmp_path / out}", *extra])


@pytest.mark.process
def test_a_vision_server_run_equals_the_in_process_run(server, tmp_path):
    """The images travel in the request (PNG, lossless): the server samples what the trainer would."""
    s = server("--model", "tiny-random-vlm")
    # Every weight trains: a server's weights all require gradients, and PyTorch picks other CPU
    # kernels for weights that do not (with the language model frozen the entropy metric differs in
    # its 8th digit; docs/vision.md).
    trained = "model.freeze_language_model=false"
    assert vision_run(tmp_path, "local", trained) == 0
    assert vision_run(tmp_path, "served", trained, "rollout.engine=server", f"rollout.server_url={s.url}") == 0
    assert_same_run(tmp_path / "served", tmp_path / "local")
    assert get_health(s.url)["weights_version"] == 3  # the step-0 evaluation's push and one per update


@pytest.mark.process
def test_a_killed_vision_run_resumes_as_the_uninterrupted_run(tmp_path):
    """SIGKILL in the middle of a run (a checkpoint every step), then `grpokit train` again: the same
    metrics and weights as a run never stopped."""
    import signal
    from pathlib import Path

    from support.processes import train_in_background, wait_for_rows

    example = Path(__file__).parents[2] / "examples" / "vision.yaml"
    args = ["--no-progress", "--config", str(example), "model.name=tiny-random-vlm", "train.max_steps=5",
            "train.eval_every=0", "train.save_every=1", "data.eval_size=0", "train.prompts_per_step=2",
            "rollout.num_generations=4"]
    assert vision_run(tmp_path, "whole", "train.max_steps=5", "train.eval_every=0", "train.save_every=1",
                      "data.eval_size=0") == 0
    run = tmp_path / "killed"
    trainer = train_in_background(*args, f"train.output_dir={run}")
    wait_for_rows(trainer, run, 3)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert not (run / "final").exists()
    again = train_in_background(*args, f"train.output_dir={run}")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0 and "resuming from" in out + err, err[-2000:]
    assert_same_run(run, tmp_path / "whole", steps=5)


def test_the_api_trains_a_vision_model_from_objects(tmp_path):
    """TRL's shape: a model and its processor (processing_class), a list of rows with PIL images;
    the rows' images are written beside the run's copy of the data, named by their content."""
    import grpokit

    model, processor = BUILDS["qwen2.5-vl"](torch.float32)
    rows = [{"prompt": messages(1, "Colour?"), "image": image((255, 0, 0)), "answer": "red"},
            {"prompt": "Say hi", "answer": "hi"},
            {"prompt": "What are these?", "images": [image((0, 0, 255)), image((0, 255, 0))], "answer": "x"}] * 2
    result = grpokit.train(model=model, processing_class=processor, dataset=rows, progress=False,
                           reward_functions=lambda completions, **columns: [float(len(str(c))) for c in completions],
                           **{"train.max_steps": 2, "train.prompts_per_step": 2, "rollout.num_generations": 2,
                              "data.eval_size": 0, "train.output_dir": str(tmp_path / "run")})
    written = [json.loads(line) for line in (tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()]
    assert written[0]["image"].startswith("images/") and len(written[2]["images"]) == 2
    assert len(list((tmp_path / "run" / "data" / "images").glob("*.png"))) == 3  # one file per distinct image
    assert type(result.model) is type(model)  # the trained model, loaded back from final/


@pytest.mark.process
def test_generating_ahead_on_two_servers_killed_and_resumed_is_the_uninterrupted_run(server, tmp_path):
    """Steps generated ahead (rollout.max_staleness=1) by two servers, each taking a share of the
    prompt groups with their images; a checkpoint holds the step queued ahead (its completions, the
    images drawn again with its prompts), and a run killed after it resumes as the run never stopped."""
    from support.processes import TESTS, kill_once_saved, run_grpokit

    urls = [server("--model", "tiny-random-vlm").url for _ in range(2)]
    example = TESTS.parent / "examples" / "vision.yaml"
    run = ["--no-progress", "--config", str(example), "model.name=tiny-random-vlm", "train.max_steps=4",
           "train.save_every=1", "train.eval_every=0", "data.eval_size=0", "train.prompts_per_step=2",
           "rollout.num_generations=4", "rollout.engine=server",
           f"rollout.server_url=[{urls[0]}, {urls[1]}]", "rollout.max_staleness=1"]
    killed = tmp_path / "killed"
    command = ["train", *run, f"train.output_dir={killed}"]
    kill_once_saved(command, killed, 2)
    assert torch.load(killed / "checkpoints" / "step-2" / "rollouts_ahead.pt", weights_only=True)[0]["images"]
    resumed = run_grpokit(*command, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = run_grpokit("train", *run, f"train.output_dir={tmp_path / 'whole'}", timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_same_run(killed, tmp_path / "whole", steps=4)


def test_dynamic_sampling_with_images(tmp_path):
    """Rounds of sampling and scoring on prompts with images, until the step holds groups whose
    rewards differ."""
    assert vision_run(tmp_path, "run", "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3",
                      "reward.functions=[length]", "data.eval_size=0", "train.eval_every=0") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["images/per_prompt"] for r in rows] == [1.0, 1.0]
    assert all(r["dynamic_sampling/groups_kept"] == 2 for r in rows)


def test_a_datasets_image_feature_is_written_with_the_run(tmp_path):
    """A `datasets.Dataset` with an Image column, given to grpokit.train: its images (bytes in the
    dataset's rows) are written beside the run's data, pixel for pixel, and the run trains on them."""
    import datasets

    import grpokit
    from grpokit.tasks.dataset import row_images

    pictures = [image((255, 0, 0)), image((0, 0, 255))]
    dataset = datasets.Dataset.from_dict({"prompt": ["Colour?", "And this?"], "image": pictures, "answer": ["r", "b"]})
    dataset = dataset.cast_column("image", datasets.Image())
    grpokit.train(model="tiny-random-vlm", dataset=dataset, progress=False,
                  reward_functions=lambda completions, **columns: [float(len(str(c))) for c in completions],
                  **{"train.max_steps": 1, "train.prompts_per_step": 2, "rollout.num_generations": 2,
                     "data.eval_size": 0, "train.output_dir": str(tmp_path / "run")})
    data = tmp_path / "run" / "data"
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert [row_images(r, "row", data)[0].tobytes() for r in rows] == [p.tobytes() for p in pictures]
    trained = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert trained[0]["images/per_prompt"] == 1.0


def test_the_assembled_vision_model_speaks_as_the_bundled_model():
    """smollm2-135m-vision: the bundled SmolLM2's weights as its language model (its text logits
    the same, to the rounding of an output layer 4 rows longer), the image tokens added to its
    vocabulary, a vision encoder beside it."""
    from grpokit.models.bundled import BUNDLED, BUNDLED_VLM
    from grpokit.models.loading import load_model, load_processor

    vlm, text = load_model(BUNDLED_VLM).eval(), load_model(BUNDLED).eval()
    processor = load_processor(BUNDLED_VLM)
    ids = processor.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = text(input_ids=ids).logits
        got = vlm(input_ids=ids).logits
    torch.testing.assert_close(got[..., :expected.shape[-1]], expected, rtol=0, atol=1e-4)
    assert len(processor.tokenizer) == got.shape[-1] > expected.shape[-1]
    vision = Vision(processor)
    prompt = vision.encode(messages(1, "What colour is it?"), (image((255, 0, 0)),))
    assert vision.image_tokens(prompt) == 4
