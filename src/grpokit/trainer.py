"""The GRPO training loop, readable top to bottom.

One step (`train_step`):

    sampled  = rollouts.step(n, scorer)               # the step's prompts, G completions each, scored:
                                                      # ids, masks, finish reasons, rewards (N,), advantages
    ref, old = logprobs.ref(...), logprobs.old(...)   # only when beta > 0 / samples are reused
    stats    = optimize(batch, scored, old, ref)      # num_iterations x updates_per_step optimizer updates
    row      = the step's metrics

The parts: `Rollouts` (rollout/rollouts.py) is how a step's completions come to be, whatever the
engine, generating ahead, conversations or dynamic sampling; `Scorer` (scoring.py) turns them into
rewards and advantages; `LogProbs` (logprobs.py) runs every log-prob pass; the strategy
(sharding.py) holds the weights, gradients and optimizer state; `Monitor` (monitor.py) writes the
metrics. The trainer keeps the loop, the update and the checkpoints.

`prompts_per_step` prompts get `num_generations` completions each. Each optimizer update is
accumulated over micro-batches of `micro_batch_size` completions; the loss of a micro-batch is
normalized by the sequence and token counts of its whole update batch, so micro-batching (and the
number of processes) never changes the update.

Deliberate choices, stated once:
- Log-probs are computed at the sampling temperature (logits / temperature), as TRL does, so the
  ratio compares like with like.
- `old_logps` are computed (one extra forward, no gradient) only when samples become off-policy
  (num_iterations > 1 or updates_per_step > 1, or generated ahead); otherwise the ratio is
  exp(logp - logp.detach()).
- With rollout.max_staleness = k > 0, step n's completions were generated while the steps before
  it trained, with the weights after step max(0, n-1-k) (rollout/pipeline.py): `old_logps` are
  the trainer's own, before the step's first update, and the rollout importance-sampling
  correction (sampling log-probs against them) covers the lag.
- The reference model is a frozen copy of the initial policy, made only when beta > 0: with
  beta = 0 exactly it costs nothing, and any beta > 0 gets it.
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
  checkpoint of step N holds everything logged up to step N, and resuming from it (rundir.py)
  truncates metrics.jsonl to step N and continues with step N + 1.
- An optimizer update whose loss or gradient norm is not finite is not applied (neither the
  optimizer nor the learning-rate schedule steps); the step counts as skipped.
- On one process, a failure (a reward function raises, say) first saves the state after the last
  completed step, unless the failing step had already begun an optimizer update: fixing the cause
  and resuming loses nothing. (With several, the others may be waiting in a collective: nothing
  is saved, and the run resumes from its newest checkpoint.)
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpokit import distributed, sharding, signals
from grpokit.checkpoint import (checkpoint_bytes, link_model_files, load_state, load_weights, rng_state, set_rng_state,
                                write_checkpoint, write_state_files)
from grpokit.config import Config, reward_specs
from grpokit.diagnose import RunFacts
from grpokit.errors import ConfigError
from grpokit.evaluate import summarize
from grpokit.logprobs import LogProbs, check_inputs_embeds, chunk_size
from grpokit.loss import IS_MAX, IS_MEAN, IS_OUTSIDE, LossInputs, LossOutput, LossSettings, compute_loss, token_metric_names
from grpokit.models import load_policy, save_model
from grpokit.model_card import write_model_card
from grpokit.monitor import Monitor
from grpokit.rewards import RewardError, RewardSet, trainer_state
from grpokit.rollout import RolloutBatch, prompt_ids
from grpokit.rollout.agents import Agents
from grpokit.rollout.pipeline import Queued
from grpokit.rollout.rollouts import Rollouts, check_config
from grpokit.rollout.tools import Tools
from grpokit.rundir import (TrainResult, check_disk_space, clear_stop, open_run_dir, record_stop, release_run_dir,
                            start_run_dir)
from grpokit.schedule import lr_multiplier
from grpokit.scoring import Scored, Scorer, high_entropy_tokens, loss_mask, step_metrics
from grpokit.tasks import make_task
from grpokit.vision import check_vision, processing


# Steps in a row in which no reward function scored any completion that stop a run.
UNSCORED_STEPS = 3
# A checkpoint's reference model weights, with algorithm.sync_ref_model (it drifts towards the policy).
REFERENCE_FILE = "reference.pt"


class NonFiniteError(RuntimeError):
    """More than train.max_skipped_steps steps in a row had a non-finite loss or gradient."""


class Interrupted(Exception):
    """SIGTERM or Ctrl-C stopped the run after a step; its checkpoint was saved."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint: {checkpoint}")


@dataclass
class Progress:
    """The trainer's counters, restored from a checkpoint with the weights, optimizer and RNGs."""

    step: int = 0  # steps completed
    num_tokens: int = 0  # prompt + completion tokens seen so far, all processes (TRL's `num_tokens`)
    skipped_steps: int = 0  # steps with a skipped (non-finite) update
    skipped_in_a_row: int = 0
    unscored_in_a_row: int = 0  # steps in which no reward function scored any completion
    examples_seen: int = 0  # prompts drawn from the data stream (its position)
    saved_step: int | None = None  # the newest checkpoint's step (not itself saved in one)

    def trainer_state(self, config: Config, task):
        """The `trainer_state` reward functions receive now (rewards.trainer_state)."""
        size = len(getattr(task, "train_examples", ()))
        return trainer_state(config, self.step, epoch=self.examples_seen / size if size else 0.0,
                             tokens=self.num_tokens, main=distributed.is_main())


@dataclass
class UpdateStats:
    """What the optimizer updates of one step report."""

    metrics: dict[str, float]  # loss, clip ratios, kl, grad_norm, learning_rate, ...: means over the updates
    skipped_updates: int  # updates not applied (non-finite loss or gradient)
    time_optimizer: float  # seconds in gradient reduction, clipping and the AdamW step


class Trainer:
    def __init__(self, config: Config, progress: bool = True, model=None, tokenizer=None):
        """model, tokenizer: objects to train (in place) and tokenize with instead of loading
        model.name's; config.model.name then only says where they came from."""
        self.device = distributed.init()
        config.settle()  # (a Config built in Python, not loaded: what load_config does)
        config.validate(world_size=distributed.world_size())
        self.config = config
        # Replicated, or sharded by FSDP2 / DeepSpeed as the launcher's accelerate config says (sharding.py).
        self.parallel = sharding.from_launcher(config, distributed.world_size())
        # Start-up checks, cheapest first, before anything is written: the data and the reward
        # functions (a bad row or name fails here), the output folder, the model, then the disk
        # space a checkpoint of that model needs.
        # vision: a vision-language model's processor and what its passes need (vision.py); None for text.
        self.tokenizer, self.vision = processing(config.model.name, tokenizer)
        self.tools = Tools.from_config(config, self.tokenizer)  # None: single-turn rollouts
        if self.vision is not None and config.model.chat_template:  # the template prompts are rendered with
            self.vision.processor.chat_template = self.tokenizer.chat_template
        check_config(config, self.tools, self.parallel.lockstep, vision=self.vision is not None)
        if config.algorithm.sync_ref_model and self.parallel.lockstep:
            raise ConfigError("algorithm.sync_ref_model with sharded weights (FSDP2, ZeRO-3) is not supported: the "
                              "reference is mixed with the policy weight by weight; use data parallelism")
        self.task, self.rewards = self._task_and_rewards()
        # Process 0 alone owns the run directory; the others learn its path (a default one is
        # stamped with process 0's clock) or its refusal, and stop with the same message.
        existed = config.train.output_dir is not None and Path(config.train.output_dir).exists()
        self.run_dir, resume_from, damaged = distributed.on_main(lambda: open_run_dir(config))
        with _removed_if_refused(self.run_dir, existed):  # a refused start leaves no empty folder behind
            config.train.output_dir = str(self.run_dir)
            seed_stream = _seed_everything(config.train.seed)
            self.policy, self.reference = load_policy(config, self.device, model)
            check_vision(self.policy, self.vision)
            self._check_context()
            # Log-prob passes call the whole model on token ids when only such a call gathers sharded
            # weights, or when the model uses the ids for more than the embedding lookup (logprobs.py).
            whole_model = self.parallel.lockstep or not check_inputs_embeds(self.policy)
            chunk = chunk_size(config.train.logprob_chunk_size, self.policy, self.device, self.vision)
            self.rollouts = Rollouts(config, self.task, self.tokenizer, self.tools, self.policy, self.parallel,
                                     self.device, seed_stream, self.vision)
            self.scorer = Scorer(config, self.tokenizer, self.rewards, self.rollouts.rows, self.device,
                                 self.parallel.lockstep)
            self.checkpoint_size = self._checkpoint_size()  # counted while every process holds the whole model
            if resume_from is not None:  # into whole weights, before sharding spreads them
                load_weights(self.policy, resume_from)
            self.policy, self.reference = self.parallel.wrap(self.policy, self.reference)
            self.params = [p for p in self.policy.parameters() if p.requires_grad]
            self.optimizer, self.scheduler = self._make_optimizer()
            self.logprobs = LogProbs(self.policy, self.reference, config.rollout.temperature,
                                     chunk, config.model.gradient_checkpointing, whole_model,
                                     config.micro_batch_size(distributed.world_size()), self.device, self.vision)
            self.loss_settings = LossSettings.from_config(config)
            # The metrics.jsonl rows kept from before the checkpoint, and what to tell the user about them.
            self.resumed_rows, note = distributed.on_main(lambda: self._start_run_dir(resume_from))
        self.progress = Progress() if resume_from is None else self.resume(resume_from)
        self.monitor = self._make_monitor(progress)
        for line in (*damaged, note, self.parallel.describe(self.policy), *getattr(self.task, "notes", ())):
            if line:
                self.monitor.write(line)

    # ------------------------------------------------------------------ start-up, in order

    def _task_and_rewards(self) -> tuple[object, RewardSet]:
        """The task (its data read and checked) and the reward functions, checked against its first row."""
        config, tools = self.config, self.tools
        task = make_task(config.data, config.train.seed,
                         lambda e: len(prompt_ids(self.tokenizer, tools, e, vision=self.vision)))
        first = next(task.train_stream())
        if tools is not None:
            tools.check({"prompt": first.prompt, **first.columns}, getattr(task, "prompts_from_reset", False))
        rewards = RewardSet(reward_specs(config, task.reward_functions), config.reward.timeout,
                            extra=Tools.rewards(tools) + Agents.rewards(config))
        rewards.check_arguments(first.columns, environments=(tools is not None and tools.environment is not None)
                                or config.rollout.agent is not None)
        return task, rewards

    def _check_context(self) -> None:
        """Every prompt and its completion fit the model's positions, or data.max_prompt_length
        makes them: a longer sequence would train on positions the model never learned."""
        config = getattr(self.policy, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a vision-language model's
        limit = getattr(text, "max_position_embeddings", None)
        if not isinstance(limit, int):
            return
        d, length = self.config.data, self.config.rollout.max_completion_length
        budget = limit - length  # what a prompt may hold
        if budget < 1:
            raise ConfigError(f"rollout.max_completion_length={length} leaves no room for a prompt in the model's "
                              f"{limit} positions: lower it")
        if d.max_prompt_length is not None:
            if d.max_prompt_length > budget:
                raise ConfigError(f"data.max_prompt_length={d.max_prompt_length} + rollout.max_completion_length="
                                  f"{length} exceeds the model's {limit} positions: lower one of them")
            return
        examples = [*getattr(self.task, "train_examples", ()), *self.task.eval_examples]  # a built-in stream: its eval split
        lengths = [len(prompt_ids(self.tokenizer, self.tools, e, vision=self.vision)) for e in examples]
        over = [n for n in lengths if n > budget]
        if over:
            raise ConfigError(
                f"{len(over)} of the {len(lengths)} prompts are longer than the {budget} tokens that the model's {limit} "
                f"positions leave beside rollout.max_completion_length={length} (the longest: {max(over)}): set "
                f"data.max_prompt_length={budget} (data.long_prompts=drop leaves them out, truncate keeps their end)")

    def _checkpoint_size(self) -> int:
        """The bytes a checkpoint takes: the policy, and with algorithm.sync_ref_model the moved reference."""
        size = checkpoint_bytes(self.policy)
        return size + checkpoint_bytes(self.reference) if self.config.algorithm.sync_ref_model else size

    def _make_optimizer(self):
        """AdamW (fused: one kernel over all weights, where the strategy allows it) and its
        learning-rate schedule (schedule.py): linear warm-up over train.warmup_steps updates, then
        train.lr_scheduler over the run's max_steps x updates_per_step x num_iterations updates."""
        t = self.config.train
        optimizer = self.parallel.make_optimizer(
            self.policy, self.params,
            lambda params: torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay,
                                             fused=self.parallel.fused_adamw))
        total = t.max_steps * t.updates_per_step * self.config.algorithm.num_iterations
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda update: lr_multiplier(t.lr_scheduler, update, t.warmup_steps, total))
        return optimizer, scheduler

    def _start_run_dir(self, resume_from: Path | None) -> tuple[list[dict], str | None]:
        check_disk_space(self.run_dir, self.config, self.checkpoint_size)
        return start_run_dir(self.run_dir, self.config, resume_from)

    def _make_monitor(self, progress: bool) -> Monitor:
        c = self.config
        return Monitor(self.run_dir if distributed.is_main() else None, c.train.max_steps,
                       RunFacts.from_config(c.to_dict()), tensorboard=c.monitor.tensorboard,
                       history=self.resumed_rows, initial=self.progress.step, enabled=progress,
                       wandb=c.monitor.wandb and {"config": c.to_dict(), "project": c.monitor.wandb_project},
                       trackio=c.monitor.trackio and {"config": c.to_dict(), "project": c.monitor.trackio_project})

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        history = [row for row in self.resumed_rows if "eval/reward" in row]
        failure = _FailureSave(self.optimizer)  # what a failure saves
        try:
            if distributed.is_main():
                clear_stop(self.run_dir)
            if self.progress.step == 0 and not history:
                history.append(self.evaluate(step=0))
            with signals.StopSignals(distributed.is_main()):
                for step in range(self.progress.step + 1, self.config.train.max_steps + 1):
                    self._run_step(step, history, failure)
            if self.progress.saved_step != self.progress.step:  # train.max_steps=0
                self.save_checkpoint()
            if distributed.is_main():
                self._finish(history)
        except BaseException as error:
            # One process only: with several, the others may be waiting in a collective. A
            # NonFiniteError keeps the checkpoints from before the streak; Ctrl-C twice stops at once.
            if distributed.world_size() == 1 and isinstance(error, Exception) and not isinstance(error, NonFiniteError):
                captured = failure.state(self.capture)
                if captured is not None:
                    self.save_after_failure(captured)
            if distributed.is_main():
                record_stop(self.run_dir, self.progress.step, self.progress.saved_step, error)
            raise
        else:
            if distributed.is_main():
                record_stop(self.run_dir, self.progress.step, self.progress.saved_step, None)
        finally:
            failure.close()
            self.monitor.close()
            release_run_dir(self.run_dir)
            self.rollouts.close()  # last: closing a server's weight group may wait on it
        return TrainResult(self.run_dir, [h for h in history if h], self.config.model.dtype)

    def _run_step(self, step: int, history: list[dict], failure: _FailureSave) -> None:
        """Step `step`, then its metrics row, its evaluation (if due) and its checkpoint (if due, or
        if a stop was asked for)."""
        t = self.config.train
        if distributed.world_size() == 1:  # (capturing is a collective: never after a failure)
            failure.step_begins(self.capture())
        row = self.train_step(step)
        failure.step_ends()
        self.monitor.step(row)
        if self.progress.skipped_in_a_row > t.max_skipped_steps:
            raise NonFiniteError(
                f"the last {self.progress.skipped_in_a_row} steps (to step {step}) all had a non-finite "
                f"loss or gradient, more than train.max_skipped_steps={t.max_skipped_steps}: the run "
                "stopped, their updates not applied. " + self.restart_hint()
            )
        if step == t.max_steps or (t.eval_every and step % t.eval_every == 0):
            history.append(self.evaluate(step))
        stop = _agreed_stop()  # every process stops after the same step
        if stop or step == t.max_steps or (t.save_every and step % t.save_every == 0):
            checkpoint = self.save_checkpoint()
        if stop and step < t.max_steps:
            raise Interrupted(stop, step, checkpoint)

    def _finish(self, history: list[dict]) -> None:
        """final/: the last checkpoint's model files (hard links, not a second copy), and the model card."""
        link_model_files(self.run_dir / "checkpoints" / f"step-{self.progress.saved_step}", self.run_dir / "final")
        try:  # the run is trained and saved: a card that cannot be written is a warning, not a failure
            write_model_card(self.run_dir, self.config.to_dict(), [h for h in history if h], self.rewards.names)
        except Exception as e:
            self.monitor.write(f"warning: the model card (final/README.md) was not written: {type(e).__name__}: {e}")

    def train_step(self, step: int) -> dict:
        """Step `step` (the same on every process): its metrics row."""
        a = self.config.algorithm
        self.rollouts.queue(step)  # generating ahead: the steps to step + k queued (not the step's time)
        start = time.perf_counter()
        sampled = self.rollouts.step(step, self.scorer, self.progress.trainer_state(self.config, self.task))
        batch, scored = sampled.batch, sampled.scored
        if sampled.note:
            self.monitor.write(sampled.note)
        t_generate = time.perf_counter() - start  # with the reward functions' time
        self.check_scored(step, scored)

        t0 = time.perf_counter()
        ref_logps = self.logprobs.ref(batch, scored.active) if a.beta > 0 else None  # (n, T)
        old_logps = self.logprobs.old(batch, scored.active) if self.config.needs_old_logps else None  # (n, T)
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.rollouts.before_update()
        stats = self.optimize(batch, scored, old_logps, ref_logps)
        t_update = time.perf_counter() - t0 - stats.time_optimizer  # forward and backward passes

        rollout, tokens = step_metrics(self.config, batch, scored)
        every = self.config.monitor.log_completions
        if every and step % every == 0:
            self.monitor.completions(step, distributed.gather_lists(scored.samples))
        logged = distributed.means(scored.logged)  # the reward functions' log_metric values
        self.count_step(step, tokens, scored, stats, sampled.drawn)
        times = torch.tensor([t_generate, t_logprobs, t_update, stats.time_optimizer, time.perf_counter() - start])
        times = distributed.all_reduce(times, "max").tolist()  # the slowest process sets the pace
        return {
            "step": step,
            **stats.metrics,
            **rollout,
            **sampled.metrics,
            **logged,
            "num_tokens": self.progress.num_tokens,
            "skipped_steps": self.progress.skipped_steps,
            **dict(zip(("time/generate", "time/logprobs", "time/update", "time/optimizer", "step_time"), times)),
        }

    # ------------------------------------------------------------------ the phases of a step

    def check_scored(self, step: int, scored: Scored) -> None:
        """A step in which every reward function returned None for every completion teaches nothing:
        say so at once, and stop (before its update) once UNSCORED_STEPS steps in a row were so."""
        if scored.any_scored:
            return
        in_a_row = self.progress.unscored_in_a_row + 1
        names = ", ".join(self.rewards.names)
        if in_a_row >= UNSCORED_STEPS:
            raise RewardError(f"the reward functions ({names}) scored no completion in {in_a_row} steps in a row "
                              f"(to step {step}): every value was None. Check what they return for this data.")
        self.monitor.write(f"step {step}: the reward functions ({names}) scored none of the {len(scored.rewards)} "
                           f"completions (every value None): nothing to learn from; {UNSCORED_STEPS} such steps in a "
                           "row stop the run")

    def optimize(self, batch: RolloutBatch, scored: Scored, old_logps: torch.Tensor | None,
                 ref_logps: torch.Tensor | None) -> UpdateStats:
        """num_iterations x updates_per_step optimizer updates on this process's completions.

        old_logps / ref_logps: (n, T) or None. This process's rows are in update order: update u
        uses local rows [u*S, (u+1)*S), S = completions_per_update / processes.
        """
        cfg, a = self.config, self.config.algorithm
        share = cfg.completions_per_update // distributed.world_size()
        # Only the model's own tokens are trained (not a conversation's tool results).
        mask = loss_mask(batch, a.mask_truncated_completions)  # (n, T)
        metrics = _LossMetrics(token_metric_names(a.loss_type, self.loss_settings),
                               IS_OUTSIDE[self.loss_settings.is_mode] if self.rollouts.is_correction else None)
        skipped, t_optimizer = 0, 0.0
        self.policy.train()
        for _ in range(a.num_iterations):
            for u0 in range(0, len(scored.advantages), share):
                update_loss = self._accumulate(batch, scored, mask, torch.arange(u0, u0 + share), old_logps,
                                               ref_logps, metrics)
                # Each process's loss is its share of the whole-batch loss: sum, never average.
                whole_loss = distributed.all_reduce(torch.tensor(update_loss, dtype=torch.float64)).item()
                learning_rate = self.optimizer.param_groups[0]["lr"]  # this update's
                # Gradients reduced over processes, clipped, applied if finite, dropped (sharding.py).
                t0 = time.perf_counter()
                grad_norm, applied = self.parallel.step(self.optimizer, self.params, cfg.train.max_grad_norm or math.inf,
                                                        math.isfinite(whole_loss))
                t_optimizer += time.perf_counter() - t0
                metrics.add_update(update_loss, grad_norm, learning_rate)
                if applied:
                    self.scheduler.step()
                    self.rollouts.weights_changed()
                    if a.sync_ref_model and self.scheduler.last_epoch % a.ref_model_sync_steps == 0:
                        self.sync_reference()
                else:
                    skipped += 1
        return UpdateStats(metrics.result(), skipped, t_optimizer)

    def _accumulate(self, batch: RolloutBatch, scored: Scored, mask: torch.Tensor, local: torch.Tensor,
                    old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None, metrics: _LossMetrics) -> float:
        """The forward and backward passes of one update, on this process's rows `local` of it, in
        micro-batches, their gradients accumulated: this process's share of the update's loss."""
        cfg, a = self.config, self.config.algorithm
        # The whole update batch's counts, all processes, normalize every micro-batch's loss.
        num_tokens = distributed.all_reduce(mask[local].sum().double()).item()
        policy_mask = None
        if a.top_entropy_quantile < 1:  # (n, T)
            policy_mask = high_entropy_tokens(batch, mask, local, a.top_entropy_quantile, cfg.rollout.engine)
        rows = local[scored.active[local]]
        update_loss = 0.0
        # split() of nothing gives one empty part
        micro_batches = rows.split(cfg.micro_batch_size(distributed.world_size())) if len(rows) else ()
        for i, mb in enumerate(micro_batches):
            out = compute_loss(a.loss_type, LossInputs(
                logps=self.logprobs.of(self.policy, batch, mb),  # (M, T)
                mask=mask[mb],
                advantages=scored.advantages[mb],
                old_logps=None if old_logps is None else old_logps[mb],
                ref_logps=None if ref_logps is None else ref_logps[mb],
                sampling_logps=batch.sampling_logps[mb].to(self.device) if self.rollouts.is_correction else None,
                policy_mask=None if policy_mask is None else policy_mask[mb],
                num_sequences=cfg.completions_per_update,
                num_tokens=num_tokens,
                max_completion_length=cfg.rollout.max_completion_length,
            ), self.loss_settings)
            self.parallel.backward(out.loss, last=i == len(micro_batches) - 1)
            update_loss += out.loss.item()
            metrics.add_micro_batch(out, mask[mb], num_tokens)
        return update_loss

    @torch.no_grad()
    def sync_reference(self) -> None:
        """algorithm.sync_ref_model (TR-DPO): ref = alpha * policy + (1 - alpha) * ref, weight by weight."""
        alpha = self.config.algorithm.ref_model_mixup_alpha
        for ref, weight in zip(self.reference.parameters(), self.policy.parameters(), strict=True):
            ref.mul_(1 - alpha).add_(weight.detach(), alpha=alpha)

    def count_step(self, step: int, tokens: int, scored: Scored, stats: UpdateStats, prompts: int) -> None:
        """Step `step`, which drew `prompts` prompts from the data stream, is complete: advance the
        counters, and say so if it skipped an update."""
        p = self.progress
        p.step = step
        p.num_tokens += tokens
        p.examples_seen += prompts
        p.unscored_in_a_row = 0 if scored.any_scored else p.unscored_in_a_row + 1
        if not stats.skipped_updates:
            p.skipped_in_a_row = 0
            return
        p.skipped_steps += 1
        p.skipped_in_a_row += 1
        self.monitor.write(
            f"step {step}: non-finite loss or gradient (loss {stats.metrics['loss']}, grad_norm "
            f"{stats.metrics['grad_norm']}): {stats.skipped_updates} update(s) skipped, not applied "
            f"({p.skipped_in_a_row} step(s) in a row; more than train.max_skipped_steps="
            f"{self.config.train.max_skipped_steps} stop the run)"
        )

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Greedy completions on the held-out split, scored and gathered (Rollouts.evaluate).

        Evaluation leaves the global RNGs as it found them (reward functions may draw from them),
        so when and how often a run evaluates never changes its training."""
        examples = self.task.eval_examples
        if not examples:
            return {}
        rng = rng_state()
        logged = {}  # the reward functions' log_metric values, this process's
        try:
            records = self.rollouts.evaluate(step, examples, self.rewards,
                                             self.progress.trainer_state(self.config, self.task), logged)
        finally:
            set_rng_state(rng)
        metrics = {**summarize(records, self.rewards.names),
                   **{f"eval/{name}": value for name, value in distributed.means(logged).items()}}
        self.monitor.eval(step, metrics)
        return {"step": step, **metrics}

    # ------------------------------------------------------------------ checkpoints

    def capture(self) -> tuple[dict, dict, list[Queued]]:
        """(RNG states, trainer state, the steps queued ahead) as they are now; every process calls
        it (a collective)."""
        rng = {"processes": distributed.gather_lists([rng_state()]),
               "seed_stream": self.rollouts.seed_stream.get_state()}
        p = self.progress
        state = {
            "step": p.step,
            "examples_seen": p.examples_seen,  # the data stream's position
            "num_tokens": p.num_tokens,
            "skipped_steps": p.skipped_steps,
            "skipped_in_a_row": p.skipped_in_a_row,
            "unscored_in_a_row": p.unscored_in_a_row,
        }
        # The steps generated ahead: saved with the checkpoint, their prompts after examples_seen.
        return rng, state, self.rollouts.pending()

    def save_checkpoint(self, captured: tuple[dict, dict, list[Queued]] | None = None) -> Path:
        """checkpoints/step-N (checkpoint.py) from this moment's state, or from a `captured` one
        (the weights and optimizer must not have changed since)."""
        rng, state, pending = captured or self.capture()
        # Gathered by every process when sharded; whole on process 0, which writes.
        weights = self.parallel.full_weights(self.policy) if self.parallel.lockstep else None
        optimizer_state = self.parallel.optimizer_state(self.policy, self.optimizer)

        def write(folder: Path) -> None:
            save_model(self.policy, self.tokenizer if self.vision is None else self.vision.processor, folder, weights)
            if self.config.algorithm.sync_ref_model:  # the reference has moved from the initial policy
                torch.save(self.reference.state_dict(), folder / REFERENCE_FILE)
            self.rollouts.save(folder, pending)
            write_state_files(folder, self.config, optimizer_state, self.scheduler, rng, state)

        path = distributed.on_main(
            lambda: write_checkpoint(self.run_dir, state["step"], write, self.config.train.keep_checkpoints,
                                     self.checkpoint_size))
        self.progress.saved_step = state["step"]
        return path

    def save_after_failure(self, captured: tuple[dict, dict, list[Queued]]) -> None:
        """A failure stops the run: save `captured`, the newest state the weights still match, if
        no checkpoint holds it yet, so that fixing the cause and resuming loses nothing."""
        step = captured[1]["step"]
        if step > (self.progress.saved_step or 0):
            try:
                path = self.save_checkpoint(captured)
                failed = [q.step for q in captured[2] if q.failed()]
                again = f" (generating step(s) {failed} ahead failed: a resumed run generates them again, with " \
                        "that checkpoint's weights)" if failed else ""
                self.monitor.write(f"the run stopped after step {step}; that state is saved in {path}{again}")
            except Exception as e:  # noqa: BLE001 - the original error is the one to report
                self.monitor.write(f"saving step {step} after the failure failed too: {e}")

    def restart_hint(self) -> str:
        if self.progress.saved_step is None:
            return "There is no checkpoint yet. Lower train.learning_rate, or check the rewards and the data."
        checkpoint = self.run_dir / "checkpoints" / f"step-{self.progress.saved_step}"
        return (f"The newest checkpoint, {checkpoint}, holds the weights from before. A resumed run must keep "
                f"its config: to lower train.learning_rate, start a new run from those weights "
                f"(model.name={checkpoint} and another train.output_dir), or check the rewards and the data.")

    def resume(self, folder: Path) -> Progress:
        """Continue from checkpoint `folder` (its weights are loaded already): optimizer, scheduler,
        RNGs, data position and the steps generated ahead; its counters."""
        optimizer_state, rng, state = load_state(folder, self.scheduler)
        if self.config.algorithm.sync_ref_model:
            self.reference.load_state_dict(torch.load(folder / REFERENCE_FILE, map_location="cpu", weights_only=True))
        self.parallel.load_optimizer_state(self.policy, self.optimizer, optimizer_state)
        processes = rng["processes"]
        # Each process its own RNG state; resumed on another process count, process 0's for all.
        set_rng_state(processes[distributed.rank()] if len(processes) == distributed.world_size() else processes[0])
        self.rollouts.resume(folder, rng["seed_stream"], state["examples_seen"])
        return Progress(state["step"], state["num_tokens"], state["skipped_steps"], state["skipped_in_a_row"],
                        state.get("unscored_in_a_row", 0),  # (not in checkpoints of older versions)
                        state["examples_seen"], saved_step=state["step"])


class _FailureSave:
    """What a failure saves: while a step runs, the state from before it (captured as it starts),
    as long as no optimizer update of the step has begun (counted by a hook on the optimizer);
    between steps, the state as it is."""

    def __init__(self, optimizer):
        self.updates_begun = 0
        self.hook = optimizer.register_step_pre_hook(self._count)
        self.before = None  # (state before the running step, updates begun before it)

    def _count(self, *_) -> None:
        self.updates_begun += 1

    def step_begins(self, captured) -> None:
        self.before = captured, self.updates_begun

    def step_ends(self) -> None:
        self.before = None

    def state(self, capture):
        """The state to save (capture() between steps), or None: the failing step changed the weights."""
        if self.before is None:
            return capture()
        captured, begun = self.before
        return captured if begun == self.updates_begun else None

    def close(self) -> None:
        self.hook.remove()


class _LossMetrics:
    """The loss's metrics over one step's optimizer updates, normalized here and only here.

    Per update: each token-summed metric (clip ratios, kl) divided by the update's token count,
    the loss as summed over its micro-batches, the gradient norm and learning rate. Then the mean
    over the updates, with every process's share summed. The rollout importance weight's mean and
    out-of-bounds share are over the tokens that had a forward pass, its max over all of them."""

    def __init__(self, names: tuple[str, ...], outside: str | None):
        """names: the loss's token-summed metrics (loss.token_metric_names); outside: the importance
        weight's out-of-bounds metric (loss.IS_OUTSIDE) when the weight is on, else None."""
        self.names = names
        self.sums = dict.fromkeys(("loss", *names), 0.0)  # this process's shares
        self.shared = {"grad_norm": 0.0, "learning_rate": 0.0}  # the same on every process
        self.corrected = () if outside is None else (IS_MEAN, outside)
        self.counted = dict.fromkeys(self.corrected, 0.0)  # summed over the tokens that had a forward pass
        self.is_count = 0.0
        self.is_max = -math.inf
        self.updates = 0

    def add_micro_batch(self, out: LossOutput, mask: torch.Tensor, num_tokens: float) -> None:
        """mask: (M, T) the micro-batch's; num_tokens: its whole update's, all processes."""
        undeclared = out.token_sums.keys() - {*self.names, *self.corrected}
        if undeclared:
            raise ValueError(f"the loss returned metrics {sorted(undeclared)} that loss.token_metric_names does not name")
        for name in self.names:
            self.sums[name] += (out.token_sums[name] / max(num_tokens, 1.0)).item()
        if self.corrected:
            for name in self.corrected:
                self.counted[name] += out.token_sums[name].item()
            self.is_count += mask.sum().item()
            self.is_max = max(self.is_max, out.token_max[IS_MAX].item())

    def add_update(self, loss: float, grad_norm: float, learning_rate: float) -> None:
        self.sums["loss"] += loss
        self.shared["grad_norm"] += grad_norm
        self.shared["learning_rate"] += learning_rate
        self.updates += 1

    def result(self) -> dict[str, float]:
        """The metrics of the step (a collective)."""
        summed = distributed.all_reduce(torch.tensor(list(self.sums.values()), dtype=torch.float64)).tolist()
        out = {k: v / self.updates for k, v in (*zip(self.sums, summed), *self.shared.items())}
        if self.corrected:
            *totals, count = distributed.all_reduce(
                torch.tensor([*self.counted.values(), self.is_count], dtype=torch.float64)).tolist()
            for name, total in zip(self.corrected, totals):
                out[name] = total / count if count else math.nan  # nan: no token needed a gradient
            top = distributed.all_reduce(torch.tensor(self.is_max, dtype=torch.float64), "max").item()
            out[IS_MAX] = top if count else math.nan
        return out


def _agreed_stop() -> int:
    """The signal number every process agrees to stop for, 0 for none (a collective)."""
    if distributed.world_size() == 1:
        return signals.requested()
    return int(distributed.all_reduce(torch.tensor([signals.requested()]), "max").item())


@contextlib.contextmanager
def _removed_if_refused(run_dir: Path, existed: bool):
    """A start-up refusal inside leaves no folder it created behind (process 0 owns it)."""
    try:
        yield
    except BaseException:
        if not existed and distributed.is_main() and run_dir.is_dir() and not any(run_dir.iterdir()):
            release_run_dir(run_dir)
            run_dir.rmdir()
        raise


def _seed_everything(seed: int) -> torch.Generator:
    """Seed every global RNG, the same on every process (they must start from the same weights);
    return the stream each step draws one sampling seed per completion from, so that what a
    completion samples depends on its seed, not on which process samples it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # reward functions may draw from any global RNG
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
