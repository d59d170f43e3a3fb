"""The GRPO training loop, readable top to bottom.

One step (`train_step`):

    sampled  = rollouts.step(n, scorer)               # the step's prompts, G completions each, scored:
                                                      # ids, masks, finish reasons, rewards (N,), advantages
    ref, old = logprobs.ref(...), logprobs.old(...)   # only when beta > 0 / samples are reused
    stats    = optimize(batch, scored, old, ref)      # num_iterations x updates_per_step optimizer updates
    row      = the step's metrics

The parts, wired by setup.py: `Rollouts` (sampling/rollouts.py) is how a step's completions come
to be, whatever the engine, generating ahead, the rollout kind or dynamic sampling; `Scorer`
(sampling/scoring.py) turns them into rewards and advantages; `LogProbs` (models/logprobs.py) runs
every log-prob pass; the strategy (sharding.py) holds the weights, gradients and optimizer state;
`Monitor` (rundir/monitor.py) writes the metrics. The trainer keeps the loop, the update and the
checkpoints; state.py its counters and what a failure saves, metrics.py the step's metrics.

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
  it trained, with the weights after step max(0, n-1-k) (sampling/pipeline.py): `old_logps` are
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
- On several processes (see runtime/distributed.py) every process draws the same prompts, generates and
  scores only the completions it owns, and takes part in every reduction; process 0 alone writes.
- After step N: its metrics row, then its evaluation (if due), then its checkpoint (if due). So a
  checkpoint of step N holds everything logged up to step N, and resuming from it (rundir/folder.py)
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

from grpokit.algorithm.loss import IS_OUTSIDE, LossInputs, compute_loss, token_metric_names
from grpokit.algorithm.masks import high_entropy_tokens, loss_mask
from grpokit.algorithm.schedule import lr_multiplier
from grpokit.config.schema import Config
from grpokit.models.loading import load_policy, save_model
from grpokit.models.logprobs import LogProbs, check_inputs_embeds, chunk_size
from grpokit.models.vision import check_vision
from grpokit.models.teacher import load_teacher, token_records
from grpokit.rewards.reward_set import RewardError
from grpokit.rollout.batch import RolloutBatch
from grpokit.rundir.checkpoint import (checkpoint_bytes, link_model_files, load_state, load_weights, rng_state,
                                       set_rng_state, write_checkpoint, write_state_files)
from grpokit.rundir.diagnose import RunFacts
from grpokit.rundir.folder import (TrainResult, check_disk_space, clear_stop, open_run_dir, record_stop,
                                   release_run_dir, start_run_dir)
from grpokit.rundir.model_card import write_model_card
from grpokit.rundir.monitor import Monitor
from grpokit.runtime import distributed, signals
from grpokit.sampling.evaluation import summarize
from grpokit.sampling.rollouts import Pending, Rollouts
from grpokit.sampling.scoring import Scored, Scorer
from grpokit.training import setup, sharding
from grpokit.training.metrics import LossMetrics, Pushes, Waste, step_metrics
from grpokit.training.state import FailureSave, Progress


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
        self.config = config
        # Every rule about the settings, against the launch and the model, before anything is read
        # or written (config/checks.py); then the data and the reward functions (a bad row or name
        # fails here), the output folder, the model, then the disk space a checkpoint of it needs.
        facts = setup.checked_facts(config, model, tokenizer)
        # Replicated, or sharded by FSDP2 / DeepSpeed as the launcher's accelerate config says (sharding.py).
        self.parallel = sharding.from_launch(config, facts.launch)
        # vision: a vision-language model's processor and what its passes need (models/vision.py); None for text.
        prepared = setup.prepare(config, tokenizer, model_facts=facts.model, model=model)
        self.tokenizer, self.vision, self.task, self.rewards = (prepared.tokenizer, prepared.vision, prepared.task,
                                                                prepared.rewards)
        memory = setup.memory_line(config, facts, prepared, self.device, model)  # refused here when it cannot fit
        # Process 0 alone owns the run directory; the others learn its path (a default one is
        # stamped with process 0's clock) or its refusal, and stop with the same message.
        existed = config.train.output_dir is not None and Path(config.train.output_dir).exists()
        self.run_dir, resume_from, damaged = distributed.on_main(lambda: open_run_dir(config))
        with _removed_if_refused(self.run_dir, existed):  # a refused start leaves no empty folder behind
            config.train.output_dir = str(self.run_dir)
            seed_stream = _seed_everything(config.train.seed)
            self.policy, self.reference = load_policy(config, self.device, model)
            check_vision(self.policy, self.vision)
            self.teacher = None if config.distill.teacher is None else load_teacher(
                config.distill.teacher, config.model.name, self.tokenizer, config.model.dtype, self.device,
                config.distill.timeout)
            # Log-prob passes call the whole model on token ids when only such a call gathers sharded
            # weights, or when the model uses the ids for more than the embedding lookup (models/logprobs.py).
            whole_model = self.parallel.lockstep or not check_inputs_embeds(self.policy)
            chunk = chunk_size(config.train.logprob_chunk_size, self.policy, self.device, self.vision)
            self.rollouts = Rollouts(config, self.task, setup.make_kind(config, prepared, self.policy), self.tokenizer,
                                     self.policy, self.parallel, self.device, seed_stream, self.vision)
            balance, routed = setup.router_balance(config, self.policy)  # the load-balancing term's weight, experts
            self.scorer = Scorer(config, self.tokenizer, self.rewards, self.rollouts.rows, self.device,
                                 self.parallel.lockstep, balance > 0)
            self.checkpoint_size = self._checkpoint_size()  # counted while every process holds the whole model
            if resume_from is not None:  # into whole weights, before sharding spreads them
                load_weights(self.policy, resume_from)
            self.policy, self.reference = self.parallel.wrap(self.policy, self.reference)
            self.params = [p for p in self.policy.parameters() if p.requires_grad]
            self.optimizer, self.scheduler = self._make_optimizer()
            self.logprobs = LogProbs(self.policy, self.reference, config.rollout.temperature,
                                     chunk, config.model.gradient_checkpointing, whole_model,
                                     config.micro_batch_size(distributed.world_size()), self.device, self.vision,
                                     setup.micro_batch_tokens(config, self.vision is not None), self.parallel.lockstep,
                                     routed)
            self.loss_settings = setup.loss_settings(config, self.policy)
            self.waste, self.pushes = Waste(self.rollouts, self.logprobs), Pushes(self.rollouts)
            # The metrics.jsonl rows kept from before the checkpoint, and what to tell the user about them.
            self.resumed_rows, note = distributed.on_main(lambda: self._start_run_dir(resume_from))
        self.progress = Progress() if resume_from is None else self.resume(resume_from)
        self.monitor = self._make_monitor(progress)
        for line in (*damaged, note, memory, self.parallel.describe(self.policy), *getattr(self.task, "notes", ())):
            if line:
                self.monitor.write(line)

    # ------------------------------------------------------------------ start-up, in order

    def _checkpoint_size(self) -> int:
        """The bytes a checkpoint takes: the policy, and with algorithm.sync_ref_model the moved reference."""
        size = checkpoint_bytes(self.policy)
        return size + checkpoint_bytes(self.reference) if self.config.algorithm.sync_ref_model else size

    def _make_optimizer(self):
        """AdamW (fused: one kernel over all weights, where the strategy allows it) and its
        learning-rate schedule (algorithm/schedule.py): linear warm-up over train.warmup_steps updates, then
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
        failure = FailureSave(self.optimizer)  # what a failure saves
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

    def _run_step(self, step: int, history: list[dict], failure: FailureSave) -> None:
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
        self.waste.start()
        self.pushes.start()
        start = time.perf_counter()
        sampled = self.rollouts.step(step, self.scorer, self.progress.trainer_state(self.config, self.task))
        batch, scored = sampled.batch, sampled.scored
        if sampled.note:
            self.monitor.write(sampled.note)
        t_generate = time.perf_counter() - start  # with the reward functions' time
        self.check_scored(step, scored)
        # Before the update: what the rollouts did can stop the run (every agent failing), and a
        # stop before the update saves the step before (FailureSave).
        rollout, tokens = step_metrics(self.config, batch, scored, self.rollouts.kind)

        t0 = time.perf_counter()
        ref_logps = self.logprobs.ref(batch, scored.active) if a.beta > 0 else None  # (n, T)
        old_logps = self.logprobs.old(batch, scored.active) if self.config.needs_old_logps else None  # (n, T)
        teacher_logps = None if self.teacher is None else self.teacher.logprobs(batch, scored.active, self.logprobs)
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.rollouts.before_update()
        stats = self.optimize(batch, scored, old_logps, ref_logps, teacher_logps)
        t_update = time.perf_counter() - t0 - stats.time_optimizer  # forward and backward passes

        every = self.config.monitor.log_completions
        if every and step % every == 0:
            samples = scored.samples if teacher_logps is None else [  # the teacher's per-token values beside
                {**s, **t} for s, t in zip(scored.samples, token_records(batch, scored.active, old_logps, teacher_logps))]
            self.monitor.completions(step, distributed.gather_lists(samples))
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
            **self.waste.step(),
            **self.pushes.step(),
            **dict(zip(("time/generate", "time/logprobs", "time/update", "time/optimizer", "step_time"), times)),
        }

    # ------------------------------------------------------------------ the phases of a step

    def check_scored(self, step: int, scored: Scored) -> None:
        """A step in which every reward function returned None for every completion teaches nothing:
        say so at once, and stop (before its update) once UNSCORED_STEPS steps in a row were so."""
        if scored.any_scored or scored.all_failed:  # every rollout failed: the rollout kind says why
            return
        in_a_row = self.progress.unscored_in_a_row + 1
        names = ", ".join(self.rewards.names)
        if in_a_row >= UNSCORED_STEPS:
            why = scored.first_error()  # e.g. the judge's reason, from what it logged for each completion
            raise RewardError(f"the reward functions ({names}) scored no completion in {in_a_row} steps in a row "
                              f"(to step {step}): every value was None. Check what they return for this data."
                              + (f" The first reason logged at step {step}: {why}" if why else ""))
        self.monitor.write(f"step {step}: the reward functions ({names}) scored none of the {len(scored.rewards)} "
                           f"completions (every value None): nothing to learn from; {UNSCORED_STEPS} such steps in a "
                           "row stop the run")

    def optimize(self, batch: RolloutBatch, scored: Scored, old_logps: torch.Tensor | None,
                 ref_logps: torch.Tensor | None, teacher_logps: torch.Tensor | None = None) -> UpdateStats:
        """num_iterations x updates_per_step optimizer updates on this process's completions.

        old_logps / ref_logps / teacher_logps: (n, T) or None. This process's rows are in update order: update u
        uses local rows [u*S, (u+1)*S), S = completions_per_update / processes.
        """
        cfg, a = self.config, self.config.algorithm
        share = cfg.completions_per_update // distributed.world_size()
        # Only the model's own tokens are trained (not a conversation's tool results).
        mask = loss_mask(batch.trained_mask, batch.finish_reasons, a.mask_truncated_completions)  # (n, T)
        metrics = LossMetrics(token_metric_names(a.loss_type, self.loss_settings, teacher_logps is not None),
                               IS_OUTSIDE[self.loss_settings.is_mode] if self.rollouts.is_correction else None,
                               self.logprobs.routed and (cfg.completions_per_update, self.logprobs.routed[0]))
        skipped, t_optimizer = 0, 0.0
        self.policy.train()
        for _ in range(a.num_iterations):
            for u0 in range(0, len(scored.advantages), share):
                update_loss = self._accumulate(batch, scored, mask, torch.arange(u0, u0 + share), old_logps,
                                               ref_logps, metrics, teacher_logps)
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
                    old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None, metrics: LossMetrics,
                    teacher_logps: torch.Tensor | None = None) -> float:
        """The forward and backward passes of one update, on this process's rows `local` of it, in
        micro-batches, their gradients accumulated: this process's share of the update's loss."""
        cfg, a = self.config, self.config.algorithm
        # The whole update batch's counts, all processes, normalize every micro-batch's loss.
        num_tokens = distributed.all_reduce(mask[local].sum().double()).item()
        policy_mask = None
        if a.top_entropy_quantile < 1:  # (n, T)
            policy_mask = high_entropy_tokens(batch.entropies, mask, local, a.top_entropy_quantile)
        rows = local[scored.active[local]]
        update_loss = 0.0
        micro_batches = self.logprobs.micro_batches(batch, rows)
        for i, mb in enumerate(micro_batches):
            policy = self.logprobs.train(batch, mb, mask[mb], entropies=a.entropy_coef > 0)
            out = compute_loss(a.loss_type, LossInputs(
                logps=policy.logps,  # (M, T)
                entropies=policy.entropies,
                balance=policy.balance,
                mask=mask[mb],
                advantages=scored.advantages[mb],
                old_logps=None if old_logps is None else old_logps[mb],
                ref_logps=None if ref_logps is None else ref_logps[mb],
                teacher_logps=None if teacher_logps is None else teacher_logps[mb],
                sampling_logps=batch.sampling_logps[mb].to(self.device) if self.rollouts.is_correction else None,
                policy_mask=None if policy_mask is None else policy_mask[mb],
                num_sequences=cfg.completions_per_update,
                num_tokens=num_tokens,
                max_completion_length=cfg.rollout.max_completion_length,
            ), self.loss_settings)
            self.parallel.backward(out.loss, last=i == len(micro_batches) - 1)
            update_loss += out.loss.item()
            metrics.add_micro_batch(out, mask[mb], num_tokens, policy.expert_counts)
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

    def capture(self) -> tuple[dict, dict, Pending]:
        """(RNG states, trainer state, the steps queued ahead and the groups carried) as they are
        now; every process calls it (a collective)."""
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

    def save_checkpoint(self, captured: tuple[dict, dict, Pending] | None = None) -> Path:
        """checkpoints/step-N (rundir/checkpoint.py) from this moment's state, or from a `captured` one
        (the weights and optimizer must not have changed since)."""
        rng, state, pending = captured or self.capture()
        # Gathered by every process when sharded; whole on process 0, which writes.
        weights = self.parallel.checkpoint_weights(self.policy)
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

    def save_after_failure(self, captured: tuple[dict, dict, Pending]) -> None:
        """A failure stops the run: save `captured`, the newest state the weights still match, if
        no checkpoint holds it yet, so that fixing the cause and resuming loses nothing."""
        step = captured[1]["step"]
        if step > (self.progress.saved_step or 0):
            try:
                path = self.save_checkpoint(captured)
                failed = captured[2].failed()
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
