"""The GRPO training loop, readable top to bottom.

One step (DESIGN.md): sample `num_generations` completions for each of `prompts_per_step`
prompts; score them; turn rewards into group-relative advantages; then `num_iterations` passes
over the batch, each split into `updates_per_step` optimizer updates, each accumulated over
micro-batches of `micro_batch_size` completions. The loss of a micro-batch is normalized by the
sequence and token counts of its whole update batch, so micro-batching never changes the update.

Deliberate choices, stated once:
- Log-probs are computed at the sampling temperature (logits / temperature), as TRL does, so the
  ratio compares like with like.
- `old_logps` are computed (one extra forward, no gradient) only when samples become off-policy
  (num_iterations > 1 or updates_per_step > 1); otherwise the ratio is exp(logp - logp.detach()).
- The reference model is a frozen copy of the initial policy, made only when beta > 0.
- `entropy` is that of the policy's (tempered) next-token distribution at every sampled token,
  measured by the rollout engine while sampling; the update never spends a pass on it.
- With beta == 0, completions whose advantage is exactly 0 (every member of a zero-variance
  group) skip the forward/backward: they add exactly 0 to the loss and the gradient, and the
  normalizers still count them, so the update is the same as if they had been computed.
- Evaluation is greedy on the task's held-out split, before training, every `eval_every` steps and
  after the last step.
"""

from __future__ import annotations

import copy
import datetime
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.advantages import group_advantages
from grpokit.config import Config, save_config
from grpokit.logprobs import completion_logprobs
from grpokit.loss import CLIP_METRICS, grpo_loss
from grpokit.models import eos_token_ids, load_model, load_tokenizer, save_model
from grpokit.monitor import Monitor
from grpokit.rewards import get_reward_function
from grpokit.rewards.exact_answer import completion_text
from grpokit.rollout import RolloutBatch, SamplingParams, make_engine
from grpokit.tasks import Example, make_task


@dataclass
class TrainResult:
    run_dir: Path
    eval_history: list[dict]  # one row per evaluation: {"step": ..., "eval/reward": ...}


def prepare_run_dir(config: Config) -> Path:
    """Create the run directory; refuse one that already holds a run, so nothing trained is lost."""
    if config.train.output_dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        config.train.output_dir = f"runs/{config.data.task}-{stamp}"
    run_dir = Path(config.train.output_dir)
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "final").exists():
        raise FileExistsError(
            f"train.output_dir={run_dir} already holds a run (metrics.jsonl or final/); "
            "choose another train.output_dir or move that run away"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    return run_dir


class RewardSet:
    """The task's reward functions, called with TRL's convention, summed with weights."""

    def __init__(self, weighted: tuple[tuple[str, float], ...]):
        self.names = [name for name, _ in weighted]
        self.weights = [weight for _, weight in weighted]
        self.functions = [get_reward_function(name) for name in self.names]

    def __call__(
        self, examples: list[Example], completions: list, finish_reasons: list[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards (N,) and each function's rewards by name; N = len(completions)."""
        prompts = [e.prompt for e in examples]
        columns = {k: [e.columns[k] for e in examples] for k in examples[0].columns}
        columns["finish_reasons"] = finish_reasons
        per_function = {}
        for name, fn in zip(self.names, self.functions):
            values = fn(prompts=prompts, completions=completions, **columns)
            if len(values) != len(completions):
                raise ValueError(
                    f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
                )
            for i, v in enumerate(values):
                if v is None or not math.isfinite(v):
                    raise ValueError(
                        f"reward function {name!r} returned {v!r} for completion {i} "
                        f"({completion_text(completions[i])!r}); rewards must be finite numbers"
                    )
            per_function[name] = torch.tensor(values, dtype=torch.float32)
        total = sum(w * per_function[n] for n, w in zip(self.names, self.weights))
        return total, per_function


class Trainer:
    def __init__(self, config: Config, progress: bool = True):
        config.validate()
        self.config = config
        self.run_dir = prepare_run_dir(config)
        seed = config.train.seed
        random.seed(seed)
        torch.manual_seed(seed)
        self.generator = torch.Generator().manual_seed(seed)  # sampling draws only from this

        self.tokenizer = load_tokenizer(config.model.name)
        self.policy = load_model(config.model.name, config.model.dtype)
        # The reference model exists only when the KL term does (CONTEXT.md, report 1).
        self.reference = None
        if config.algorithm.beta > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.engine = make_engine(
            config.rollout.engine, self.policy, self.tokenizer, eos_token_ids(self.policy, self.tokenizer)
        )
        self.task = make_task(config.data.task, seed=seed, eval_size=config.data.eval_size)
        self.rewards = RewardSet(self.task.reward_functions)
        self.stream = self.task.train_stream()

        t = config.train
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, weight_decay=t.weight_decay)
        for p in self.params:  # see update(): gradients are zeroed in place, never dropped
            p.grad = torch.zeros_like(p)
        warmup = t.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda update: min(1.0, (update + 1) / warmup) if warmup else 1.0
        )
        r = config.rollout
        self.sampling = SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k)
        self.greedy = SamplingParams(r.max_completion_length, temperature=0.0)
        self.monitor = Monitor(self.run_dir, t.max_steps, enabled=progress)
        self.num_tokens = 0  # prompt + completion tokens seen so far (TRL's `num_tokens`)

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        t = self.config.train
        history = [self.evaluate(step=0)]
        try:
            for step in range(1, t.max_steps + 1):
                examples = [next(self.stream) for _ in range(t.prompts_per_step)]
                self.monitor.step(self.train_step(step, examples))
                if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
                    history.append(self.evaluate(step))
                if t.save_every and step % t.save_every == 0:
                    save_model(self.policy, self.tokenizer, self.run_dir / "checkpoints" / f"step-{step}")
            if t.max_steps > 0:
                history.append(self.evaluate(t.max_steps))
            save_model(self.policy, self.tokenizer, self.run_dir / "final")
        finally:
            self.monitor.close()
        return TrainResult(self.run_dir, [h for h in history if h])

    def train_step(self, step: int, examples: list[Example]) -> dict:
        cfg, G = self.config, self.config.rollout.num_generations
        start = time.perf_counter()

        batch = self.engine.generate([self.encode(e) for e in examples], G, self.sampling, self.generator)
        t_generate = time.perf_counter() - start
        grouped = [e for e in examples for _ in range(G)]  # (N,) the example of each completion
        rewards, per_function = self.rewards(grouped, self.decode(batch), batch.finish_reasons)  # (N,)
        advantages = group_advantages(rewards, G, cfg.algorithm.scale_rewards)  # (N,)

        t0 = time.perf_counter()
        ref_logps = self.batch_logprobs(self.reference, batch) if self.reference is not None else None
        old_logps = self.batch_logprobs(self.policy, batch) if cfg.needs_old_logps else None
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        update_metrics = self.update(batch, advantages, old_logps, ref_logps)
        t_update = time.perf_counter() - t0

        mask = batch.completion_mask
        lengths = mask.sum(-1).float()  # (N,)
        self.num_tokens += int(batch.prompt_mask.sum() + mask.sum())
        group_std = rewards.view(-1, G).std(dim=1)  # (P,)
        entropy = (batch.entropies * mask).sum() / mask.sum().clamp(min=1)
        metrics = {
            "step": step,
            **update_metrics,
            "entropy": entropy.item(),
            "reward": rewards.mean().item(),
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": (group_std == 0).float().mean().item(),
            **{f"rewards/{n}/mean": v.mean().item() for n, v in per_function.items()},
            **{f"rewards/{n}/std": v.std().item() for n, v in per_function.items()},
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": sum(r == "length" for r in batch.finish_reasons) / len(lengths),
            "num_tokens": self.num_tokens,
            "time/generate": t_generate,
            "time/logprobs": t_logprobs,
            "time/update": t_update,
            "step_time": time.perf_counter() - start,
        }
        return metrics

    def update(self, batch: RolloutBatch, advantages, old_logps, ref_logps) -> dict:
        """num_iterations x updates_per_step optimizer updates on one rollout batch."""
        cfg, a = self.config, self.config.algorithm
        U, M = cfg.completions_per_update, cfg.micro_batch
        mask = batch.completion_mask  # (N, T)
        # Present even when every completion was skipped (then they are exactly 0).
        sums: dict[str, float] = defaultdict(float, dict.fromkeys(("loss", *CLIP_METRICS), 0.0))
        num_updates = 0
        self.policy.train()
        for _ in range(a.num_iterations):
            for u0 in range(0, cfg.completions_per_step, U):
                # The whole update batch's counts normalize every micro-batch's loss.
                num_tokens = mask[u0 : u0 + U].sum().item()
                rows = torch.arange(u0, u0 + U)
                if a.beta == 0:
                    # With no KL term, a completion with advantage exactly 0 adds exactly 0 to the
                    # loss and its gradient (and to the clip metrics): skip its forward/backward.
                    rows = rows[advantages[rows] != 0]
                for mb in rows.split(M) if len(rows) else ():
                    logps = self.logprobs(self.policy, batch, mb)  # (M, T)
                    loss, metrics = grpo_loss(
                        logps,
                        None if old_logps is None else old_logps[mb],
                        None if ref_logps is None else ref_logps[mb],
                        advantages[mb],
                        mask[mb],
                        loss_type=a.loss_type,
                        beta=a.beta,
                        epsilon=a.epsilon,
                        epsilon_high=a.epsilon_high,
                        kl_estimator=a.kl_estimator,
                        max_completion_length=cfg.rollout.max_completion_length,
                        num_sequences=U,
                        num_tokens=num_tokens,
                    )
                    loss.backward()
                    sums["loss"] += loss.item()
                    for k, v in metrics.items():
                        sums[k] += v.item()
                sums["learning_rate"] += self.optimizer.param_groups[0]["lr"]
                clip = cfg.train.max_grad_norm or float("inf")
                sums["grad_norm"] += torch.nn.utils.clip_grad_norm_(self.params, clip).item()
                self.optimizer.step()
                self.scheduler.step()
                # Zeros, not None: AdamW must step every parameter even when no row was active.
                self.optimizer.zero_grad(set_to_none=False)
                num_updates += 1
        return {k: v / num_updates for k, v in sums.items()}

    # ------------------------------------------------------------------ helpers

    def encode(self, example: Example) -> list[int]:
        text = self.tokenizer.apply_chat_template(example.prompt, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, batch: RolloutBatch) -> list:
        """Completions in TRL's conversational shape: [{"role": "assistant", "content": text}]."""
        lengths = batch.completion_mask.sum(-1).tolist()
        texts = [
            self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            for ids, n in zip(batch.completion_ids.tolist(), lengths)
        ]
        return [[{"role": "assistant", "content": text}] for text in texts]

    def logprobs(self, model, batch: RolloutBatch, rows: torch.Tensor) -> torch.Tensor:
        """Log-probs (len(rows), T) of completions `rows`, each distinct prompt run once."""
        G = self.config.rollout.num_generations
        groups, prompt_index = torch.unique(rows // G, return_inverse=True)
        first_rows = groups * G  # batch.prompt_ids repeats each prompt G times
        return completion_logprobs(
            model, batch.prompt_ids[first_rows], batch.prompt_mask[first_rows],
            batch.completion_ids[rows], prompt_index, self.config.rollout.temperature,
        )

    @torch.no_grad()
    def batch_logprobs(self, model, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs (N, T) of the sampled completions under `model`, in micro-batches, no gradient."""
        was_training = model.training
        model.eval()
        try:
            rows = torch.arange(batch.completion_ids.shape[0])
            return torch.cat([self.logprobs(model, batch, mb) for mb in rows.split(self.config.micro_batch)])
        finally:
            model.train(was_training)

    @torch.no_grad()
    def evaluate(self, step: int, batch_size: int = 64) -> dict:
        """Greedy completions on the held-out split, scored with the task's rewards."""
        examples = self.task.eval_examples
        if not examples:
            return {}
        rewards, lengths, clipped = [], [], 0
        per_function = defaultdict(list)
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            batch = self.engine.generate([self.encode(e) for e in chunk], 1, self.greedy, self.generator)
            total, by_name = self.rewards(chunk, self.decode(batch), batch.finish_reasons)
            rewards.append(total)
            for name, values in by_name.items():
                per_function[name].append(values)
            lengths.append(batch.completion_mask.sum(-1).float())
            clipped += sum(r == "length" for r in batch.finish_reasons)
        metrics = {
            "eval/reward": torch.cat(rewards).mean().item(),
            **{f"eval/rewards/{n}/mean": torch.cat(v).mean().item() for n, v in per_function.items()},
            "eval/completions/mean_length": torch.cat(lengths).mean().item(),
            "eval/completions/clipped_ratio": clipped / len(examples),
        }
        self.monitor.eval(step, metrics)
        return {"step": step, **metrics}


def train(config: Config, progress: bool = True) -> TrainResult:
    return Trainer(config, progress=progress).train()
