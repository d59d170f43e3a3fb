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
- On several processes (see distributed.py) every process draws the same prompts, generates and
  scores only the completions it owns, and takes part in every reduction; process 0 alone writes.
"""

from __future__ import annotations

import copy
import datetime
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit import distributed
from grpokit.advantages import group_advantages
from grpokit.config import Config, ConfigError, reward_weights, save_config
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
    """Reward functions, called with TRL's convention, summed with weights."""

    def __init__(self, weighted: tuple[tuple[str, float], ...]):
        # Metric keys (rewards/<name>/mean) name a file's function without its folders.
        self.names = [name.rsplit("/", 1)[-1] for name, _ in weighted]
        if len(set(self.names)) < len(self.names):
            raise ConfigError(f"reward.functions names a function twice: {[n for n, _ in weighted]}")
        self.weights = [weight for _, weight in weighted]
        self.functions = [get_reward_function(name) for name, _ in weighted]

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
        self.device = distributed.init()
        W, rank = distributed.world_size(), distributed.rank()
        config.validate(world_size=W)
        self.config = config
        seed = config.train.seed
        # Resolve the task and reward functions before anything is written: a bad name fails here.
        self.task = make_task(config.data.task, seed=seed, eval_size=config.data.eval_size)
        self.rewards = RewardSet(reward_weights(config, self.task.reward_functions))
        self.stream = self.task.train_stream()
        # Process 0 alone owns the run directory; the others learn its path (a default one is
        # stamped with process 0's clock) or its refusal, and stop with the same message.
        self.run_dir = distributed.on_main(lambda: prepare_run_dir(config))
        config.train.output_dir = str(self.run_dir)

        random.seed(seed)
        torch.manual_seed(seed)  # the same on every process: they must start from the same weights
        # Each step draws one sampling seed per completion of the whole step, the same on every
        # process; a completion's tokens then depend on its seed, not on which process samples it.
        self.seed_stream = torch.Generator().manual_seed(seed)

        self.tokenizer = load_tokenizer(config.model.name)
        self.policy = load_model(config.model.name, config.model.dtype).to(self.device)
        distributed.broadcast_parameters(self.policy)
        # The reference model exists only when the KL term does (CONTEXT.md, report 1).
        self.reference = None
        if config.algorithm.beta > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.engine = make_engine(
            config.rollout.engine, self.policy, self.tokenizer, eos_token_ids(self.policy, self.tokenizer)
        )

        t = config.train
        # The global completions of a step this process owns, in update order (distributed.py).
        self.rows = distributed.shard_rows(config.completions_per_step, config.completions_per_update, W, rank)
        self.micro_batch = t.micro_batch_size or config.completions_per_update // W
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
        self.monitor = Monitor(self.run_dir if distributed.is_main() else None, t.max_steps, enabled=progress)
        self.num_tokens = 0  # prompt + completion tokens seen so far, all processes (TRL's `num_tokens`)

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        t = self.config.train
        main = distributed.is_main()
        history = [self.evaluate(step=0)]
        try:
            for step in range(1, t.max_steps + 1):
                examples = [next(self.stream) for _ in range(t.prompts_per_step)]  # the same on every process
                self.monitor.step(self.train_step(step, examples))
                if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
                    history.append(self.evaluate(step))
                if main and t.save_every and step % t.save_every == 0:
                    save_model(self.policy, self.tokenizer, self.run_dir / "checkpoints" / f"step-{step}")
            if t.max_steps > 0:
                history.append(self.evaluate(t.max_steps))
            if main:
                save_model(self.policy, self.tokenizer, self.run_dir / "final")
        finally:
            self.monitor.close()
        return TrainResult(self.run_dir, [h for h in history if h])

    def train_step(self, step: int, examples: list[Example]) -> dict:
        """Generate this process's completions for the step's `examples`, then learn from them."""
        start = time.perf_counter()
        batch = self.generate(examples)
        t_generate = time.perf_counter() - start
        metrics = self.learn(examples, batch)
        times = torch.tensor([t_generate, metrics.pop("time/logprobs"), metrics.pop("time/update"),
                              time.perf_counter() - start])
        times = distributed.all_reduce(times, "max").tolist()  # the slowest process sets the pace
        return {
            "step": step,
            **metrics,
            "time/generate": times[0],
            "time/logprobs": times[1],
            "time/update": times[2],
            "step_time": times[3],
        }

    def generate(self, examples: list[Example]) -> RolloutBatch:
        """The completions this process owns (rows `self.rows` of the step), grouped by prompt."""
        G, N = self.config.rollout.num_generations, self.config.completions_per_step
        seeds = torch.randint(0, 2**62, (N,), generator=self.seed_stream)[self.rows]  # (n,)
        prompts, counts = torch.unique_consecutive(self.rows // G, return_counts=True)
        return self.engine.generate(
            [self.encode(examples[p]) for p in prompts.tolist()], counts.tolist(), self.sampling, seeds.tolist()
        )

    def learn(self, examples: list[Example], batch: RolloutBatch) -> dict:
        """Score this process's completions `batch` (rows `self.rows` of the step), then update.

        Every statistic of the batch (advantages, every logged metric) is one of the whole step,
        over all processes.
        """
        cfg, a, G = self.config, self.config.algorithm, self.config.rollout.num_generations
        N, U = cfg.completions_per_step, cfg.completions_per_update
        owned = [examples[r // G] for r in self.rows.tolist()]
        local_rewards, local_per_function = self.rewards(owned, self.decode(batch), batch.finish_reasons)  # (n,)
        rewards = distributed.gather_rows(local_rewards, N, U)  # (N,) in global order
        per_function = {k: distributed.gather_rows(v, N, U) for k, v in local_per_function.items()}
        # Whole groups and the whole batch, wherever their completions were generated.
        advantages = group_advantages(rewards, G, a.scale_rewards)[self.rows]  # (n,)
        # With no KL term, a completion with advantage exactly 0 adds exactly 0 to the loss, its
        # gradient and the clip metrics: it needs no forward/backward at all.
        active = advantages != 0 if a.beta == 0 else torch.ones_like(advantages, dtype=torch.bool)  # (n,)

        t0 = time.perf_counter()
        ref_logps = self.batch_logprobs(self.reference, batch, active) if self.reference is not None else None
        old_logps = self.batch_logprobs(self.policy, batch, active) if cfg.needs_old_logps else None
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        update_metrics = self.update(batch, advantages.to(self.device), active, old_logps, ref_logps)
        t_update = time.perf_counter() - t0

        mask = batch.completion_mask.cpu()  # (n, T)
        lengths = distributed.gather_rows(mask.sum(-1).float(), N, U)  # (N,)
        truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.float32)
        truncated = distributed.gather_rows(truncated, N, U)  # (N,)
        totals = distributed.all_reduce(torch.stack([
            (batch.entropies.cpu().double() * mask).sum(),
            mask.sum().double(),
            batch.prompt_mask.sum().cpu().double() + mask.sum(),
        ])).tolist()
        self.num_tokens += int(totals[2])
        group_std = rewards.view(-1, G).std(dim=1)  # (P,)
        return {
            **update_metrics,
            "entropy": totals[0] / max(totals[1], 1.0),
            "reward": rewards.mean().item(),
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": (group_std == 0).float().mean().item(),
            **{f"rewards/{n}/mean": v.mean().item() for n, v in per_function.items()},
            **{f"rewards/{n}/std": v.std().item() for n, v in per_function.items()},
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
            "num_tokens": self.num_tokens,
            "time/logprobs": t_logprobs,
            "time/update": t_update,
        }

    def update(self, batch: RolloutBatch, advantages, active, old_logps, ref_logps) -> dict:
        """num_iterations x updates_per_step optimizer updates on this process's completions.

        advantages (n,), active (n,) bool, old_logps / ref_logps (n, T) or None. This process's
        rows are in update order: update u uses local rows [u*S, (u+1)*S), S = U / processes.
        """
        cfg, a = self.config, self.config.algorithm
        U = cfg.completions_per_update
        share = U // distributed.world_size()
        mask = batch.completion_mask  # (n, T)
        # Partial sums (this process's rows; summed over processes at the end) and shared values.
        partial = dict.fromkeys(("loss", *CLIP_METRICS, *(("kl",) if a.beta > 0 else ())), 0.0)
        shared = {"grad_norm": 0.0, "learning_rate": 0.0}
        num_updates = 0
        self.policy.train()
        for _ in range(a.num_iterations):
            for u0 in range(0, len(advantages), share):
                local = torch.arange(u0, u0 + share)
                # The whole update batch's counts, all processes, normalize every micro-batch's loss.
                num_tokens = distributed.all_reduce(mask[local].sum().double()).item()
                rows = local[active[local]]
                for mb in rows.split(self.micro_batch) if len(rows) else ():  # split() of nothing gives one empty part
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
                    partial["loss"] += loss.item()
                    for k, v in metrics.items():
                        partial[k] += v.item()
                # Each process's loss is its share of the whole-batch loss: sum, never average.
                distributed.sum_gradients(self.params)
                shared["learning_rate"] += self.optimizer.param_groups[0]["lr"]
                clip = cfg.train.max_grad_norm or float("inf")
                shared["grad_norm"] += torch.nn.utils.clip_grad_norm_(self.params, clip).item()
                self.optimizer.step()
                self.scheduler.step()
                # Zeros, not None: AdamW must step every parameter even when no row was active.
                self.optimizer.zero_grad(set_to_none=False)
                num_updates += 1
        summed = distributed.all_reduce(torch.tensor(list(partial.values()), dtype=torch.float64)).tolist()
        return {k: v / num_updates for k, v in (*zip(partial, summed), *shared.items())}

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
        groups, prompt_index = torch.unique(batch.prompt_index[rows], return_inverse=True)
        # One row per distinct prompt; which one does not matter, they hold the same prompt tokens.
        first = torch.empty_like(groups)
        first[prompt_index] = rows
        return completion_logprobs(
            model, batch.prompt_ids[first], batch.prompt_mask[first],
            batch.completion_ids[rows], prompt_index.to(self.device), self.config.rollout.temperature,
        )

    @torch.no_grad()
    def batch_logprobs(self, model, batch: RolloutBatch, active: torch.Tensor) -> torch.Tensor:
        """Log-probs (n, T) under `model` of the `active` completions, in micro-batches, no gradient;
        the inactive rows (never used) are 0."""
        was_training = model.training
        model.eval()
        try:
            out = None
            rows = torch.nonzero(active).view(-1)
            for mb in rows.split(self.micro_batch) if len(rows) else ():
                logps = self.logprobs(model, batch, mb)  # (M, T)
                if out is None:
                    out = logps.new_zeros(batch.completion_ids.shape)  # (n, T)
                out[mb] = logps
            return out if out is not None else torch.zeros(batch.completion_ids.shape, device=self.device)
        finally:
            model.train(was_training)

    @torch.no_grad()
    def evaluate(self, step: int, batch_size: int = 64) -> dict:
        """Greedy completions on the held-out split, each process scoring its slice; gathered."""
        examples = self.task.eval_examples
        if not examples:
            return {}
        W, rank = distributed.world_size(), distributed.rank()
        mine = examples[rank * len(examples) // W : (rank + 1) * len(examples) // W]
        records = []  # (total reward, {function: reward}, length, truncated) per example
        for i in range(0, len(mine), batch_size):
            chunk = mine[i : i + batch_size]
            batch = self.engine.generate([self.encode(e) for e in chunk], 1, self.greedy)
            total, by_name = self.rewards(chunk, self.decode(batch), batch.finish_reasons)
            lengths = batch.completion_mask.sum(-1).tolist()
            for j in range(len(chunk)):
                records.append((total[j].item(), {n: v[j].item() for n, v in by_name.items()},
                                lengths[j], batch.finish_reasons[j] == "length"))
        records = distributed.gather_lists(records)
        n = len(records)
        metrics = {
            "eval/reward": sum(r[0] for r in records) / n,
            **{f"eval/rewards/{name}/mean": sum(r[1][name] for r in records) / n for name in self.rewards.names},
            "eval/completions/mean_length": sum(r[2] for r in records) / n,
            "eval/completions/clipped_ratio": sum(r[3] for r in records) / n,
        }
        self.monitor.eval(step, metrics)
        return {"step": step, **metrics}


def train(config: Config, progress: bool = True) -> TrainResult:
    return Trainer(config, progress=progress).train()
