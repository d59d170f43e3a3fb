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
- After step N: its metrics row, then its evaluation (if due), then its checkpoint (if due). So a
  checkpoint of step N holds everything logged up to step N, and resuming from it (checkpoint.py)
  truncates metrics.jsonl to step N and continues with step N + 1.
- An optimizer update whose loss or gradient norm is not finite is not applied (neither the
  optimizer nor the learning-rate schedule steps); the step counts as skipped.
"""

from __future__ import annotations

import copy
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpokit import distributed, sharding
from grpokit.advantages import group_advantages
from grpokit.checkpoint import (
    checkpoint_bytes, check_disk_space, link_model_files, load_state, load_weights, open_run_dir, release_run_dir,
    rng_state, set_rng_state, start_run_dir, write_checkpoint, write_state_files,
)
from grpokit.config import Config, StartupError, reward_specs
from grpokit.logprobs import check_chunkable, check_inputs_embeds, completion_logprobs
from grpokit.loss import CLIP_METRICS, IS_MAX, IS_MEAN, grpo_loss
from grpokit.models import (apply_lora, enable_activation_checkpointing, eos_token_ids, load_model, load_tokenizer,
                            save_model)
from grpokit.diagnose import RunFacts
from grpokit.monitor import Monitor
from grpokit.rewards import RewardSet
from grpokit.evaluate import score, summarize
from grpokit.rollout import RolloutBatch, SamplingParams, decode_completions, encode_prompt, make_engine
from grpokit.tasks import Example, make_task


@dataclass
class TrainResult:
    run_dir: Path
    eval_history: list[dict]  # one row per evaluation: {"step": ..., "eval/reward": ...}


class NonFiniteError(RuntimeError):
    """More than train.max_skipped_steps steps in a row had a non-finite loss or gradient."""


class Interrupted(Exception):
    """SIGTERM or Ctrl-C stopped the run after a step; its checkpoint was saved."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint: {checkpoint}")


class Trainer:
    def __init__(self, config: Config, progress: bool = True):
        self.device = distributed.init()
        W, rank = distributed.world_size(), distributed.rank()
        config.validate(world_size=W)
        # Replicated, or sharded by FSDP2 / DeepSpeed as the launcher's accelerate config says (sharding.py).
        self.parallel = sharding.from_launcher(config, W)
        self.config = config
        t, seed = config.train, config.train.seed
        # Start-up checks, cheapest first, before anything is written (checkpoint.py): the data and
        # the reward functions (a bad row or name fails here), the output folder, the model, then
        # the disk space a checkpoint of that model needs.
        self.tokenizer = load_tokenizer(config.model.name)
        self.task = make_task(config.data, seed=seed, prompt_length=lambda e: len(self.encode(e, truncate=False)))
        self.rewards = RewardSet(reward_specs(config, self.task.reward_functions))
        self.stream = self.task.train_stream()
        # Process 0 alone owns the run directory; the others learn its path (a default one is
        # stamped with process 0's clock) or its refusal, and stop with the same message.
        self.run_dir, resume_from = distributed.on_main(lambda: open_run_dir(config))
        config.train.output_dir = str(self.run_dir)

        random.seed(seed)
        np.random.seed(seed % 2**32)  # reward functions may draw from any global RNG
        torch.manual_seed(seed)  # the same on every process: they must start from the same weights
        # Each step draws one sampling seed per completion of the whole step, the same on every
        # process; a completion's tokens then depend on its seed, not on which process samples it.
        self.seed_stream = torch.Generator().manual_seed(seed)

        self.policy = load_model(config.model.name, config.model.dtype).to(self.device)
        distributed.broadcast_parameters(self.policy)
        # The reference model exists only when the KL term does (CONTEXT.md, report 1). It is the
        # initial policy, so it is copied before a checkpoint's weights are loaded. With LoRA it is
        # the policy itself with its adapters switched off: no second copy of the weights.
        self.reference = None
        if config.model.lora_rank:
            self.policy = apply_lora(self.policy, config.model, config.model.name)
            distributed.broadcast_parameters(self.policy)  # the adapters' random initialisation
        elif config.algorithm.beta > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if config.model.gradient_checkpointing:  # after the reference copy, which never trains
            enable_activation_checkpointing(self.policy)
        if t.logprob_chunk_size is not None:
            try:
                check_chunkable(self.policy)
            except ValueError as e:
                raise StartupError(str(e)) from None
        # Log-prob passes call the whole model on token ids when only such a call gathers sharded
        # weights, or when the model uses the ids for more than the embedding lookup (logprobs.py).
        self.whole_model = self.parallel.lockstep or not check_inputs_embeds(self.policy)
        # A server engine exists on process 0 alone: it generates the whole step, then shares it.
        self.remote = config.rollout.engine == "server"
        self.engine = None

        def connect() -> bool:
            self.engine = make_engine(config.rollout, self.policy, self.tokenizer,
                                      eos_token_ids(self.policy, self.tokenizer), config.model.name,
                                      lockstep=self.parallel.lockstep)
            return self.engine.exact_logprobs

        # Sampling log-probs from other kernels than the trainer's are corrected (loss.py). A server
        # that cannot be used stops every process (on_main hands process 0's error to all).
        exact = distributed.on_main(connect) if self.remote else connect()
        self.is_correction = config.rollout.is_correction and not exact

        # The global completions of a step this process owns, in update order (distributed.py).
        self.rows = distributed.shard_rows(config.completions_per_step, config.completions_per_update, W, rank)
        self.micro_batch = t.micro_batch_size or config.completions_per_update // W
        needed = checkpoint_bytes(self.policy)  # counted while every process holds the whole model
        if resume_from is not None:  # into whole weights, before sharding spreads them
            load_weights(self.policy, resume_from)
        self.policy, self.reference = self.parallel.wrap(self.policy, self.reference)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = self.parallel.make_optimizer(
            self.policy, self.params,
            # fused: one kernel over all weights; the default loop over them takes ~0.3 s a step
            # on 2 CPU cores for 135M weights, the fused one ~0.06 s (the same update to rounding).
            lambda params: torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay,
                                             fused=self.parallel.fused_adamw))
        warmup = t.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda update: min(1.0, (update + 1) / warmup) if warmup else 1.0
        )
        r = config.rollout
        self.sampling = SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k)
        self.greedy = SamplingParams(r.max_completion_length, temperature=0.0)

        def start() -> tuple[list[dict], str | None]:
            check_disk_space(self.run_dir, needed)
            return start_run_dir(self.run_dir, config, resume_from)

        # The metrics.jsonl rows kept from before the checkpoint, and what to tell the user about them.
        self.resumed_rows, note = distributed.on_main(start)
        # Everything a checkpoint restores (besides weights and optimizer).
        self.step = 0  # steps completed
        self.num_tokens = 0  # prompt + completion tokens seen so far, all processes (TRL's `num_tokens`)
        self.skipped_steps = self.skipped_in_a_row = 0
        self.num_updates = 0  # optimizer updates applied by this process's trainer (not restored)
        self.in_flight = None  # (step - 1, its captured state, num_updates) while a step runs
        if resume_from is not None:
            self.resume(resume_from)
        self.saved_step = self.step if resume_from is not None else None  # the newest checkpoint's step
        self.monitor = Monitor(self.run_dir if distributed.is_main() else None, t.max_steps,
                               RunFacts.from_config(config.to_dict()), tensorboard=config.monitor.tensorboard,
                               history=self.resumed_rows, initial=self.step, enabled=progress,
                               wandb=config.monitor.wandb and {"config": config.to_dict(),
                                                               "project": config.monitor.wandb_project})
        for line in (note, self.parallel.describe(self.policy), *getattr(self.task, "notes", ())):
            if line:
                self.monitor.write(line)

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        t = self.config.train
        history = [row for row in self.resumed_rows if "eval/reward" in row]
        if self.step == 0 and not history:
            history.append(self.evaluate(step=0))
        try:
            with _StopSignals() as signals:
                for step in range(self.step + 1, t.max_steps + 1):
                    examples = [next(self.stream) for _ in range(t.prompts_per_step)]  # the same on every process
                    self.monitor.step(self.train_step(step, examples))
                    self.step = step
                    if self.skipped_in_a_row > t.max_skipped_steps:
                        raise NonFiniteError(
                            f"the last {self.skipped_in_a_row} steps (to step {step}) all had a non-finite loss or "
                            f"gradient, more than train.max_skipped_steps={t.max_skipped_steps}: the run stopped, "
                            "their updates not applied. " + self.restart_hint()
                        )
                    if step == t.max_steps or (t.eval_every and step % t.eval_every == 0):
                        history.append(self.evaluate(step))
                    stop = signals.received()  # every process stops after the same step
                    if stop or step == t.max_steps or (t.save_every and step % t.save_every == 0):
                        checkpoint = self.save_checkpoint(step)
                    if stop and step < t.max_steps:
                        raise Interrupted(stop, step, checkpoint)
            if self.saved_step != self.step:  # train.max_steps=0
                self.save_checkpoint(self.step)
            if distributed.is_main():
                # final/: the last checkpoint's model files (hard links, not a second copy).
                link_model_files(self.run_dir / "checkpoints" / f"step-{self.saved_step}", self.run_dir / "final")
        except Exception as error:
            if not isinstance(error, NonFiniteError):  # that one keeps the checkpoints from before the streak
                self.save_after_failure()
            raise
        finally:
            self.monitor.close()
            release_run_dir(self.run_dir)
            if hasattr(self.engine, "close"):
                self.engine.close()
        return TrainResult(self.run_dir, [h for h in history if h])

    def restart_hint(self) -> str:
        if self.saved_step is None:
            return "There is no checkpoint yet. Lower train.learning_rate, or check the rewards and the data."
        checkpoint = self.run_dir / "checkpoints" / f"step-{self.saved_step}"
        return (f"The newest checkpoint, {checkpoint}, holds the weights from before. A resumed run must keep "
                f"its config: to lower train.learning_rate, start a new run from those weights "
                f"(model.name={checkpoint} and another train.output_dir), or check the rewards and the data.")

    def save_after_failure(self) -> None:
        """A failure stops the run (a reward function raised, say): save the newest consistent
        state first, so that fixing the cause and resuming loses nothing. That is the state after
        the last completed step, unless the failing step had already changed weights. One process
        only: with several, the others may be waiting in a collective."""
        if distributed.world_size() > 1:
            return
        step, captured = self.step, None
        if self.in_flight is not None:  # the failure was inside a step
            step, captured, updates = self.in_flight
            if updates != self.num_updates:
                return
        if step > (self.saved_step or 0):
            try:
                path = self.save_checkpoint(step, captured)
                self.monitor.write(f"the run stopped after step {step}; that state is saved in {path}")
            except Exception as e:  # noqa: BLE001 - the original error is the one to report
                self.monitor.write(f"saving step {step} after the failure failed too: {e}")

    def train_step(self, step: int, examples: list[Example]) -> dict:
        """Generate this process's completions for the step's `examples`, then learn from them."""
        if distributed.world_size() == 1:  # what save_after_failure() needs while the step runs
            self.in_flight = (step - 1, self.capture(step - 1), self.num_updates)
        start = time.perf_counter()
        batch = self.generate(examples)
        t_generate = time.perf_counter() - start
        metrics = self.learn(examples, batch)
        every = self.config.monitor.log_completions
        if every and step % every == 0:
            self.monitor.completions(step, distributed.gather_lists(self.samples))
        skipped = metrics.pop("skipped_updates")
        if skipped:
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            self.monitor.write(
                f"step {step}: non-finite loss or gradient (loss {metrics['loss']}, grad_norm {metrics['grad_norm']}): "
                f"{skipped} update(s) skipped, not applied ({self.skipped_in_a_row} step(s) in a row; more than "
                f"train.max_skipped_steps={self.config.train.max_skipped_steps} stop the run)"
            )
        else:
            self.skipped_in_a_row = 0
        times = torch.tensor([t_generate, metrics.pop("time/logprobs"), metrics.pop("time/update"),
                              metrics.pop("time/optimizer"), time.perf_counter() - start])
        times = distributed.all_reduce(times, "max").tolist()  # the slowest process sets the pace
        self.in_flight = None
        return {
            "step": step,
            **metrics,
            "skipped_steps": self.skipped_steps,
            "time/generate": times[0],
            "time/logprobs": times[1],
            "time/update": times[2],
            "time/optimizer": times[3],
            "step_time": times[4],
        }

    def generate(self, examples: list[Example]) -> RolloutBatch:
        """The completions this process owns (rows `self.rows` of the step), grouped by prompt."""
        G, N = self.config.rollout.num_generations, self.config.completions_per_step
        seeds = torch.randint(0, 2**62, (N,), generator=self.seed_stream)  # (N,) the whole step's
        if self.remote:  # process 0 asks for the whole step; each process keeps its rows
            self.gather_weights_for_server()
            batch = distributed.on_main(lambda: self.engine.generate(
                [self.encode(e) for e in examples], G, self.sampling, seeds.tolist()))
            return batch if distributed.world_size() == 1 else batch.select(self.rows)
        prompts, counts = torch.unique_consecutive(self.rows // G, return_counts=True)
        return self.engine.generate(
            [self.encode(examples[p]) for p in prompts.tolist()], counts.tolist(), self.sampling,
            seeds[self.rows].tolist()
        )

    def learn(self, examples: list[Example], batch: RolloutBatch) -> dict:
        """Score this process's completions `batch` (rows `self.rows` of the step), then update.

        Every statistic of the batch (advantages, every logged metric) is one of the whole step,
        over all processes.
        """
        cfg, a, G = self.config, self.config.algorithm, self.config.rollout.num_generations
        N, U = cfg.completions_per_step, cfg.completions_per_update
        owned = [examples[r // G] for r in self.rows.tolist()]
        completions = self.decode(batch, owned)
        local_rewards, local_per_function = self.rewards(
            owned, completions, batch.finish_reasons, batch.completion_id_lists()
        )  # (n,)
        # What monitor.log_completions records, for this process's completions.
        self.samples = [
            {"prompt": e.prompt, "completion": c, "finish_reason": f, "reward": r.item(),
             **{f"rewards/{name}": v[i].item() for name, v in local_per_function.items()}}
            for i, (e, c, f, r) in enumerate(zip(owned, completions, batch.finish_reasons, local_rewards))
        ]
        rewards = distributed.gather_rows(local_rewards, N, U)  # (N,) in global order
        per_function = {k: distributed.gather_rows(v, N, U) for k, v in local_per_function.items()}
        # Whole groups and the whole batch, wherever their completions were generated.
        advantages = group_advantages(rewards, G, a.scale_rewards)[self.rows]  # (n,)
        # With no KL term, a completion with advantage exactly 0 adds exactly 0 to the loss, its
        # gradient and the clip metrics: it needs no forward/backward at all. Sharded weights need
        # every process in every forward (sharding.py), so there every row runs.
        skip = a.beta == 0 and not self.parallel.lockstep
        active = advantages != 0 if skip else torch.ones_like(advantages, dtype=torch.bool)  # (n,)

        t0 = time.perf_counter()
        ref_logps = self.reference_logprobs(batch, active) if a.beta > 0 else None
        old_logps = self.batch_logprobs(self.policy, batch, active) if cfg.needs_old_logps else None
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        if hasattr(self.engine, "sleep"):  # vLLM in this process: free its memory for the update
            self.engine.sleep()
        update_metrics = self.update(batch, advantages.to(self.device), active, old_logps, ref_logps)
        t_update = time.perf_counter() - t0 - update_metrics["time/optimizer"]

        mask = batch.completion_mask.cpu()  # (n, T)
        lengths = distributed.gather_rows(mask.sum(-1).float(), N, U)  # (N,)
        truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.float32)
        truncated = distributed.gather_rows(truncated, N, U)  # (N,)
        entropies = batch.entropies if batch.entropies is not None else torch.full(mask.shape, math.nan)
        totals = distributed.all_reduce(torch.stack([
            (entropies.cpu().double() * mask).sum(),
            mask.sum().double(),
            batch.prompt_mask.sum().cpu().double() + mask.sum(),
        ])).tolist()
        self.num_tokens += int(totals[2])
        group_std = torch.stack([_std(g) for g in rewards.view(-1, G)])  # (P,) over the scored members
        return {
            **update_metrics,
            **({"entropy": totals[0] / max(totals[1], 1.0)} if batch.entropies is not None else {}),
            # NaN marks "not applicable" (None): every mean and std is over the scored completions.
            "reward": _mean(rewards),
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": (group_std == 0).float().mean().item(),
            **{f"rewards/{n}/mean": _mean(v) for n, v in per_function.items()},
            **{f"rewards/{n}/std": _std(v).item() for n, v in per_function.items()},
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
            "num_tokens": self.num_tokens,
            "time/logprobs": t_logprobs,
            "time/update": t_update,  # forward and backward passes; the optimizer's share is time/optimizer
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
        # Importance weights exist only for the tokens passed forward (active rows): their sum, count, max.
        is_sum = is_count = 0.0
        is_max = -math.inf
        num_updates = skipped = 0
        t_optimizer = 0.0  # gradient reduction, clipping and the AdamW step
        self.policy.train()
        for _ in range(a.num_iterations):
            for u0 in range(0, len(advantages), share):
                local = torch.arange(u0, u0 + share)
                # The whole update batch's counts, all processes, normalize every micro-batch's loss.
                num_tokens = distributed.all_reduce(mask[local].sum().double()).item()
                rows = local[active[local]]
                update_loss = 0.0
                micro_batches = rows.split(self.micro_batch) if len(rows) else ()  # split() of nothing gives one empty part
                for i, mb in enumerate(micro_batches):
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
                        kl_estimator=a.kl_estimator or "k3",  # null in the config means k3
                        max_completion_length=cfg.rollout.max_completion_length,
                        num_sequences=U,
                        num_tokens=num_tokens,
                        sampling_logps=batch.sampling_logps[mb].to(self.device) if self.is_correction else None,
                        is_cap=cfg.rollout.is_cap,
                    )
                    self.parallel.backward(loss, last=i == len(micro_batches) - 1)
                    update_loss += loss.item()
                    if self.is_correction:
                        is_max = max(is_max, metrics.pop(IS_MAX).item())
                        is_sum += metrics.pop(IS_MEAN).item() * num_tokens  # the metric is a sum / num_tokens
                        is_count += mask[mb].sum().item()
                    for k, v in metrics.items():
                        partial[k] += v.item()
                partial["loss"] += update_loss
                # Each process's loss is its share of the whole-batch loss: sum, never average.
                whole_loss = distributed.all_reduce(torch.tensor(update_loss, dtype=torch.float64)).item()
                shared["learning_rate"] += self.optimizer.param_groups[0]["lr"]
                # Gradients reduced over processes, clipped, applied if finite, zeroed (sharding.py);
                # a non-finite update is not applied at all (train_step counts and reports it).
                t0 = time.perf_counter()
                self.num_updates += 1  # first: a step that raises midway has changed weights (save_after_failure)
                grad_norm, applied = self.parallel.step(self.optimizer, self.params, cfg.train.max_grad_norm or math.inf,
                                                        math.isfinite(whole_loss))
                t_optimizer += time.perf_counter() - t0
                shared["grad_norm"] += grad_norm
                if applied:
                    self.scheduler.step()
                    if self.engine is not None:
                        self.engine.weights_updated()
                else:
                    self.num_updates -= 1  # nothing was applied
                    skipped += 1
                num_updates += 1
        summed = distributed.all_reduce(torch.tensor(list(partial.values()), dtype=torch.float64)).tolist()
        out = {**{k: v / num_updates for k, v in (*zip(partial, summed), *shared.items())}, "skipped_updates": skipped,
               "time/optimizer": t_optimizer}
        if self.is_correction:
            total, count = distributed.all_reduce(torch.tensor([is_sum, is_count], dtype=torch.float64)).tolist()
            out[IS_MEAN] = total / count if count else math.nan  # nan: no token needed a gradient
            top = distributed.all_reduce(torch.tensor(is_max, dtype=torch.float64), "max").item()
            out[IS_MAX] = top if count else math.nan
        return out

    # ------------------------------------------------------------------ checkpoints

    def capture(self, step: int) -> tuple[dict, dict]:
        """(RNG states, trainer state) as they are now, after `step` steps; every process calls it."""
        rng = {"processes": distributed.gather_lists([rng_state()]), "seed_stream": self.seed_stream.get_state()}
        state = {
            "step": step,
            "examples_seen": step * self.config.train.prompts_per_step,  # the data stream's position
            "num_tokens": self.num_tokens,
            "skipped_steps": self.skipped_steps,
            "skipped_in_a_row": self.skipped_in_a_row,
        }
        return rng, state

    def save_checkpoint(self, step: int, captured: tuple[dict, dict] | None = None) -> Path:
        """checkpoints/step-`step` (checkpoint.py), from this moment's state or a `captured` one
        (the weights and optimizer must not have changed since)."""
        rng, state = captured or self.capture(step)
        # Gathered by every process when sharded; whole on process 0, which writes.
        weights = self.parallel.full_weights(self.policy) if self.parallel.lockstep else None
        optimizer_state = self.parallel.optimizer_state(self.policy, self.optimizer)

        def write(folder: Path) -> None:
            save_model(self.policy, self.tokenizer, folder, weights)
            write_state_files(folder, self.config, optimizer_state, self.scheduler, rng, state)

        path = distributed.on_main(lambda: write_checkpoint(self.run_dir, step, write, self.config.train.keep_checkpoints))
        self.saved_step = step
        return path

    def resume(self, folder: Path) -> None:
        """Continue from checkpoint `folder` (its weights are loaded already): optimizer, scheduler,
        RNGs, data position, counters."""
        optimizer_state, rng, state = load_state(folder, self.scheduler)
        self.parallel.load_optimizer_state(self.policy, self.optimizer, optimizer_state)
        processes = rng["processes"]
        # Each process its own RNG state; resumed on another process count, process 0's for all.
        set_rng_state(processes[distributed.rank()] if len(processes) == distributed.world_size() else processes[0])
        self.seed_stream.set_state(rng["seed_stream"])
        self.step = state["step"]
        self.num_tokens = state["num_tokens"]
        self.skipped_steps, self.skipped_in_a_row = state["skipped_steps"], state["skipped_in_a_row"]
        self.stream = self.task.train_stream(start=state["examples_seen"])

    # ------------------------------------------------------------------ helpers

    def encode(self, example: Example, truncate: bool = True) -> list[int]:
        # data.long_prompts=truncate keeps the end; with "drop" no longer prompt is left.
        return encode_prompt(self.tokenizer, example.prompt, self.config.data.max_prompt_length if truncate else None)

    def decode(self, batch: RolloutBatch, examples: list[Example]) -> list:
        """The completions of `batch`, in TRL's shape for the prompt of each (`examples`, one per row)."""
        return decode_completions(self.tokenizer, batch, [e.prompt for e in examples])

    def logprobs(self, model, batch: RolloutBatch, rows: torch.Tensor) -> torch.Tensor:
        """Log-probs (len(rows), T) of completions `rows`, each distinct prompt run once."""
        groups, prompt_index = torch.unique(batch.prompt_index[rows], return_inverse=True)
        # One row per distinct prompt; which one does not matter, they hold the same prompt tokens.
        first = torch.empty_like(groups)
        first[prompt_index] = rows
        return completion_logprobs(
            model, batch.prompt_ids[first], batch.prompt_mask[first],
            batch.completion_ids[rows], prompt_index.to(self.device), self.config.rollout.temperature,
            chunk_size=self.config.train.logprob_chunk_size,
            # Checkpointed layers drop the key/value cache in training mode: run completions whole.
            share_prompt=not (self.config.model.gradient_checkpointing and model.training),
            whole_model=self.whole_model,
        )

    def gather_weights_for_server(self) -> None:
        """Sharded weights reach the rollout server whole: every process gathers them (a collective)
        when they changed since the last push, and process 0's client sends them."""
        if self.parallel.lockstep and distributed.on_main(lambda: self.engine.dirty):
            weights = self.parallel.full_weights(self.policy)
            if distributed.is_main():
                self.engine.gathered = weights

    def reference_logprobs(self, batch: RolloutBatch, active: torch.Tensor) -> torch.Tensor:
        """The reference model's log-probs: its own copy, or, with LoRA, the policy without adapters."""
        if self.reference is not None:
            return self.batch_logprobs(self.reference, batch, active)
        with self.policy.disable_adapter():
            return self.batch_logprobs(self.policy, batch, active)

    @torch.no_grad()
    def batch_logprobs(self, model, batch: RolloutBatch, active: torch.Tensor) -> torch.Tensor:
        """Log-probs (n, T) under `model` of the `active` completions, in micro-batches, no gradient;
        the inactive rows (never used) are 0."""
        was_training = model.training
        model.eval()
        try:
            # completion_logprobs returns float32 for 16-bit models, the model's dtype otherwise.
            dtype = torch.promote_types(model.dtype, torch.float32)
            out = torch.zeros(batch.completion_ids.shape, dtype=dtype, device=self.device)  # (n, T)
            rows = torch.nonzero(active).view(-1)
            for mb in rows.split(self.micro_batch) if len(rows) else ():
                out[mb] = self.logprobs(model, batch, mb)  # (M, T)
            return out
        finally:
            model.train(was_training)
            if hasattr(model, "reshard"):  # FSDP2: no backward follows to free the gathered outer weights
                model.reshard()

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Greedy completions on the held-out split, each process scoring its slice; gathered.

        Evaluation leaves the global RNGs as it found them (reward functions may draw from them),
        so when and how often a run evaluates never changes its training."""
        examples = self.task.eval_examples
        if not examples:
            return {}
        W, rank = distributed.world_size(), distributed.rank()
        first, last = rank * len(examples) // W, (rank + 1) * len(examples) // W
        rng = rng_state()

        def scored(first: int, last: int) -> list[dict]:
            chunk = [examples[min(i, len(examples) - 1)] for i in range(first, last)]  # padding repeats the last
            return score(self.engine, self.tokenizer, self.rewards, chunk, self.greedy,
                         first_index=first, max_prompt_length=self.config.data.max_prompt_length)

        if self.parallel.lockstep:  # equal slices (every forward is collective): the last padded, then cut
            share = -(-len(examples) // W)
            first, last = rank * share, rank * share + share
        try:
            if self.remote:  # process 0 alone talks to the server: it scores them all, and shares
                self.gather_weights_for_server()
                records = distributed.on_main(lambda: scored(0, len(examples)))
            else:
                records = distributed.gather_lists(scored(first, last))[:len(examples)]
        finally:
            set_rng_state(rng)
        metrics = summarize(records, self.rewards.names)
        self.monitor.eval(step, metrics)
        return {"step": step, **metrics}


class _StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the loop to stop after the step in flight and save a
    checkpoint. A second Ctrl-C stops at once; a second SIGTERM is ignored, because launchers
    deliver one per layer (SLURM to every task, torchrun forwarding its own) and it must not kill
    the save that the first one asked for."""

    def __init__(self):
        self.signum = 0
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def handle(self, signum, frame) -> None:
        if self.signum:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if distributed.is_main():  # os.write: safe inside a signal handler, unlike the progress bar
            os.write(2, f"\ngrpokit: {signal.Signals(signum).name} received: stopping after this step and saving "
                        "a checkpoint (Ctrl-C again to stop at once)\n".encode())

    def received(self) -> int:
        """The signal number every process agrees to stop for, 0 for none (a collective)."""
        if distributed.world_size() == 1:
            return self.signum
        return int(distributed.all_reduce(torch.tensor([self.signum]), "max").item())

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _mean(values: torch.Tensor) -> float:
    """Mean over the scored values (NaN = not applicable); NaN when none is scored."""
    scored = values[~torch.isnan(values)]
    return scored.mean().item() if scored.numel() else math.nan


def _std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the scored values; 0 with fewer than two."""
    scored = values[~torch.isnan(values)]
    return scored.std() if scored.numel() > 1 else values.new_zeros(())


def train(config: Config, progress: bool = True) -> TrainResult:
    return Trainer(config, progress=progress).train()
