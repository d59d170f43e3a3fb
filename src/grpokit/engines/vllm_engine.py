"""`rollout.engine=vllm` (in the training process) and `grpokit serve --engine vllm`: generation
with vLLM's offline `LLM` API. Needs a GPU and `pip install 'grpokit[vllm]'`.

- Requests: each sampled completion is its own request (`SamplingParams(n=1, seed=...)`) so that
  what it samples depends on its seed alone, as with every engine (engines/protocols.py); vLLM's
  prefix cache computes the prompt they share once. Greedy requests (no seeds) ask for `n`
  completions of a prompt in one request.
- Log-probs: `SamplingParams(logprobs=0)` returns the sampled token's log-prob (`logprobs=k`: and
  the k most likely, an agent's request's top_logprobs), and the engine is
  built with `logprobs_mode="processed_logprobs"`, so it is the log-prob under the distribution
  actually sampled from (after temperature, min-p, top-k, top-p), the trainer's `sampling_logps`. vLLM's
  kernels differ from the trainer's, so these differ from the trainer's log-probs: the trainer
  corrects with truncated importance sampling (algorithm/loss.py, `rollout.is_correction`).
- Entropies are not measured by vLLM: the `entropy` metric is left out with this engine.
- Images (a vision-language model): a prompt with images goes to vLLM as its ids with each image's
  tokens folded back into the chat template's placeholder, and the images as `multi_modal_data`,
  since vLLM expands the placeholders itself (as verl and TRL hand them over). The prompt vLLM ran
  must be the one the trainer's processor made (`check_prompts`): the log-probs are computed on it.
  The image placeholder token is a stop token, as with every engine (models/vision.py).
- Weights: `load_weights` hands (name, tensor) pairs to the model inside vLLM's worker through
  `LLM.collective_rpc`; vLLM's model classes take Hugging Face checkpoint names and fuse q/k/v and
  gate/up themselves. `vllm_name` strips the wrappers a trainer's names can carry. The prefix
  cache is reset after each load. The checksum is that of the tensors as received (vLLM keeps
  them fused and cast), so for vLLM it proves the transfer, not vLLM's own copy.
- Log-probs with `top_p < 1`, `top_k > 0` or `min_p > 0`: vLLM's processed log-probs are renormalised
  over the kept tokens, the trainer's are not (they are the tempered policy's, as TRL's), so the
  importance weights sit at or below 1 by the filtering alone; keep the correction's cap in mind there.
- Min-p: vLLM applies it before top-k/top-p, the transformers engine after them (as transformers
  does). With top-k alone the kept tokens are the same; with top-p too, vLLM's top-p measures its
  mass over the tokens min-p kept, so it may keep fewer.
- LoRA (a peft policy, in the training process): vLLM is built with `enable_lora` and samples with
  the policy's adapters through its LoRA loading call: after each update the adapters are written
  as a peft folder and named by a new `LoRARequest` id (vLLM keeps an adapter by its id), so only
  they move; the base weights (frozen) are loaded once, and again only after a sleep that dropped
  them.
- Sleep mode (`enable_sleep_mode=True`): in the training process, vLLM's weights and KV cache are
  released while the trainer updates (`sleep(level=2)`); before the next generation the weights
  are woken, loaded, then the KV cache (`wake_up(tags=...)`).
- Parallelism, in `grpokit serve --engine vllm`: `--tensor-parallel-size N` is vLLM's own
  (`LLM(tensor_parallel_size=N)`, each layer split over N GPUs, one worker process per GPU);
  every worker is handed the whole tensors through `collective_rpc` and its model's `load_weights`
  keeps its shard. `--data-parallel-size M` runs M such engines (`DataParallelVLLM`), each in a
  process of its own on its own N GPUs (CUDA_VISIBLE_DEVICES), as vLLM's offline data-parallel
  example does: a generation's prompt groups are split among them by expected tokens, and every
  weight push is loaded into each (their checksums must agree).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpokit.engines.balance import join_generation, split_generation
from grpokit.engines.batch import RolloutBatch, SamplingParams, from_completions, group_counts
from grpokit.engines.prompts import check_images
from grpokit.engines.weights import Checksum, adapter_tensors, base_weights, checksum, is_lora, named_weights
from grpokit.models.vision import IMAGE_TOKEN
from grpokit.runtime.errors import StartupError
from grpokit.settings.schema import ModelConfig, RolloutConfig

if TYPE_CHECKING:
    from grpokit.models.vision import Vision

# Wrappers that put a prefix or infix on parameter names: DDP / accelerate, torch.compile, PEFT.
_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")


def import_vllm():
    try:
        import vllm
    except ImportError:
        raise StartupError(
            "rollout.engine=vllm needs vLLM, which runs on GPUs: pip install 'grpokit[vllm]' (on CPU use "
            "rollout.engine=transformers)") from None
    return vllm


def vllm_name(name: str) -> str:
    """A trainer's parameter name as vLLM's `load_weights` expects it (a Hugging Face checkpoint name)."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name.replace(".base_layer.", ".")  # a PEFT-wrapped linear, after its adapter is merged


def sampling_params(vllm, params: SamplingParams, n: int, seed: int | None, stop_token_ids: list[int]):
    return vllm.SamplingParams(
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,  # -1: off, in every vLLM version
        min_p=params.min_p,
        max_tokens=params.max_tokens,
        logprobs=params.top_logprobs,  # the sampled token's own log-prob, and as many alternatives as asked
        seed=seed,
        stop_token_ids=stop_token_ids,
        detokenize=False,
    )


def prompt_inputs(prompts: list[list[int]], images: list[tuple] | None, vision) -> list[dict]:
    """vLLM's prompt (a `TokensPrompt`) of each prompt: its ids; with a vision-language model's
    images, those as `multi_modal_data` and the ids with each image's tokens folded back into its
    placeholder, since vLLM expands the placeholders itself (Vision.placeholder_ids)."""
    if images is None:
        return [{"prompt_token_ids": p} for p in prompts]
    return [{"prompt_token_ids": vision.placeholder_ids(p, row), "multi_modal_data": {"image": list(row)}} if row
            else {"prompt_token_ids": p} for p, row in zip(prompts, images)]


def build_requests(vllm, inputs: list[dict], counts: list[int], params: SamplingParams,
                   seeds: Sequence[int] | None, stop_token_ids: list[int]):
    """(prompts, sampling params) for `LLM.generate`, of prompts `inputs` (prompt_inputs): one request
    per completion when seeded, one per prompt (n = its count) when greedy."""
    if seeds is None:
        return list(inputs), [sampling_params(vllm, params, k, None, stop_token_ids) for k in counts]
    requests, sampling, i = [], [], 0
    for prompt, k in zip(inputs, counts):
        for _ in range(k):
            requests.append(prompt)
            sampling.append(sampling_params(vllm, params, 1, int(seeds[i]), stop_token_ids))
            i += 1
    return requests, sampling


def to_completions(outputs, image_token_id: int | None = None, top: int = 0) -> list[dict]:
    """vLLM `RequestOutput`s, in request order, as per-completion dicts (rollout.from_completions);
    a completion that ends on `image_token_id` (a vision-language model's stop token) finishes with
    vision.IMAGE_TOKEN, as with every engine. top: the alternatives asked per token
    (SamplingParams.top_logprobs): vLLM's entries of rank 1..top (it adds the sampled token's)."""
    completions = []
    for output in outputs:
        for sample in output.outputs:
            ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0 was set)")
            imaged = image_token_id is not None and bool(ids) and ids[-1] == image_token_id
            completions.append({
                "token_ids": ids,
                "logprobs": [step[token].logprob for step, token in zip(sample.logprobs, ids)],
                "entropies": None,
                "finish_reason": IMAGE_TOKEN if imaged else "length" if sample.finish_reason == "length" else "stop",
            })
            if top:
                completions[-1]["top_logprobs"] = [
                    [[t, e.logprob] for t, e in sorted(step.items(), key=lambda kv: kv[1].rank)
                     if e.rank <= top and e.logprob != float("-inf")] for step in sample.logprobs]
    return completions


def check_prompts(outputs, prompts: list[list[int]]) -> None:
    """Each request's prompt as vLLM ran it is `prompts` (those of the requests, in order): with
    images, vLLM's processor expanded each placeholder into the tokens the trainer's did, so the
    trainer's log-probs are of the sequences sampled."""
    for i, (output, ids) in enumerate(zip(outputs, prompts)):
        ran = list(output.prompt_token_ids)
        if ran != ids:
            at = next((j for j, (a, b) in enumerate(zip(ran, ids)) if a != b), min(len(ran), len(ids)))
            raise RuntimeError(f"vLLM expanded the images of request {i} into other tokens than the model's processor "
                               f"did ({len(ran)} prompt tokens against {len(ids)}, first different at {at}): its "
                               "image processing settings differ from the processor's")


def model_path(name: str) -> str:
    """A folder or Hub id vLLM can load for model.name (it builds its own model from it)."""
    from grpokit.models.bundled import BUNDLED, BUNDLED_VLM, TINY, TINY_VLM, bundled_model_path, bundled_vlm_path

    if name in (TINY, TINY_VLM):
        raise StartupError(f"rollout.engine=vllm needs a model vLLM can load from a folder or the Hub; "
                           f"{name} exists only in memory")
    return str(bundled_model_path()) if name == BUNDLED else str(bundled_vlm_path()) if name == BUNDLED_VLM else name


def _load_into_worker(worker, pairs):
    worker.model_runner.model.load_weights(weights=pairs)


class VLLMEngine:
    """A RolloutEngine in the training process, and the ServedEngine of `grpokit serve --engine vllm`."""

    exact_logprobs = False  # vLLM's kernels: the trainer needs the importance-sampling correction
    measures_entropies = False  # vLLM returns log-probs only
    remote = False
    device: torch.device  # CUDA (ServedEngine)

    @classmethod
    def from_config(cls, rollout: RolloutConfig, model, tokenizer, eos_ids, model_name, lockstep, vision=None) -> VLLMEngine:
        return cls(model_path(model_name), str(next(model.parameters()).dtype).removeprefix("torch."),
                   tokenizer.pad_token_id, eos_ids, policy=model, sleep=rollout.vllm_sleep,
                   gpu_memory_utilization=rollout.vllm_gpu_memory_utilization, vision=vision)

    @classmethod
    def served(cls, m: ModelConfig, rollout: RolloutConfig, tokenizer, vision=None, tensor_parallel_size: int = 1,
               data_parallel_size: int = 1) -> tuple:
        """What `grpokit serve --engine vllm` serves (training/setup.py `build`): (the engine, the
        model's names and shapes on the meta device, for its fingerprint; EOS ids), model.name in
        model.dtype on tensor_parallel_size GPUs, or data_parallel_size replicas of that
        (DataParallelVLLM)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from grpokit.models.loading import DTYPES, eos_token_ids

        path = model_path(m.name)
        with torch.device("meta"):  # names and shapes only, for the fingerprint
            auto = AutoModelForCausalLM if vision is None else AutoModelForImageTextToText
            shapes = auto.from_config(AutoConfig.from_pretrained(path), dtype=DTYPES[m.dtype])
        eos = eos_token_ids(shapes, tokenizer)
        args = dict(model_path=path, dtype=m.dtype, pad_id=tokenizer.pad_token_id, eos_ids=eos, vision=vision)
        engine = cls(**args, tensor_parallel_size=tensor_parallel_size) if data_parallel_size == 1 else \
            DataParallelVLLM(data_parallel_size, tensor_parallel_size, **args)
        return engine, shapes, eos

    def __init__(self, model_path: str, dtype: str, pad_id: int, eos_ids: list[int], *, policy=None,
                 sleep: bool = False, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 seed: int = 0, tensor_parallel_size: int = 1, vision: Vision | None = None):
        """`policy`: in the training process, the trainer's model, whose weights (a LoRA policy's
        adapters) are loaded before a generation that follows `weights_updated()`; None in a server
        (weights are pushed). `vision`: a vision-language model's (its prompts come with images)."""
        # One process: the engine's worker lives in this process, so collective_rpc passes tensors
        # (and the generator load_weights consumes) by reference. Forced: a multiprocess engine
        # would have to pickle them.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise StartupError("rollout.engine=vllm needs a CUDA GPU; on CPU use rollout.engine=transformers")
        self.vllm, self.pad_id, self.eos_ids, self.sleeps, self.vision = vllm, pad_id, list(eos_ids), sleep, vision
        # A sampled image placeholder ends its completion (models/vision.py): a stop token.
        self.stop_ids = self.eos_ids + ([] if vision is None else [vision.image_token_id])
        self.adapters = None if policy is None or not is_lora(policy) else Adapters(policy)
        self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, enable_sleep_mode=sleep,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                            tensor_parallel_size=tensor_parallel_size,
                            **({} if self.adapters is None else self.adapters.engine_args()))
        # With several GPUs the workers are processes of their own: collective_rpc pickles its
        # arguments, so they get a list of host tensors rather than a generator over these.
        self.workers_apart = tensor_parallel_size > 1
        self.device = torch.device("cuda")
        self.checksum: str | None = None  # of the last weights loaded; None: as read from model_path
        self.asleep = False
        self.policy = policy
        self.dirty = policy is not None  # a resumed policy differs from model_path's weights

    def weights_updated(self) -> None:
        self.dirty = self.policy is not None

    def needs_weights(self) -> bool:
        return False  # it reads the policy module it was given (vLLM never runs in a sharded trainer)

    def use_weights(self, weights) -> None:
        self.load_weights(weights)
        self.dirty = False

    def close(self) -> None:
        pass  # vLLM's engine lives as long as the process; its memory is freed with it

    def weights_checksum(self) -> str | None:
        """vLLM holds fused tensors under its own names: the checksum is that of the last weights
        loaded, as they arrived; None until then (the weights of model_path)."""
        return self.checksum

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load (name, tensor) pairs as they arrive; returns the checksum of what was loaded."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        digest = Checksum()

        def named():
            for name, tensor in pairs:
                digest.add(name, tensor)
                yield vllm_name(name), tensor

        self.llm.collective_rpc(_load_into_worker,
                                args=([(n, t.cpu()) for n, t in named()] if self.workers_apart else named(),))
        # Cached KV blocks of shared prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.checksum = digest.hexdigest()
        return self.checksum

    takes_adapters = False  # served, it gets a LoRA trainer's merged weights (a vLLM built for LoRA is not)
    stops_between_tokens = False  # a push waits for the generation in hand to end

    def adapter_layout(self, settings: dict) -> list[list]:
        raise NotImplementedError(NO_SERVED_ADAPTERS)

    def load_adapters(self, pairs) -> str:
        raise NotImplementedError(NO_SERVED_ADAPTERS)

    def sleep(self) -> None:
        """Free vLLM's GPU memory while the trainer updates (weights are pushed again after)."""
        if self.sleeps and not self.asleep and self.policy is not None:
            self.llm.sleep(level=2)  # level 2 drops the weights too: the next generation loads the policy's
            self.asleep = True
            self.dirty = True

    def _load_policy(self) -> None:
        """The policy's weights into vLLM: the whole (merged) weights, or a LoRA policy's adapters
        (after its base weights, where a sleep dropped them)."""
        if self.adapters is None:
            self.load_weights(named_weights(self.policy))
            return
        if self.asleep or self.adapters.version == 0:  # dropped by a sleep; or model_path's, which may differ
            self.load_weights(base_weights(self.policy))
        self.adapters.write()
        self.checksum = checksum(adapter_tensors(self.policy))

    def generate(self, prompts: list[list[int]], n: int | Sequence[int], params: SamplingParams,
                 seeds: Sequence[int] | None = None, images: list[tuple] | None = None) -> RolloutBatch:
        if self.dirty:
            self._load_policy()
            self.dirty = False
        if self.asleep:
            raise RuntimeError("vLLM is asleep: load the weights (load_weights) before generating")
        counts = group_counts(prompts, n)
        return from_completions(prompts, counts, self.completions(prompts, counts, params, seeds, images), self.pad_id,
                                images)

    def completions(self, prompts: list[list[int]], counts: list[int], params: SamplingParams,
                    seeds: Sequence[int] | None, images: list[tuple] | None = None) -> list[dict]:
        """counts[i] completions of prompt i (with its images[i]), as per-completion dicts
        (rollout.from_completions)."""
        check_images(images, self.vision)
        inputs = prompt_inputs(prompts, images, self.vision)
        requests, sampling = build_requests(self.vllm, inputs, counts, params, seeds, self.stop_ids)
        adapter = {} if self.adapters is None else {"lora_request": self.adapters.request}
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, **adapter)
        if images is not None:
            check_prompts(outputs, prompts if seeds is None else [p for p, k in zip(prompts, counts) for _ in range(k)])
        return to_completions(outputs, None if self.vision is None else self.vision.image_token_id, params.top_logprobs)


NO_SERVED_ADAPTERS = "grpokit serve --engine vllm takes whole weights: a LoRA trainer pushes it the merged ones"

# The adapter ranks vLLM can be built for (its max_lora_rank); a policy's rank is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Adapters:
    """A LoRA policy's adapters as vLLM takes them: a peft folder (adapter_config.json and
    adapter_model.safetensors, as `save_pretrained` writes them) under a LoRARequest whose id is
    new at every write, the folder before it deleted."""

    def __init__(self, policy):
        self.policy, self.rank = policy, policy.peft_config["default"].r
        if self.rank > VLLM_LORA_RANKS[-1]:
            raise StartupError(f"model.lora_rank={self.rank} with rollout.engine=vllm: vLLM takes adapters of rank "
                               f"{VLLM_LORA_RANKS[-1]} at most")
        self.folder = Path(tempfile.mkdtemp(prefix="grpokit-vllm-adapters-"))
        atexit.register(shutil.rmtree, self.folder, True)
        self.version, self.request = 0, None

    def engine_args(self) -> dict:
        return {"enable_lora": True, "max_loras": 1, "max_lora_rank": min(r for r in VLLM_LORA_RANKS if r >= self.rank)}

    def write(self) -> None:
        from vllm.lora.request import LoRARequest

        self.version += 1
        folder = self.folder / f"v{self.version}"
        self.policy.save_pretrained(folder, save_embedding_layers=False)
        shutil.rmtree(self.folder / f"v{self.version - 1}", ignore_errors=True)  # read by vLLM when it was used
        self.request = LoRARequest(f"grpokit-policy-v{self.version}", self.version, str(folder))


class DataParallelVLLM:
    """`replicas` VLLMEngines (for `grpokit serve`), each in a process of its own on its own
    `tensor_parallel_size` GPUs: a ServedEngine (what a server asks of an engine), not a RolloutEngine."""

    exact_logprobs = False
    remote = False
    device = torch.device("cuda")

    def __init__(self, replicas: int, tensor_parallel_size: int, **engine_args):
        import multiprocessing

        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = gpus.split(",") if gpus else [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < replicas * tensor_parallel_size:
            raise StartupError(f"--data-parallel-size {replicas} x --tensor-parallel-size {tensor_parallel_size} needs "
                               f"{replicas * tensor_parallel_size} GPUs; {len(gpus)} are visible")
        self.pad_id, self.vision = engine_args["pad_id"], engine_args.get("vision")
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self.pipes, self.processes = [], []
        for r in range(replicas):
            mine, theirs = context.Pipe()
            share = gpus[r * tensor_parallel_size:(r + 1) * tensor_parallel_size]
            # Not a daemon: with tensor parallelism vLLM starts worker processes of its own, which a
            # daemonic process may not; close() (also at exit) ends them.
            process = context.Process(target=_replica, args=(theirs, ",".join(share),
                                                             {**engine_args, "tensor_parallel_size": tensor_parallel_size}),
                                      name=f"grpokit-vllm-replica-{r}")
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)
        atexit.register(self.close)
        self.checksum: str | None = None
        try:
            self._read(range(replicas))  # each loads its model: wait for all, and fail if one cannot
        except RuntimeError:
            self.close()
            raise

    def _ask(self, requests: dict[int, tuple]) -> dict[int, object]:
        """Send each replica r its request requests[r]; their answers (`_read`)."""
        failures, sent = [], []
        for r, request in requests.items():
            try:
                self.pipes[r].send(request)
                sent.append(r)
            except OSError as e:
                failures.append(f"vLLM replica {r} cannot be reached ({e}; its exit code: {self.processes[r].exitcode})")
        return self._read(sent, failures)

    def _read(self, replicas, failures: list[str] | None = None) -> dict[int, object]:
        """Every answer of `replicas` (so that none is left for the next request to read); any
        failure, `failures` first, raised once all are read."""
        answers, failures = {}, list(failures or ())
        for r in replicas:
            try:
                ok, value = self.pipes[r].recv()
            except (EOFError, OSError):
                failures.append(f"vLLM replica {r} stopped (its exit code: {self.processes[r].exitcode})")
                continue
            if ok:
                answers[r] = value
            else:
                failures.append(f"vLLM replica {r}: {value}")
        if failures:
            raise RuntimeError("; ".join(failures))
        return answers

    def weights_checksum(self) -> str | None:
        return self.checksum

    takes_adapters = False  # as VLLMEngine served
    stops_between_tokens = False

    def adapter_layout(self, settings: dict) -> list[list]:
        raise NotImplementedError(NO_SERVED_ADAPTERS)

    def load_adapters(self, pairs) -> str:
        raise NotImplementedError(NO_SERVED_ADAPTERS)

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
        """The same weights into every replica; their checksums (of what each received) must agree."""
        weights = [(name, tensor.cpu()) for name, tensor in pairs]
        sums = set(self._ask({r: ("load", weights) for r in range(len(self.pipes))}).values())
        if len(sums) != 1:
            raise RuntimeError(f"the vLLM replicas received different weights (checksums {sorted(sums)})")
        self.checksum = sums.pop()
        return self.checksum

    def generate(self, prompts: list[list[int]], n: int | Sequence[int], params: SamplingParams,
                 seeds: Sequence[int] | None = None, images: list[tuple] | None = None) -> RolloutBatch:
        """Prompt groups split among the replicas by expected tokens (each completion samples from
        its own seed, so the split does not change what is sampled), answers in the prompts' order."""
        check_images(images, self.vision)
        counts = group_counts(prompts, n)
        shares = split_generation(prompts, counts, seeds, params.max_tokens, len(self.pipes))
        asked = {r: share for r, share in enumerate(shares) if share[0]}
        answers = self._ask({r: ("generate", *share[1:3], params, share[3],
                                 None if images is None else [images[i] for i in share[0]]) for r, share in asked.items()})
        return join_generation(prompts, counts, [(asked[r][0], answers[r]) for r in asked], self.pad_id, images)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def _replica(pipe, gpus: str, engine_args: dict) -> None:
    """One data-parallel replica's process: a VLLMEngine on GPUs `gpus`, serving requests from `pipe`."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        engine = VLLMEngine(**engine_args)
    except Exception as e:  # noqa: BLE001 - reported to the server, which stops
        pipe.send((False, f"{type(e).__name__}: {e}"))
        return
    pipe.send((True, None))
    while (request := pipe.recv()) is not None:
        try:
            if request[0] == "load":
                pipe.send((True, engine.load_weights(request[1])))
            else:
                pipe.send((True, engine.completions(*request[1:])))
        except Exception as e:  # noqa: BLE001
            pipe.send((False, f"{type(e).__name__}: {e}"))
