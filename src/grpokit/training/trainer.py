"""The GRPO training loop, readable top to bottom.

One step (`train_step`):

    sampled  = sampler.step(n, scorer)                # the step's prompts, G completions each, scored:
                                                      # ids, masks, finish reasons, rewards (N,), advantages
    ref, old = logprobs.ref(...), logprobs.old(...)   # only when beta > 0 / samples are reused
    stats    = optimize(batch, scored, old, ref)      # num_iterations x updates_per_step optimizer updates
    row      = the step's metrics

The parts, built by setup.py (`build`): `Sampler` (sampling/sampler.py) is how a step's completions come
to be, whatever the engine, generating ahead, the rollout kind or dynamic sampling; `Scorer`
(sampling/scoring.py) turns them into rewards and advantages; `LogProbs` (models/logprobs.py) runs
every log-prob pass; the strategy (sharding.py) holds the weights, gradients and optimizer state;
`Monitor` (rundir/monitor.py) writes the metrics. The trainer keeps the loop and the update;
checkpointing.py what a checkpoint holds, what a failure saves and resuming; state.py the
counters, metrics.py the step's metrics.

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

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.algorithm.loss import IS_OUTSIDE, LossInputs, compute_loss, token_metric_names
from grpokit.algorithm.masks import high_entropy_tokens, loss_mask
from grpokit.engines.batch import RolloutBatch
from grpokit.models.teacher import token_records
from grpokit.rewards.reward_set import RewardError
from grpokit.rundir.checkpoint import link_model_files, rng_state, set_rng_state
from grpokit.rundir.diagnose import RunFacts
from grpokit.rundir.folder import TrainResult, clear_stop, record_stop, release_run_dir
from grpokit.rundir.model_card import write_model_card
from grpokit.rundir.monitor import Monitor
from grpokit.runtime import distributed, signals
from grpokit.runtime.errors import RunStopped
from grpokit.sampling.evaluation import summarize
from grpokit.sampling.scoring import Scored
from grpokit.settings.schema import Config
from grpokit.training import checkpointing, setup
from grpokit.training.checkpointing import FailureSave
from grpokit.training.metrics import LossMetrics, Pushes, Waste, step_metrics
from grpokit.training.state import Progress


# Steps in a row in which no reward function scored any completion that stop a run.
UNSCORED_STEPS = 3


class NonFiniteError(RunStopped, RuntimeError):
    """More than train.max_skipped_steps steps in a row had a non-finite loss or gradient."""

    says_what_to_do = True


class Interrupted(RunStopped):
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
        model.name's; config.model.name then only says where they came from. The parts are
        setup.py's; the trainer runs the loop."""
        self.config = config
        parts = setup.build(config, "train", model=model, tokenizer=tokenizer)
        self.device, self.parallel, self.run_dir = parts.device, parts.parallel, parts.run_dir
        self.tokenizer, self.vision = parts.tokenizer, parts.vision
        self.task, self.rewards = parts.prepared.task, parts.prepared.rewards
        self.policy, self.reference, self.teacher = parts.model, parts.reference, parts.teacher
        self.sampler, self.scorer, self.logprobs = parts.sampler, parts.scorer, parts.logprobs
        self.params, self.optimizer, self.scheduler = parts.params, parts.optimizer, parts.scheduler
        self.loss_settings, self.checkpoint_size = parts.loss_settings, parts.checkpoint_size
        self.waste, self.pushes = Waste(self.sampler, self.logprobs), Pushes(self.sampler)
        self.resumed_rows = parts.resumed_rows
        self.progress = Progress() if parts.resume_from is None else checkpointing.resume(self, parts.resume_from)
        self.monitor = self._make_monitor(progress)
        for line in parts.notes:
            self.monitor.write(line)

    # ------------------------------------------------------------------ start-up

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
                checkpointing.save(self)
            if distributed.is_main():
                self._finish(history)
        except BaseException as error:
            # One process only: with several, the others may be waiting in a collective. A
            # NonFiniteError keeps the checkpoints from before the streak; Ctrl-C twice stops at once.
            if distributed.world_size() == 1 and isinstance(error, Exception) and not isinstance(error, NonFiniteError):
                captured = failure.state(lambda: checkpointing.capture(self))
                if captured is not None:
                    checkpointing.save_after_failure(self, captured)
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
            self.sampler.close()  # last: closing a server's weight group may wait on it
        return TrainResult(self.run_dir, [h for h in history if h], self.config.model.dtype)

    def _run_step(self, step: int, history: list[dict], failure: FailureSave) -> None:
        """Step `step`, then its metrics row, its evaluation (if due) and its checkpoint (if due, or
        if a stop was asked for)."""
        t = self.config.train
        if distributed.world_size() == 1:  # (capturing is a collective: never after a failure)
            failure.step_begins(checkpointing.capture(self))
        row = self.train_step(step)
        failure.step_ends()
        self.monitor.step(row)
        if self.progress.skipped_in_a_row > t.max_skipped_steps:
            raise NonFiniteError(
                f"the last {self.progress.skipped_in_a_row} steps (to step {step}) all had a non-finite "
                f"loss or gradient, more than train.max_skipped_steps={t.max_skipped_steps}: the run "
                "stopped, their updates not applied. " + checkpointing.restart_hint(self)
            )
        if step == t.max_steps or (t.eval_every and step % t.eval_every == 0):
            history.append(self.evaluate(step))
        stop = _agreed_stop()  # every process stops after the same step
        if stop or step == t.max_steps or (t.save_every and step % t.save_every == 0):
            checkpoint = checkpointing.save(self)
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
        self.sampler.queue(step)  # generating ahead: the steps to step + k queued (not the step's time)
        self.waste.start()
        self.pushes.start()
        start = time.perf_counter()
        sampled = self.sampler.step(step, self.scorer, self.progress.trainer_state(self.config, self.task))
        batch, scored = sampled.batch, sampled.scored
        if sampled.note:
            self.monitor.write(sampled.note)
        t_generate = time.perf_counter() - start  # with the reward functions' time
        # Every failure (a rollout, a judge call, a tool call) to failures.jsonl now: a stop just below
        # (a step that scored nothing, every agent failing) points there.
        self.monitor.completions(step, distributed.gather_lists(scored.failures), "failures.jsonl")
        self.check_scored(step, scored)
        # Before the update: what the rollouts did can stop the run (every agent failing), and a
        # stop before the update saves the step before (FailureSave).
        rollout, tokens = step_metrics(self.config, batch, scored, self.sampler.kind)

        t0 = time.perf_counter()
        ref_logps = self.logprobs.ref(batch, scored.active) if a.beta > 0 else None  # (n, T)
        old_logps = self.logprobs.old(batch, scored.active) if self.config.needs_old_logps else None  # (n, T)
        teacher_logps = None if self.teacher is None else self.teacher.logprobs(batch, scored.active, self.logprobs)
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.sampler.before_update()
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
                              + (f" The first reason logged at step {step}: {why} (each is in failures.jsonl)"
                                 if why else ""))
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
                               IS_OUTSIDE[self.loss_settings.is_mode] if self.sampler.is_correction else None,
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
                    self.sampler.weights_changed()
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
                sampling_logps=batch.sampling_logps[mb].to(self.device) if self.sampler.is_correction else None,
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
        """Greedy completions on the held-out split, scored and gathered (Sampler.evaluate).

        Evaluation leaves the global RNGs as it found them (reward functions may draw from them),
        so when and how often a run evaluates never changes its training."""
        examples = self.task.eval_examples
        if not examples:
            return {}
        rng = rng_state()
        logged = {}  # the reward functions' log_metric values, this process's
        try:
            records = self.sampler.evaluate(step, examples, self.rewards,
                                             self.progress.trainer_state(self.config, self.task), logged)
        finally:
            set_rng_state(rng)
        metrics = {**summarize(records, self.rewards.names),
                   **{f"eval/{name}": value for name, value in distributed.means(logged).items()}}
        self.monitor.eval(step, metrics)
        return {"step": step, **metrics}


def _agreed_stop() -> int:
    """The signal number every process agrees to stop for, 0 for none (a collective)."""
    if distributed.world_size() == 1:
        return signals.requested()
    return int(distributed.all_reduce(torch.tensor([signals.requested()]), "max").item())
