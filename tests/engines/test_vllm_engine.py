"""The vLLM engine's CPU-testable parts, with vLLM's classes replaced at the boundary only (vLLM needs
a GPU): request building, result conversion, weight names and loading, sleep mode; the trainer's
importance-sampling correction for an engine whose log-probs are not its own."""

import copy
import json
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from grpokit.cli import main
from grpokit.engines.batch import SamplingParams
from grpokit.engines.weights import checksum, named_weights


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # vLLM's: 1 for the most likely token


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list | None
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list
    prompt_token_ids: list | None = None


@dataclass
class Worker:
    loaded: list = field(default_factory=list)

    @property
    def model_runner(self):
        return types.SimpleNamespace(model=types.SimpleNamespace(load_weights=lambda weights: self.loaded.extend(
            (name, tensor.clone()) for name, tensor in weights)))


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeLLM:
    """Records what grpokit asks of vLLM's `LLM`; generates token 5 + i for completion i."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.worker, self.adapters = kwargs, [], Worker(), {}

    def generate(self, prompts, sampling, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", prompts, sampling))
        if lora_request is not None:  # vLLM reads the adapter's folder when a request first uses its id
            from safetensors.torch import load_file

            self.adapters[lora_request.lora_int_id] = load_file(f"{lora_request.lora_path}/adapter_model.safetensors")
            self.calls.append(("lora", lora_request.lora_int_id))
        outputs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling)):
            samples = []
            for j in range(params.n):
                ids = [5 + i, 6 + j][: params.max_tokens]
                samples.append(CompletionOutput(ids, [{t: Logprob(-0.5 * (k + 1))} for k, t in enumerate(ids)],
                                                "length" if len(ids) == params.max_tokens else "stop"))
            outputs.append(RequestOutput(samples))
        return outputs

    def collective_rpc(self, method, args=()):
        self.calls.append(("collective_rpc",))
        return [method(self.worker, *args)]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams, vllm.LLM = FakeSamplingParams, FakeLLM
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    # What a run imports that reads torch.cuda.is_available() at import (transformers' TrainerState
    # imports peft, which imports bitsandbytes' CUDA ops where a GPU is said to be): imported first.
    import transformers.trainer_callback  # noqa: F401
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return vllm


def test_requests_one_per_seeded_completion_or_n_per_greedy_prompt(fake_vllm):
    from grpokit.engines.vllm_engine import build_requests, prompt_inputs

    params = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=0, min_p=0.05)
    inputs = prompt_inputs([[1, 2], [3]], None, None)
    prompts, sampling = build_requests(fake_vllm, inputs, [2, 1], params, [7, 8, 9], [2])
    assert prompts == [{"prompt_token_ids": [1, 2]}] * 2 + [{"prompt_token_ids": [3]}]
    assert [(s.n, s.seed) for s in sampling] == [(1, 7), (1, 8), (1, 9)]
    s = sampling[0]
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_tokens, s.logprobs, s.stop_token_ids, s.detokenize) == \
        (0.7, 0.9, -1, 0.05, 4, 0, [2], False)
    prompts, sampling = build_requests(fake_vllm, inputs, [2, 1], SamplingParams(4, 0.0, top_k=5), None, [2])
    assert len(prompts) == 2 and [(s.n, s.seed, s.top_k, s.temperature, s.min_p) for s in sampling] == \
        [(2, None, 5, 0.0, 0.0), (1, None, 5, 0.0, 0.0)]


def test_outputs_become_a_rollout_batch():
    from grpokit.engines.batch import from_completions
    from grpokit.engines.vllm_engine import to_completions

    outputs = [RequestOutput([CompletionOutput([11, 12, 2], [{11: Logprob(-0.1)}, {12: Logprob(-0.2)}, {2: Logprob(-0.3)}], "stop")]),
               RequestOutput([CompletionOutput([13], [{13: Logprob(-1.5)}], "length"),
                              CompletionOutput([14, 15], [{14: Logprob(-2.0)}, {15: Logprob(-2.5)}], "abort")])]
    completions = to_completions(outputs)
    assert [c["finish_reason"] for c in completions] == ["stop", "length", "stop"]
    batch = from_completions([[1, 2, 3], [4]], [1, 2], completions, pad_id=0)
    assert batch.prompt_index.tolist() == [0, 1, 1]
    assert batch.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 4]]  # left-padded
    assert batch.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert batch.completion_ids.tolist() == [[11, 12, 2], [13, 0, 0], [14, 15, 0]]  # right-padded
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(batch.sampling_logps, torch.tensor([[-0.1, -0.2, -0.3], [-1.5, 0, 0], [-2.0, -2.5, 0]]))
    assert batch.entropies is None and batch.finish_reasons == ["stop", "length", "stop"]
    with pytest.raises(RuntimeError, match="no log-prob"):
        to_completions([RequestOutput([CompletionOutput([11], None, "stop")])])


def test_the_alternatives_an_agent_asks_for_are_vllm_s_entries_of_the_first_ranks(fake_vllm):
    """With logprobs=k, vLLM lists each step's k most likely tokens and the sampled one (at its own
    rank); the alternatives are the first k by rank, without a token a filter dropped (-inf)."""
    from grpokit.engines.batch import alternatives, from_completions
    from grpokit.engines.vllm_engine import sampling_params, to_completions

    assert sampling_params(fake_vllm, SamplingParams(4, top_logprobs=3), 1, 0, [2]).logprobs == 3
    steps = [{11: Logprob(-2.0, 3), 7: Logprob(-0.5, 1), 8: Logprob(-1.0, 2)},  # 11 sampled, 3rd most likely
             {12: Logprob(-0.125, 1), 9: Logprob(float("-inf"), 2)}]  # (-0.125: exact in float32)
    completions = to_completions([RequestOutput([CompletionOutput([11, 12], steps, "length")])], top=2)
    assert completions[0]["top_logprobs"] == [[[7, -0.5], [8, -1.0]], [[12, -0.125]]]
    batch = from_completions([[1]], [1], completions, pad_id=0)
    assert batch.top_ids.tolist() == [[[7, 8], [12, 0]]]
    assert batch.top_logps.tolist() == [[[-0.5, -1.0], [-0.125, float("-inf")]]]
    assert alternatives(batch.top_ids[0].tolist(), batch.top_logps[0].tolist()) == completions[0]["top_logprobs"]
    assert "top_logprobs" not in to_completions([RequestOutput([CompletionOutput([11, 12], steps, "length")])])[0]


def expanded(processor, prompt: dict) -> list[int]:
    """A vLLM prompt as vLLM's processor expands it: the placeholders of its images into their tokens."""
    images = prompt.get("multi_modal_data", {}).get("image")
    text = processor.tokenizer.decode(prompt["prompt_token_ids"])
    return list(processor(text=[text], images=[images] if images else None, add_special_tokens=False)["input_ids"][0])


class VisionLLM(FakeLLM):
    """Expands each prompt's images as vLLM would (with the model's processor; `cut` tokens fewer
    when told to differ); request 0 samples the image token."""

    processor, image_token_id, cut = None, None, 0

    def generate(self, prompts, sampling, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", prompts, sampling))
        if lora_request is not None:  # vLLM reads the adapter's folder when a request first uses its id
            from safetensors.torch import load_file

            self.adapters[lora_request.lora_int_id] = load_file(f"{lora_request.lora_path}/adapter_model.safetensors")
            self.calls.append(("lora", lora_request.lora_int_id))
        outputs = []
        for i, prompt in enumerate(prompts):
            ids = [5 + i, self.image_token_id if i == 0 else 6]
            ran = expanded(self.processor, prompt)
            outputs.append(RequestOutput([CompletionOutput(ids, [{t: Logprob(-0.5)} for t in ids], "stop")],
                                         ran[:len(ran) - self.cut]))
        return outputs


def test_a_vision_model_s_prompts_reach_vllm_as_placeholders_with_their_images(fake_vllm, monkeypatch):
    """vLLM takes the prompt as the tokenizer alone encodes it and the images as multi_modal_data, and
    expands them itself: what it ran must be the trainer's prompt. A sampled image token ends its
    completion (finish reason image_token), as with every engine."""
    from support.vlms import idefics3, image, messages

    from grpokit.engines.vllm_engine import VLLMEngine
    from grpokit.models.vision import IMAGE_TOKEN, Vision

    _, processor = idefics3()
    vision = Vision(processor)
    monkeypatch.setattr(fake_vllm, "LLM", VisionLLM)
    monkeypatch.setattr(VisionLLM, "processor", processor)
    monkeypatch.setattr(VisionLLM, "image_token_id", vision.image_token_id)
    eos = processor.tokenizer.eos_token_id
    engine = VLLMEngine("/models/x", "float32", processor.tokenizer.pad_token_id, [eos], vision=vision)
    rows = [(messages(2, "Two?"), (image((255, 0, 0)), image((0, 0, 255), (90, 60)))), (messages(0, "None."), ())]
    prompts = [vision.encode(p, images) for p, images in rows]
    batch = engine.generate(prompts, 2, SamplingParams(2), [1, 2, 3, 4], images=[images for _, images in rows])

    requests, sampling = engine.llm.calls[-1][1:]
    assert requests[0] is requests[1] and requests[2] is requests[3]  # one request per seeded completion
    assert requests[0]["prompt_token_ids"] == processor.tokenizer(vision.render(rows[0][0]),
                                                                  add_special_tokens=False)["input_ids"]
    assert requests[0]["multi_modal_data"] == {"image": list(rows[0][1])}
    assert requests[2] == {"prompt_token_ids": prompts[1]}  # no image: the ids as they are
    assert all(s.stop_token_ids == [eos, vision.image_token_id] for s in sampling)
    assert batch.finish_reasons == [IMAGE_TOKEN, "stop", "stop", "stop"]
    assert batch.images == [rows[0][1], rows[0][1], (), ()]
    width = max(map(len, prompts))
    assert batch.prompt_ids[0, width - len(prompts[0]):].tolist() == prompts[0]  # the trainer's ids: expanded

    monkeypatch.setattr(VisionLLM, "cut", 1)
    with pytest.raises(RuntimeError, match="vLLM expanded the images of request 0 into other tokens than the model's "
                                           "processor did"):
        engine.generate(prompts, 1, SamplingParams(2), [1, 2], images=[images for _, images in rows])
    with pytest.raises(ValueError, match="takes each prompt's images"):
        engine.generate(prompts, 1, SamplingParams(2), [1, 2])


def test_a_vision_run_samples_with_vllm(fake_vllm, monkeypatch, tmp_path):
    """The trainer hands vLLM each prompt's images (the shapes task: one picture each) and trains on
    what it sampled, with its images in every pass."""
    from grpokit.config.loading import load_config
    from grpokit.models.loading import load_model, load_processor
    from grpokit.models.vision import Vision
    from grpokit.runtime import distributed
    from grpokit.training.trainer import Trainer

    processor = load_processor("tiny-random-vlm")
    monkeypatch.setattr(fake_vllm, "LLM", VisionLLM)
    monkeypatch.setattr(VisionLLM, "processor", processor)
    monkeypatch.setattr(VisionLLM, "image_token_id", Vision(processor).image_token_id)
    monkeypatch.setattr(distributed, "init", lambda: torch.device("cpu"))  # vLLM "sees" a GPU; the trainer runs here
    run = tmp_path / "run"
    config = load_config(None, ["model.name=/models/vlm", "data.task=shapes", "reward.functions=[named_answer]",
                                "rollout.engine=vllm", "train.max_steps=1", "train.prompts_per_step=2",
                                "rollout.num_generations=2", "rollout.max_completion_length=2", "data.eval_size=0",
                                f"train.output_dir={run}"])
    trainer = Trainer(config, progress=False, model=load_model("tiny-random-vlm"), tokenizer=processor)
    trainer.train()
    requests = [r for call in trainer.sampler.engine.llm.calls if call[0] == "generate" for r in call[1]]
    assert len(requests) == 4 and all(len(r["multi_modal_data"]["image"]) == 1 for r in requests)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["images/per_prompt"] == 1 and row["completions/image_token_ratio"] == 0.25  # request 0's
    assert "sampling/importance_sampling_ratio/mean" in row  # vLLM's log-probs are not the trainer's


class RaggedLLM(FakeLLM):
    """Each seeded completion samples token 3 until a length its seed sets (1 to 5 tokens), then stops."""

    def generate(self, prompts, sampling, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", prompts, sampling))
        outputs = []
        for params in sampling:
            wanted = params.seed % 5 + 1
            ids = [3] * min(wanted, params.max_tokens)
            outputs.append(RequestOutput([CompletionOutput(ids, [{3: Logprob(-0.5)}] * len(ids),
                                                           "stop" if wanted <= params.max_tokens else "length")]))
        return outputs


def test_partial_rollouts_continue_through_vllm_under_each_step_s_weights(fake_vllm, monkeypatch, tmp_path):
    """rollout.partial with vLLM in the process: a round is one generate call; an unfinished
    completion goes on in the next step as a request whose prompt is its prompt and its tokens so
    far, after the new weights are loaded; the lagged tokens are corrected."""
    from grpokit.config.loading import load_config
    from grpokit.models.loading import load_model, load_tokenizer
    from grpokit.runtime import distributed
    from grpokit.training.trainer import Trainer

    monkeypatch.setattr(fake_vllm, "LLM", RaggedLLM)
    monkeypatch.setattr(distributed, "init", lambda: torch.device("cpu"))  # vLLM "sees" a GPU; the trainer runs here
    run = tmp_path / "run"
    config = load_config(None, ["model.name=/models/x", "reward.functions=[length]", "rollout.engine=vllm",
                                "train.max_steps=4", "train.prompts_per_step=2", "rollout.num_generations=3",
                                "rollout.max_completion_length=6", "rollout.partial=true", "rollout.partial_tokens=2",
                                "data.eval_size=0", f"train.output_dir={run}"])
    trainer = Trainer(config, progress=False, model=load_model("tiny-random"), tokenizer=load_tokenizer("tiny-random"))
    trainer.train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["partial/carried_groups"] for r in rows) and max(r["partial/lag_max"] for r in rows) >= 1
    assert all("sampling/importance_sampling_ratio/mean" in r for r in rows)
    calls, fresh, continued = trainer.sampler.engine.llm.calls, [], 0
    for call in calls:
        if call[0] != "generate":
            continue
        for request, params in zip(call[1], call[2]):
            ids = request["prompt_token_ids"]
            starts = [f for f in fresh if ids[:len(f)] == f and set(ids[len(f):]) <= {3} and len(ids) - len(f) < 6]
            if starts and len(ids) > len(starts[0]):
                continued += 1
                assert params.max_tokens <= 6 - (len(ids) - len(starts[0]))  # no more than its room
            else:
                fresh.append(ids)
    assert continued
    # Every step's weights reach vLLM before its first round (the first step's: those loaded).
    loads = [i for i, call in enumerate(calls) if call[0] == "collective_rpc"]
    assert len(loads) == 4, [c[0] for c in calls]


def test_vllm_loads_the_assembled_vision_model_and_not_the_in_memory_ones(monkeypatch):
    from grpokit.engines.vllm_engine import model_path
    from grpokit.models import bundled
    from grpokit.runtime.errors import StartupError

    monkeypatch.setattr(bundled, "bundled_vlm_path", lambda: "/cache/smollm2-135m-vision-v1")
    assert model_path("smollm2-135m-vision") == "/cache/smollm2-135m-vision-v1"
    for name in ("tiny-random", "tiny-random-vlm"):
        with pytest.raises(StartupError, match=f"{name} exists only in memory"):
            model_path(name)


def test_weight_names_lose_their_wrappers():
    from grpokit.engines.vllm_engine import vllm_name

    assert vllm_name("module._orig_mod.model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert vllm_name("base_model.model.model.layers.3.mlp.up_proj.base_layer.weight") == "model.layers.3.mlp.up_proj.weight"
    assert vllm_name("lm_head.weight") == "lm_head.weight"


def test_the_engine_loads_the_policy_before_generating_and_sleeps_through_updates(fake_vllm, tiny):
    from grpokit.engines.vllm_engine import VLLMEngine

    policy, tokenizer = tiny
    engine = VLLMEngine("/models/x", "float32", tokenizer.pad_token_id, [2], policy=policy, sleep=True,
                        gpu_memory_utilization=0.3)
    llm = engine.llm
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["gpu_memory_utilization"] == 0.3 and llm.kwargs["model"] == "/models/x"
    assert engine.exact_logprobs is False

    batch = engine.generate([[1, 2, 3]], 2, SamplingParams(2), [10, 11])
    # A resumed policy differs from the model folder's weights: loaded before the first generation.
    assert [c[0] for c in llm.calls] == ["collective_rpc", "reset_prefix_cache", "generate"]
    assert [n for n, _ in llm.worker.loaded] == [n for n, _ in named_weights(policy)]
    assert engine.weights_checksum() == checksum(named_weights(policy))
    assert batch.completion_ids.tolist() == [[5, 6], [6, 6]] and batch.finish_reasons == ["length", "length"]

    engine.generate([[1]], 1, SamplingParams(2), [3])  # nothing changed: nothing loaded
    assert [c[0] for c in llm.calls][-1] == "generate" and [c[0] for c in llm.calls].count("collective_rpc") == 1
    llm.calls.clear()
    engine.sleep()  # the trainer's update begins: weights and KV cache go
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    engine.weights_updated()
    engine.generate([[1]], 1, SamplingParams(2), [3])
    assert [c[:1] if c[0] == "generate" else c for c in llm.calls] == [
        ("sleep", 2), ("wake_up", ("weights",)), ("collective_rpc",), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)),
        ("generate",)]
    assert engine.weights_checksum() == checksum(named_weights(policy))
    with torch.no_grad():
        next(policy.parameters()).sub_(1.0)


def test_a_lora_policy_reaches_vllm_through_its_lora_loading_call(fake_vllm, tiny):
    """vLLM is built for LoRA; each generation after an update names the policy's adapters, written
    as a peft folder under a new id; the base weights move at the first load and after a sleep that
    dropped them, never merged."""
    pytest.importorskip("peft")
    from grpokit.config.loading import load_config
    from grpokit.engines.vllm_engine import VLLMEngine
    from grpokit.engines.weights import adapter_tensors, base_weights
    from grpokit.models.loading import apply_lora

    base, tokenizer = copy.deepcopy(tiny[0]), tiny[1]  # (peft puts its layers into the model it is given)
    policy = apply_lora(base, load_config(None, ["model.lora_rank=4"]).model, "tiny-random")
    engine = VLLMEngine("/models/x", "float32", tokenizer.pad_token_id, [2], policy=policy, sleep=True)
    llm = engine.llm
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_loras"], llm.kwargs["max_lora_rank"]) == (True, 1, 8)

    def sent(version):  # the adapters vLLM read for that id, under the policy's names
        return {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                for k, v in llm.adapters[version].items()}

    engine.generate([[1, 2, 3]], 2, SamplingParams(2), [10, 11])
    # The base (model_path's may differ from the trainer's) once, unmerged; then the adapters.
    assert [c[0] for c in llm.calls] == ["collective_rpc", "reset_prefix_cache", "generate", "lora"]
    assert [n for n, _ in llm.worker.loaded] == [n for n, _ in base_weights(policy)]
    llm.worker.loaded.clear()
    mine = dict(adapter_tensors(policy))
    assert sent(1).keys() == mine.keys() and all(torch.equal(v, mine[k]) for k, v in sent(1).items())
    assert engine.weights_checksum() == checksum(adapter_tensors(policy))
    engine.generate([[1]], 1, SamplingParams(2), [3])  # nothing changed: the same adapters
    assert llm.calls[-1] == ("lora", 1)

    llm.calls.clear()
    engine.sleep()  # level 2: vLLM's base weights go too
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    engine.weights_updated()
    engine.generate([[1]], 1, SamplingParams(2), [3])
    assert [c[:1] if c[0] == "generate" else c for c in llm.calls] == [
        ("sleep", 2), ("wake_up", ("weights",)), ("collective_rpc",), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)),
        ("generate",), ("lora", 2)]
    assert [n for n, _ in llm.worker.loaded] == [n for n, _ in base_weights(policy)]  # the base, unmerged
    assert all(torch.equal(v, dict(adapter_tensors(policy))[k]) for k, v in sent(2).items())
    assert not any(torch.equal(v, sent(1)[k]) for k, v in sent(2).items() if "lora_B" in k)


def test_vllm_missing_is_a_clear_startup_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    code = main(["train", "--no-progress", "model.name=smollm2-135m-instruct", "rollout.engine=vllm",
                 "train.max_steps=1", f"train.output_dir={tmp_path / 'run'}"])
    assert code == 2 and "rollout.engine=vllm needs vLLM" in capsys.readouterr().err


@pytest.mark.parametrize("correct", [True, False])
def test_the_trainer_corrects_an_engine_whose_logprobs_are_not_its_own(tmp_path, monkeypatch, correct):
    """Here the in-process engine poses as inexact: its sampling log-probs are the trainer's to float
    rounding, so every weight is ~1 and logged; with is_correction off nothing is logged."""
    from grpokit.engines.transformers_engine import TransformersEngine

    monkeypatch.setattr(TransformersEngine, "exact_logprobs", False)
    run = tmp_path / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "reward.functions=[length]", "train.max_steps=2",
                 "train.prompts_per_step=2", "rollout.num_generations=4", "data.eval_size=0",
                 f"rollout.is_correction={str(correct).lower()}", f"train.output_dir={run}"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if correct:
            assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
            assert 1.0 <= row["sampling/importance_sampling_ratio/max"] < 1.001
        else:
            assert not any(k.startswith("sampling/") for k in row)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-vlm"])
def test_a_vllm_server_fingerprints_its_model_from_the_config_alone(name):
    """`grpokit serve --engine vllm` builds its fingerprint from a meta-device model (vLLM keeps the
    weights): it must equal that of the trainer's real model, tied weights included."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grpokit.engines.weights import fingerprint
    from grpokit.models.loading import load_model

    model = load_model(name)
    with torch.device("meta"):
        auto = AutoModelForImageTextToText if name.endswith("vlm") else AutoModelForCausalLM
        shapes = auto.from_config(model.config)
    assert fingerprint(shapes) == fingerprint(model)
    assert [n for n, _ in named_weights(shapes)] == [n for n, _ in named_weights(model)]


FAKE_VLLM = '''
"""A stand-in for vLLM in the replica processes of a data-parallel server (which import it themselves)."""
import json, os
import torch

torch.cuda.is_available = lambda: True  # the boundary: vLLM would run on the GPUs it was given


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _expanded(prompt):
    """The prompt with its images' placeholders expanded, as vLLM's processor would."""
    images = prompt.get("multi_modal_data", {}).get("image")
    if not images:
        return prompt["prompt_token_ids"]
    from grpokit.models import load_processor

    processor = load_processor("tiny-random-vlm")
    text = processor.tokenizer.decode(prompt["prompt_token_ids"])
    return list(processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0])


class _Model:
    def __init__(self):
        self.loaded = 0

    def load_weights(self, weights):
        self.loaded += sum(1 for _ in weights)


class _Worker:
    def __init__(self):
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = _Model()


class LLM:
    def __init__(self, **kwargs):
        self.worker = _Worker()
        if kwargs["tensor_parallel_size"] > 1:  # as vLLM does: a worker process per GPU
            import multiprocessing
            worker = multiprocessing.get_context("spawn").Process(target=os.getpid)
            worker.start()
            worker.join()
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"gpus": os.environ["CUDA_VISIBLE_DEVICES"], "tp": kwargs["tensor_parallel_size"],
                                "pid": os.getpid()}) + "\\n")

    def generate(self, prompts, sampling, use_tqdm=True):
        outputs = []
        for prompt, params in zip(prompts, sampling):
            ids = [params.seed % 50 + 3, len(prompt["prompt_token_ids"]) + 3][: params.max_tokens]
            sample = type("Sample", (), {"token_ids": ids, "finish_reason": "length",
                                         "logprobs": [{t: type("L", (), {"logprob": -0.25})()} for t in ids]})()
            outputs.append(type("Output", (), {"outputs": [sample], "prompt_token_ids": _expanded(prompt)})())
        return outputs

    def collective_rpc(self, method, args=()):
        assert isinstance(args[0], list)  # tensor parallel: workers of their own get a list, not a generator
        return [method(self.worker, *args)]

    def reset_prefix_cache(self):
        pass
'''


@pytest.mark.process
def test_data_parallel_replicas_split_the_groups_and_each_load_the_weights(tmp_path, monkeypatch, tiny):
    """`grpokit serve --engine vllm --data-parallel-size 2 --tensor-parallel-size 2`: two replica processes,
    each on its own 2 GPUs with vLLM's tensor parallelism; answers in the prompts' order, whichever
    replica sampled them; every push loaded into both. The model is a vision-language model: each
    replica gets its prompts' images."""
    from support.vlms import image, messages

    from grpokit.engines.vllm_engine import DataParallelVLLM
    from grpokit.models.loading import load_processor
    from grpokit.models.vision import Vision

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned process starts with its parent's sys.path
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "replicas.jsonl"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with pytest.raises(Exception, match="3 x --tensor-parallel-size 2 needs 6 GPUs; 4 are visible"):
        DataParallelVLLM(3, 2, model_path="/models/x", dtype="float32", pad_id=0, eos_ids=[2])
    vision = Vision(load_processor("tiny-random-vlm"))
    engine = DataParallelVLLM(2, 2, model_path="/models/x", dtype="float32", pad_id=0, eos_ids=[2], vision=vision)
    try:
        replicas = [json.loads(line) for line in (tmp_path / "replicas.jsonl").read_text().splitlines()]
        assert sorted((r["gpus"], r["tp"]) for r in replicas) == [("4,5", 2), ("6,7", 2)]
        assert len({r["pid"] for r in replicas}) == 2
        images = [(image((255, 0, 0)),), (), (image((0, 255, 0)), image((0, 0, 255))), ()]
        prompts = [vision.encode(messages(1, "One"), images[0]), [6], vision.encode(messages(2, "Two"), images[2]),
                   [9, 9, 9]]
        counts, seeds = [2, 1, 3, 2], list(range(100, 108))
        batch = engine.generate(prompts, counts, SamplingParams(2), seeds, images=images)
        # vLLM was given each prompt as the tokenizer encodes it (its images' placeholders folded)
        lengths = [len(vision.placeholder_ids(p, i)) for p, i, k in zip(prompts, images, counts) for _ in range(k)]
        assert batch.completion_ids.tolist() == [[s % 50 + 3, n + 3] for s, n in zip(seeds, lengths)]
        assert batch.prompt_index.tolist() == [0, 0, 1, 2, 2, 2, 3, 3]
        assert batch.images == [images[i] for i in batch.prompt_index.tolist()]
        model, _ = tiny
        assert engine.load_weights(named_weights(model)) == checksum(named_weights(model)) == engine.weights_checksum()
    finally:
        engine.close()
    assert all(not p.is_alive() for p in engine.processes)


def test_parallel_flags_need_the_vllm_engine_and_vllm(monkeypatch, capsys):
    pytest.importorskip("fastapi")
    assert main(["serve", "--model", "tiny-random", "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size 2 spreads vLLM over GPUs: it needs --engine vllm" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["serve", "--model", "tiny-random", "--engine", "vllm", "--data-parallel-size", "2"]) == 2
    assert "needs vLLM" in capsys.readouterr().err
