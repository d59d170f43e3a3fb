"""The GRPO training loop, readable top to bottom.

One step (`train_step`):

    batch    = sample(examples)                       # G completions per prompt: ids, masks, finish reasons
    scored   = score(examples, batch)                 # rewards (N,), group-relative advantages
    ref, old = reference / old log-probs              # only when beta > 0 / samples are reused
    stats    = optimize(batch, scored, old, ref)      # num_iterations x updates_per_step optimizer updates
    row      = the step's metrics

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
import copy
import math
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpokit import distributed, sharding, signals
from grpokit.advantages import advantages as compute_advantages
from grpokit.api import TrainResult
from grpokit.checkpoint import (checkpoint_bytes, link_model_files, load_state, load_weights, rng_state, set_rng_state,
                                write_checkpoint, write_state_files)
from grpokit.config import Config, reward_specs
from grpokit.diagnose import RunFacts
from grpokit.dynamic_sampling import Collector, Round
from grpokit.errors import ConfigError, StartupError
from grpokit.evaluate import score, summarize
from grpokit.logprobs import check_chunkable, check_inputs_embeds, completion_logprobs
from grpokit.loss import IS_MAX, IS_MEAN, IS_OUTSIDE, LossInputs, LossOutput, LossSettings, compute_loss, token_metric_names
from grpokit.models import (apply_lora, enable_activation_checkpointing, eos_token_ids, load_model, load_tokenizer,
                            save_model, with_pad_token)
from grpokit.model_card import write_model_card
from grpokit.monitor import Monitor
from grpokit.rewards import RewardError, RewardLog, RewardSet, merge_metrics, trainer_state
from grpokit.rollout import (RolloutBatch, SamplingParams, decode_completions, encode_prompt, engine_class,
                             make_engine)
from grpokit.rollout.conversation import MultiTurn
from grpokit.rollout.pipeline import Pipeline, Queued
from grpokit.rollout.weights import named_weights
from grpokit.rollout.tools import Tools
from grpokit.rundir import (check_disk_space, clear_stop, open_run_dir, record_stop, release_run_dir,
                            start_run_dir)
from grpokit.schedule import lr_multiplier
from grpokit.tasks import Example, make_task


# Steps in a row in which no reward function scored any completion that stop a run.
UNSCORED_STEPS = 3
# A checkpoint's reference model weights, with algorithm.sync_ref_model (it drifts towards the policy).
REFERENCE_FILE = "reference.pt"
# A checkpoint's completions of the steps generated ahead of it, with rollout.max_staleness > 0.
AHEAD_FILE = "rollouts_ahead.pt"


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

    def trainer_state(self, config: Config, task):
        """The `trainer_state` reward functions receive now (rewards.trainer_state)."""
        size = len(getattr(task, "train_examples", ()))
        return trainer_state(config, self.step, epoch=self.examples_seen / size if size else 0.0,
                             tokens=self.num_tokens, main=distributed.is_main())


@dataclass
class Scored:
    """A step's completions, scored."""

    rewards: torch.Tensor  # (N,) the whole step's, all processes; NaN where no reward function applied
    per_function: dict[str, torch.Tensor]  # name -> (N,) each function's rewards
    advantages: torch.Tensor  # (n,) this process's completions', on the training device
    active: torch.Tensor  # (n,) bool: the completions that need a forward/backward pass
    samples: list[dict] = field(repr=False)  # this process's completions, as monitor.log_completions records them
    logged: dict[str, list[float]] = field(default_factory=dict)  # this process's log_metric values (rewards.RewardLog)

    @property
    def any_scored(self) -> bool:
        """Whether some reward function scored some completion of the step."""
        return not torch.isnan(self.rewards).all()


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
        self.tokenizer = load_tokenizer(config.model.name) if tokenizer is None else with_pad_token(tokenizer)
        self.tools = Tools.from_config(config, self.tokenizer)  # None: single-turn rollouts
        if self.tools is not None and self.parallel.lockstep:
            raise ConfigError("multi-turn rollouts (rollout.tools, rollout.environment) with sharded weights (FSDP2, "
                              "ZeRO-3) are not supported: the processes would take different numbers of turns")
        if self.tools is not None and config.rollout.max_staleness:
            raise ConfigError(f"rollout.max_staleness={config.rollout.max_staleness} with multi-turn rollouts (tools, "
                              "an environment) is not supported yet: use rollout.max_staleness=0")
        if self.tools is not None and self.tools.environment is not None and distributed.world_size() > 1:
            if self.remote:
                raise ConfigError("rollout.environment with rollout.engine=server on several processes is not supported: "
                                  "the environments live in process 0, which alone talks to the server; use one process, "
                                  "or the transformers engine")
            if config.rollout.dynamic_sampling:
                raise ConfigError("rollout.dynamic_sampling with rollout.environment on several processes is not "
                                  "supported: the kept groups' environments would have to move between processes; use "
                                  "one process, or turn one of them off")
        if config.algorithm.sync_ref_model and self.parallel.lockstep:
            raise ConfigError("algorithm.sync_ref_model with sharded weights (FSDP2, ZeRO-3) is not supported: the "
                              "reference is mixed with the policy weight by weight; use data parallelism")
        self.task = make_task(config.data, config.train.seed, lambda e: len(self.encode(e, truncate=False)))
        first = next(self.task.train_stream())
        if self.tools is not None:
            self.tools.check({"prompt": first.prompt, **first.columns}, getattr(self.task, "prompts_from_reset", False))
        self.rewards = RewardSet(reward_specs(config, self.task.reward_functions), config.reward.timeout,
                                 extra=Tools.rewards(self.tools))
        self.stream = self.task.train_stream()
        self.rewards.check_arguments(first.columns, environments=self.tools is not None and self.tools.environment is not None)
        # Process 0 alone owns the run directory; the others learn its path (a default one is
        # stamped with process 0's clock) or its refusal, and stop with the same message.
        existed = config.train.output_dir is not None and Path(config.train.output_dir).exists()
        self.run_dir, resume_from, damaged = distributed.on_main(lambda: open_run_dir(config))
        with _removed_if_refused(self.run_dir, existed):  # a refused start leaves no empty folder behind
            config.train.output_dir = str(self.run_dir)
            self.seed_stream = _seed_everything(config.train.seed)
            self.policy, self.reference = self._load_models(model)
            self._check_context()
            # Log-prob passes call the whole model on token ids when only such a call gathers sharded
            # weights, or when the model uses the ids for more than the embedding lookup (logprobs.py).
            self.whole_model = self.parallel.lockstep or not check_inputs_embeds(self.policy)
            self.engine, self.is_correction = self._connect_engine()
            # rollout.max_staleness > 0: the next steps are generated while this one trains (pipeline.py).
            self.ahead = Pipeline(self.engine, config.rollout.max_staleness, self.generate_ahead) \
                if config.rollout.max_staleness else None
            self.multi_turn = None if self.tools is None else MultiTurn(
                self.tokenizer, self.tools, config.rollout.max_turns, eos_token_ids(self.policy, self.tokenizer),
                config.data.max_prompt_length)
            # The global completions of a step this process owns, in update order (distributed.py).
            self.rows = distributed.shard_rows(config.completions_per_step, config.completions_per_update,
                                               distributed.world_size(), distributed.rank())
            needed = self.checkpoint_size = checkpoint_bytes(self.policy)  # counted while every process holds the whole model
            if config.algorithm.sync_ref_model:  # and the moved reference
                needed = self.checkpoint_size = needed + checkpoint_bytes(self.reference)
            if resume_from is not None:  # into whole weights, before sharding spreads them
                load_weights(self.policy, resume_from)
            self.policy, self.reference = self.parallel.wrap(self.policy, self.reference)
            self.params = [p for p in self.policy.parameters() if p.requires_grad]
            self.optimizer, self.scheduler = self._make_optimizer()
            a, r = config.algorithm, config.rollout
            self.loss_settings = LossSettings(
                a.beta, a.epsilon, a.epsilon_high, a.kl_estimator or "k3", a.importance_sampling_level, a.delta,
                a.sapo_temperature_pos, a.sapo_temperature_neg, r.is_level, r.is_mode, r.is_cap, r.is_min)
            self.sampling = SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k, r.min_p)
            self.greedy = SamplingParams(r.max_completion_length, temperature=0.0)
            # The metrics.jsonl rows kept from before the checkpoint, and what to tell the user about them.
            self.resumed_rows, note = distributed.on_main(lambda: self._start_run_dir(needed, resume_from))
        self.progress = Progress()
        if resume_from is not None:
            self.resume(resume_from)
        self.saved_step = self.progress.step if resume_from is not None else None  # the newest checkpoint's step
        self.monitor = self._make_monitor(progress)
        for line in (*damaged, note, self.parallel.describe(self.policy), *getattr(self.task, "notes", ())):
            if line:
                self.monitor.write(line)

    # ------------------------------------------------------------------ start-up, in order

    def _load_models(self, model=None):
        """The policy (`model`, or model.name's), and the reference model (None without a KL term,
        and with LoRA)."""
        m, t = self.config.model, self.config.train
        policy = (load_model(m.name, m.dtype) if model is None else model.train()).to(self.device)
        distributed.broadcast_parameters(policy)
        # The reference model is the initial policy, so it is copied before a checkpoint's weights
        # are loaded. With LoRA it is the policy itself with its adapters switched off: no second
        # copy of the weights.
        reference = None
        if m.lora_rank:
            policy = apply_lora(policy, m, m.name)
            distributed.broadcast_parameters(policy)  # the adapters' random initialisation
        elif self.config.algorithm.beta > 0:
            reference = copy.deepcopy(policy).eval().requires_grad_(False)
        if m.gradient_checkpointing:  # after the reference copy, which never trains
            enable_activation_checkpointing(policy)
        if t.logprob_chunk_size is not None:
            try:
                check_chunkable(policy)
            except ValueError as e:
                raise StartupError(str(e)) from None
        return policy, reference

    def _check_context(self) -> None:
        """Every prompt and its completion fit the model's positions, or data.max_prompt_length
        makes them: a longer sequence would train on positions the model never learned."""
        limit = getattr(getattr(self.policy, "config", None), "max_position_embeddings", None)
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
        lengths = [len(self.encode(e, truncate=False)) for e in examples]
        over = [n for n in lengths if n > budget]
        if over:
            raise ConfigError(
                f"{len(over)} of the {len(lengths)} prompts are longer than the {budget} tokens that the model's {limit} "
                f"positions leave beside rollout.max_completion_length={length} (the longest: {max(over)}): set "
                f"data.max_prompt_length={budget} (data.long_prompts=drop leaves them out, truncate keeps their end)")

    def _connect_engine(self):
        """The rollout engine (None on the processes other than 0 when it is remote), and whether
        its sampling log-probs need the importance-sampling correction (loss.py): they do when
        they come from other kernels than the trainer's."""
        c, engine = self.config, None

        def connect() -> bool:
            nonlocal engine
            engine = make_engine(c.rollout, self.policy, self.tokenizer, eos_token_ids(self.policy, self.tokenizer),
                                 c.model.name, lockstep=self.parallel.lockstep)
            return engine.exact_logprobs

        # A server that cannot be used stops every process (on_main hands process 0's error to all).
        exact = distributed.on_main(connect) if self.remote else connect()
        # Completions generated ahead come from older weights than the trainer's: corrected, whatever the kernels.
        return engine, c.rollout.is_correction and (not exact or c.rollout.max_staleness > 0)

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

    def _start_run_dir(self, needed: int, resume_from: Path | None) -> tuple[list[dict], str | None]:
        check_disk_space(self.run_dir, self.config, needed)
        return start_run_dir(self.run_dir, self.config, resume_from)

    def _make_monitor(self, progress: bool) -> Monitor:
        c = self.config
        return Monitor(self.run_dir if distributed.is_main() else None, c.train.max_steps,
                       RunFacts.from_config(c.to_dict()), tensorboard=c.monitor.tensorboard,
                       history=self.resumed_rows, initial=self.progress.step, enabled=progress,
                       wandb=c.monitor.wandb and {"config": c.to_dict(), "project": c.monitor.wandb_project},
                       trackio=c.monitor.trackio and {"config": c.to_dict(), "project": c.monitor.trackio_project})

    @property
    def remote(self) -> bool:
        """Whether the engine generates in another process, reached by process 0 alone."""
        return engine_class(self.config.rollout.engine).remote

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        t = self.config.train
        history = [row for row in self.resumed_rows if "eval/reward" in row]
        # What a failure saves: while a step runs, the state from before it (captured as it starts),
        # as long as no optimizer update of the step has begun (counted by a hook on the optimizer).
        updates_begun = [0]
        hook = self.optimizer.register_step_pre_hook(lambda *_: updates_begun.__setitem__(0, updates_begun[0] + 1))
        in_step = None  # (state before the running step, updates begun before it)
        try:
            if distributed.is_main():
                clear_stop(self.run_dir)
            if self.progress.step == 0 and not history:
                history.append(self.evaluate(step=0))
            with signals.StopSignals(distributed.is_main()):
                for step in range(self.progress.step + 1, t.max_steps + 1):
                    if self.ahead is None:
                        examples = self.next_prompts()
                    if distributed.world_size() == 1:  # (capturing is a collective: never after a failure)
                        in_step = self.capture(), updates_begun[0]
                    queued = None
                    if self.ahead is not None:  # queue up to step + k, then take this step's
                        self.ahead.fill(step, t.max_steps, self.progress.step, self.draw_ahead, self.weights_snapshot)
                        queued = self.ahead.take(step)
                        examples = queued.examples
                    row = self.train_step(step, examples, queued)
                    in_step = None
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
            if self.saved_step != self.progress.step:  # train.max_steps=0
                self.save_checkpoint()
            if distributed.is_main():
                # final/: the last checkpoint's model files (hard links, not a second copy).
                link_model_files(self.run_dir / "checkpoints" / f"step-{self.saved_step}", self.run_dir / "final")
                try:  # the run is trained and saved: a card that cannot be written is a warning, not a failure
                    write_model_card(self.run_dir, self.config.to_dict(), [h for h in history if h], self.rewards.names)
                except Exception as e:
                    self.monitor.write(f"warning: the model card (final/README.md) was not written: "
                                       f"{type(e).__name__}: {e}")
        except BaseException as error:
            # One process only: with several, the others may be waiting in a collective. A
            # NonFiniteError keeps the checkpoints from before the streak; Ctrl-C twice stops at once.
            if distributed.world_size() == 1 and isinstance(error, Exception) and not isinstance(error, NonFiniteError):
                if in_step is None:
                    self.save_after_failure(self.capture())
                elif in_step[1] == updates_begun[0]:  # the failing step had not changed the weights
                    self.save_after_failure(in_step[0])
            if distributed.is_main():
                record_stop(self.run_dir, self.progress.step, self.saved_step, error)
            raise
        else:
            if distributed.is_main():
                record_stop(self.run_dir, self.progress.step, self.saved_step, None)
        finally:
            hook.remove()
            if self.ahead is not None:
                self.ahead.close()
            self.monitor.close()
            release_run_dir(self.run_dir)
            if self.engine is not None:
                self.engine.close()
        return TrainResult(self.run_dir, [h for h in history if h], self.config.model.dtype)

    def train_step(self, step: int, examples: list[Example], queued: Queued | None = None) -> dict:
        """Step `step` on the prompts `examples` (the same on every process): its metrics row.
        `queued`: the step as generated ahead (rollout.max_staleness > 0)."""
        a = self.config.algorithm
        start = time.perf_counter()
        if self.config.rollout.dynamic_sampling:
            examples, batch, scored, sampling = self.sample_informative(step, examples)
        elif queued is not None:  # (waiting for it, when it is not generated yet)
            batch = self.own_rows(distributed.on_main(queued.result))
            scored = self.score(examples, batch)
            sampling = {"staleness": step - 1 - queued.weights_step}
        else:
            batch = self.sample(examples)  # this process's completions
            scored = self.score(examples, batch)
            sampling = {}
        t_generate = time.perf_counter() - start  # with the reward functions' time when sampling dynamically
        self.check_scored(step, scored)

        t0 = time.perf_counter()
        ref_logps = self.reference_logprobs(batch, scored.active) if a.beta > 0 else None  # (n, T)
        old_logps = self.batch_logprobs(self.policy, batch, scored.active) if self.config.needs_old_logps else None
        t_logprobs = time.perf_counter() - t0

        t0 = time.perf_counter()
        if self.engine is not None and self.ahead is None:
            self.engine.sleep()  # vLLM in this process: free its memory for the update
        stats = self.optimize(batch, scored, old_logps, ref_logps)
        t_update = time.perf_counter() - t0 - stats.time_optimizer  # forward and backward passes

        rollout, tokens = self.rollout_metrics(batch, scored)
        every = self.config.monitor.log_completions
        if every and step % every == 0:
            self.monitor.completions(step, distributed.gather_lists(scored.samples))
        logged = distributed.means(scored.logged)  # the reward functions' log_metric values
        self.count_step(step, tokens, scored, stats, int(sampling.get("dynamic_sampling/prompts_sampled", len(examples))))
        times = torch.tensor([t_generate, t_logprobs, t_update, stats.time_optimizer, time.perf_counter() - start])
        times = distributed.all_reduce(times, "max").tolist()  # the slowest process sets the pace
        return {
            "step": step,
            **stats.metrics,
            **rollout,
            **sampling,
            **logged,
            "num_tokens": self.progress.num_tokens,
            "skipped_steps": self.progress.skipped_steps,
            **dict(zip(("time/generate", "time/logprobs", "time/update", "time/optimizer", "step_time"), times)),
        }

    # ------------------------------------------------------------------ the phases of a step

    def sample(self, examples: list[Example]) -> RolloutBatch:
        """The completions this process owns (rows `self.rows` of the step), grouped by prompt."""
        G = self.config.rollout.num_generations
        seeds = self.step_seeds()  # (N,) the whole step's
        if self.remote:  # process 0 asks for the whole step; each process keeps its rows
            self.hand_weights_to_server()
            batch = distributed.on_main(lambda: self.generate(examples, [G] * len(examples), self.sampling, seeds.tolist()))
            return self.own_rows(batch)
        prompts, counts = torch.unique_consecutive(self.rows // G, return_counts=True)
        return self.generate([examples[p] for p in prompts.tolist()], counts.tolist(), self.sampling,
                             seeds[self.rows].tolist())

    def own_rows(self, batch: RolloutBatch) -> RolloutBatch:
        """This process's rows of a whole step a remote engine generated (in host memory), on its device."""
        return (batch if distributed.world_size() == 1 else batch.select(self.rows)).to(self.device)

    def generate(self, examples: list[Example], counts: list[int], params: SamplingParams,
                 seeds: list[int] | None) -> RolloutBatch:
        """counts[i] completions of examples[i]: conversations with tools, or one engine call."""
        if self.multi_turn is not None:
            return self.multi_turn.generate(self.engine, examples, counts, params, seeds)
        return self.engine.generate([self.encode(e) for e in examples], counts, params, seeds)

    def next_prompts(self) -> list[Example]:
        """A step's prompts, the next train.prompts_per_step of the data stream (the same on every process)."""
        return [next(self.stream) for _ in range(self.config.train.prompts_per_step)]

    def step_seeds(self) -> torch.Tensor:
        """(N,) a step's sampling seeds, one per completion, from the seed stream (the same on every process)."""
        return torch.randint(0, 2**62, (self.config.completions_per_step,), generator=self.seed_stream)

    def draw_ahead(self) -> tuple[list[Example], list[int]]:
        """The prompts and sampling seeds of the next step queued ahead."""
        return self.next_prompts(), self.step_seeds().tolist()

    def generate_ahead(self, examples: list[Example], seeds: list[int]) -> RolloutBatch:
        """A whole step's completions, generated ahead (in the pipeline's thread)."""
        return self.generate(examples, [self.config.rollout.num_generations] * len(examples), self.sampling, seeds)

    def weights_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of the policy's whole weights as they are now, in host memory, to push while the
        trainer changes its own (on process 0; every process calls it: a collective when sharded)."""
        if self.parallel.lockstep:
            weights = self.parallel.full_weights(self.policy)
        else:
            weights = named_weights(self.policy) if distributed.is_main() else []
        return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]

    def score(self, examples: list[Example], batch: RolloutBatch) -> Scored:
        """Rewards of this process's completions `batch`, gathered into the whole step's, and
        group-relative advantages (of whole groups, wherever their completions were generated)."""
        return self.advantages(batch, *self.reward(examples, batch))

    def reward(self, examples: list[Example], batch: RolloutBatch) -> tuple[torch.Tensor, dict, list[dict], dict]:
        """The reward functions on this process's completions `batch`: the whole step's rewards (N,)
        and each function's (gathered from every process), this process's records of them (with
        the columns the functions log_extra'ed), and the values they log_metric'ed."""
        cfg, G = self.config, self.config.rollout.num_generations
        N, U = cfg.completions_per_step, cfg.completions_per_update
        owned = [examples[r // G] for r in self.rows.tolist()]
        prompts = batch.prompts(owned)  # as the model saw them
        completions = decode_completions(self.tokenizer, batch, prompts)
        log = RewardLog(len(completions))
        local_rewards, local_per_function = self.rewards(
            owned, completions, batch.finish_reasons, batch.completion_id_lists(), batch.environments(),
            prompts=prompts, state=self.progress.trainer_state(self.config, self.task), log=log)  # (n,)
        samples = [
            {"prompt": p, "completion": c, "finish_reason": f, "reward": r.item(),
             **{f"rewards/{name}": v[i].item() for name, v in local_per_function.items()}, **log.record(i)}
            for i, (p, c, f, r) in enumerate(zip(prompts, completions, batch.finish_reasons, local_rewards))
        ]
        rewards = distributed.gather_rows(local_rewards, N, U)  # (N,) in global order
        per_function = {k: distributed.gather_rows(v, N, U) for k, v in local_per_function.items()}
        return rewards, per_function, samples, log.metrics

    def advantages(self, batch: RolloutBatch, rewards: torch.Tensor, per_function: dict, samples: list[dict],
                   logged: dict | None = None, rows: torch.Tensor | None = None) -> Scored:
        """The step's advantages (advantages.py) from the whole step's `rewards` (N,), kept for the
        completions `batch` (this process's rows, or `rows`), and which of them need a forward/backward pass."""
        a, G = self.config.algorithm, self.config.rollout.num_generations
        stacked = torch.stack(list(per_function.values()), 1)  # (N, K)
        weights = torch.tensor(self.rewards.weights, dtype=stacked.dtype)
        advantages = compute_advantages(rewards, stacked, weights, G, a.advantage_estimator, a.scale_rewards,
                                        a.reward_aggregation)[self.rows if rows is None else rows]  # (n,)
        # With no KL term, a completion with advantage exactly 0 adds exactly 0 to the loss, its
        # gradient and the clip metrics: it needs no forward/backward at all; a completion whose
        # tokens all leave the loss (a masked truncated one) adds 0 with any beta. Sharded weights
        # need every process in every forward (sharding.py), so there every row runs.
        active = torch.ones_like(advantages, dtype=torch.bool)  # (n,)
        if not self.parallel.lockstep:
            if a.beta == 0:
                active &= advantages != 0
            active &= self.loss_mask(batch).cpu().any(-1)
        return Scored(rewards, per_function, advantages.to(self.device), active, samples, logged or {})

    def sample_informative(self, step: int, examples: list[Example]) -> tuple[list[Example], RolloutBatch, Scored, dict]:
        """Dynamic sampling (dynamic_sampling.py): rounds of sampling and scoring, the first on
        `examples`, the next ones on prompts drawn from the data stream, until the step holds
        prompts_per_step informative groups or max_sampling_rounds rounds were sampled. The step's
        prompts, this process's completions of them, their scores, and the dynamic_sampling/* metrics."""
        cfg, r = self.config, self.config.rollout
        N, U, P = cfg.completions_per_step, cfg.completions_per_update, cfg.train.prompts_per_step
        collector = Collector(P, r.num_generations)
        # Where each process's completions go in a round's global order (the inverse of shard_rows).
        order = torch.argsort(torch.cat([distributed.shard_rows(N, U, distributed.world_size(), k)
                                         for k in range(distributed.world_size())]))
        logged = {}  # the rounds' log_metric values
        while True:
            if collector.rounds:
                examples = self.next_prompts()
            batch = self.sample(examples)
            rewards, per_function, samples, round_logged = self.reward(examples, batch)
            logged = merge_metrics(logged, round_logged)
            if distributed.world_size() > 1:  # every process holds the whole round, in global order
                # (through CPU memory: a GPU tensor would be unpickled onto the GPU of the process that sent it)
                parts = distributed.gather_lists([batch.to(torch.device("cpu"))])
                batch = RolloutBatch.concat(parts).select(order).to(batch.completion_ids.device)
                everyone = distributed.gather_lists(samples)
                samples = [everyone[i] for i in order.tolist()]
            batch.prompt_index = torch.arange(N, device=batch.prompt_index.device) // r.num_generations
            # Informative: a group the round's advantages do not set to 0 (whatever the estimator and aggregation).
            advantages = self.advantages(batch, rewards, per_function, samples, rows=torch.arange(N)).advantages
            informative = (advantages.view(-1, r.num_generations) != 0).any(1).cpu()  # (P,)
            collector.add(Round(examples, batch, rewards, per_function, samples), informative)
            if collector.full or collector.rounds == r.max_sampling_rounds:
                break
        examples, whole, rewards, per_function, samples = collector.batch()
        metrics = collector.metrics()
        if metrics["dynamic_sampling/groups_kept"] < P:
            self.monitor.write(
                f"step {step}: dynamic sampling found {len(collector.kept)} groups with differing rewards in "
                f"{collector.rounds} rounds (rollout.max_sampling_rounds={r.max_sampling_rounds}), fewer than "
                f"train.prompts_per_step={P}: the step trains on those, the batch filled with equal-reward groups")
        batch = whole.select(self.rows)
        scored = self.advantages(batch, rewards, per_function, [samples[i] for i in self.rows.tolist()], logged)
        return examples, batch, scored, metrics

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

    def reference_logprobs(self, batch: RolloutBatch, active: torch.Tensor) -> torch.Tensor:
        """The reference model's log-probs (n, T): its own copy, or, with LoRA, the policy without adapters."""
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
            for mb in rows.split(self.config.micro_batch_size(distributed.world_size())) if len(rows) else ():
                out[mb] = self.logprobs(model, batch, mb)  # (M, T)
            return out
        finally:
            model.train(was_training)
            if hasattr(model, "reshard"):  # FSDP2: no backward follows to free the gathered outer weights
                model.reshard()

    def optimize(self, batch: RolloutBatch, scored: Scored, old_logps: torch.Tensor | None,
                 ref_logps: torch.Tensor | None) -> UpdateStats:
        """num_iterations x updates_per_step optimizer updates on this process's completions.

        old_logps / ref_logps: (n, T) or None. This process's rows are in update order: update u
        uses local rows [u*S, (u+1)*S), S = completions_per_update / processes.
        """
        cfg, a = self.config, self.config.algorithm
        U = cfg.completions_per_update
        share = U // distributed.world_size()
        micro = cfg.micro_batch_size(distributed.world_size())
        # Only the model's own tokens are trained (not a conversation's tool results).
        mask, advantages, active = self.loss_mask(batch), scored.advantages, scored.active  # (n, T), (n,), (n,)
        metrics = _LossMetrics(token_metric_names(a.loss_type, self.loss_settings),
                               IS_OUTSIDE[self.loss_settings.is_mode] if self.is_correction else None)
        skipped, t_optimizer = 0, 0.0
        self.policy.train()
        for _ in range(a.num_iterations):
            for u0 in range(0, len(advantages), share):
                local = torch.arange(u0, u0 + share)
                # The whole update batch's counts, all processes, normalize every micro-batch's loss.
                num_tokens = distributed.all_reduce(mask[local].sum().double()).item()
                policy_mask = self.high_entropy_tokens(batch, mask, local) if a.top_entropy_quantile < 1 else None  # (n, T)
                rows = local[active[local]]
                update_loss = 0.0
                micro_batches = rows.split(micro) if len(rows) else ()  # split() of nothing gives one empty part
                for i, mb in enumerate(micro_batches):
                    out = compute_loss(a.loss_type, LossInputs(
                        logps=self.logprobs(self.policy, batch, mb),  # (M, T)
                        mask=mask[mb],
                        advantages=advantages[mb],
                        old_logps=None if old_logps is None else old_logps[mb],
                        ref_logps=None if ref_logps is None else ref_logps[mb],
                        sampling_logps=batch.sampling_logps[mb].to(self.device) if self.is_correction else None,
                        policy_mask=None if policy_mask is None else policy_mask[mb],
                        num_sequences=U,
                        num_tokens=num_tokens,
                        max_completion_length=cfg.rollout.max_completion_length,
                    ), self.loss_settings)
                    self.parallel.backward(out.loss, last=i == len(micro_batches) - 1)
                    update_loss += out.loss.item()
                    metrics.add_micro_batch(out, mask[mb], num_tokens)
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
                    if self.engine is not None and self.ahead is None:  # (ahead: copies are pushed, pipeline.py)
                        self.engine.weights_updated()
                    if a.sync_ref_model and self.scheduler.last_epoch % a.ref_model_sync_steps == 0:
                        self.sync_reference()
                else:
                    skipped += 1
        return UpdateStats(metrics.result(), skipped, t_optimizer)

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """(n, T) the tokens the loss trains: the model's own (not a conversation's tool results),
        less every token of a truncated completion with algorithm.mask_truncated_completions."""
        mask = batch.trained_mask
        if self.config.algorithm.mask_truncated_completions:
            kept = torch.tensor([f != "length" for f in batch.finish_reasons], dtype=mask.dtype, device=mask.device)
            mask = mask * kept[:, None]
        return mask

    def high_entropy_tokens(self, batch: RolloutBatch, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(n, T) bool, on the update's `rows`: the trained tokens whose sampling entropy is at least
        the (1 - top_entropy_quantile) quantile of every trained token's of the update, all processes
        (TRL's threshold, taken per micro-batch there; over the whole update here)."""
        if batch.entropies is None:
            raise ConfigError(f"algorithm.top_entropy_quantile={self.config.algorithm.top_entropy_quantile} selects "
                              f"tokens by their sampling entropy, which rollout.engine={self.config.rollout.engine} "
                              "does not measure: use the transformers engine, or remove it")
        entropies = batch.entropies.to(mask.device)  # (n, T)
        trained = mask.bool()
        values = torch.cat(distributed.gather_lists([entropies[rows][trained[rows]].double().cpu()]))
        out = torch.zeros_like(trained)
        if values.numel():
            threshold = quantile(values, 1 - self.config.algorithm.top_entropy_quantile)
            out[rows] = (entropies[rows].double() >= threshold) & trained[rows]
        return out

    @torch.no_grad()
    def sync_reference(self) -> None:
        """algorithm.sync_ref_model (TR-DPO): ref = alpha * policy + (1 - alpha) * ref, weight by weight."""
        alpha = self.config.algorithm.ref_model_mixup_alpha
        for ref, weight in zip(self.reference.parameters(), self.policy.parameters(), strict=True):
            ref.mul_(1 - alpha).add_(weight.detach(), alpha=alpha)

    def rollout_metrics(self, batch: RolloutBatch, scored: Scored) -> tuple[dict, int]:
        """The step's reward and completion metrics (TRL's names), over all processes' completions,
        and the number of prompt and completion tokens the step saw. Completion lengths and token
        counts are of the model's own tokens (a conversation's tool results are not counted), as TRL's."""
        cfg, G = self.config, self.config.rollout.num_generations
        N, U = cfg.completions_per_step, cfg.completions_per_update
        mask = batch.trained_mask.cpu()  # (n, T)
        lengths = distributed.gather_rows(mask.sum(-1).float(), N, U)  # (N,)
        truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.float32)
        truncated = distributed.gather_rows(truncated, N, U)  # (N,)
        entropies = batch.entropies if batch.entropies is not None else torch.full(mask.shape, math.nan)
        totals = distributed.all_reduce(torch.stack([
            (entropies.cpu().double() * mask).sum(),
            mask.sum().double(),
            batch.prompt_mask.sum().cpu().double() + mask.sum(),
        ])).tolist()
        rewards = scored.rewards
        group_std = torch.stack([_std(g) for g in rewards.view(-1, G)])  # (P,) over the scored members
        return {
            **({"entropy": totals[0] / max(totals[1], 1.0)} if batch.entropies is not None else {}),
            # NaN marks "not applicable" (None): every mean and std is over the scored completions.
            "reward": _mean(rewards),
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": (group_std == 0).float().mean().item(),
            **{f"rewards/{n}/mean": _mean(v) for n, v in scored.per_function.items()},
            **{f"rewards/{n}/std": _std(v).item() for n, v in scored.per_function.items()},
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
            **(self.conversation_metrics(batch) if batch.conversations is not None else {}),
        }, int(totals[2])

    def conversation_metrics(self, batch: RolloutBatch) -> dict:
        """Tool use over all processes' conversations: calls and failed calls (raised, timed out,
        unknown or malformed) per rollout and in all, model turns, and the share of rollouts that
        used their last turn (the budget's share is completions/clipped_ratio)."""
        cfg = self.config
        N, U = cfg.completions_per_step, cfg.completions_per_update
        per_rollout = torch.tensor([[c.calls, c.failures, c.turns, c.stop == "max_turns"] for c in batch.conversations],
                                   dtype=torch.float64)  # (n, 4)
        calls, failures, turns, max_turns = distributed.gather_rows(per_rollout, N, U).T  # (N,) each
        return {
            "tools/calls_per_rollout": calls.mean().item(),
            "tools/failures": failures.sum().item(),
            "tools/failures_per_rollout": failures.mean().item(),
            "turns/mean": turns.mean().item(),
            "turns/max_turns_ratio": max_turns.mean().item(),
        }

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
        """Greedy completions on the held-out split, each process scoring its slice; gathered.

        Evaluation leaves the global RNGs as it found them (reward functions may draw from them),
        so when and how often a run evaluates never changes its training."""
        examples = self.task.eval_examples
        if not examples:
            return {}
        W, rank = distributed.world_size(), distributed.rank()
        first, last = rank * len(examples) // W, (rank + 1) * len(examples) // W
        rng = rng_state()
        logged = {}  # the reward functions' log_metric values, this process's
        state = self.progress.trainer_state(self.config, self.task)

        def scored(first: int, last: int, engine=None) -> list[dict]:
            chunk = [examples[min(i, len(examples) - 1)] for i in range(first, last)]  # padding repeats the last
            return score(engine or self.engine, self.tokenizer, self.rewards, chunk, self.greedy,
                         first_index=first, max_prompt_length=self.config.data.max_prompt_length,
                         multi_turn=self.multi_turn, state=state, logged=logged)

        if self.parallel.lockstep:  # equal slices (every forward is collective): the last padded, then cut
            share = -(-len(examples) // W)
            first, last = rank * share, rank * share + share
        try:
            if self.ahead is not None:  # the weights after `step` through the pipeline, in turn
                self.ahead.publish(step, self.weights_snapshot)
                records = distributed.on_main(lambda: scored(0, len(examples), self.ahead.through()))
            elif self.remote:  # process 0 alone talks to the server: it scores them all, and shares
                self.hand_weights_to_server()
                records = distributed.on_main(lambda: scored(0, len(examples)))
            else:
                records = distributed.gather_lists(scored(first, last))[:len(examples)]
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
        rng = {"processes": distributed.gather_lists([rng_state()]), "seed_stream": self.seed_stream.get_state()}
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
        pending = [] if self.ahead is None else self.ahead.pending()
        return rng, state, pending

    def save_checkpoint(self, captured: tuple[dict, dict, list[Queued]] | None = None) -> Path:
        """checkpoints/step-N (checkpoint.py) from this moment's state, or from a `captured` one
        (the weights and optimizer must not have changed since)."""
        rng, state, pending = captured or self.capture()
        # Gathered by every process when sharded; whole on process 0, which writes.
        weights = self.parallel.full_weights(self.policy) if self.parallel.lockstep else None
        optimizer_state = self.parallel.optimizer_state(self.policy, self.optimizer)

        def write(folder: Path) -> None:
            save_model(self.policy, self.tokenizer, folder, weights)
            if self.config.algorithm.sync_ref_model:  # the reference has moved from the initial policy
                torch.save(self.reference.state_dict(), folder / REFERENCE_FILE)
            if self.ahead is not None:  # (waiting for those still being generated)
                torch.save(Pipeline.saved(pending), folder / AHEAD_FILE)
            write_state_files(folder, self.config, optimizer_state, self.scheduler, rng, state)

        path = distributed.on_main(
            lambda: write_checkpoint(self.run_dir, state["step"], write, self.config.train.keep_checkpoints,
                                     self.checkpoint_size))
        self.saved_step = state["step"]
        return path

    def save_after_failure(self, captured: tuple[dict, dict, list[Queued]]) -> None:
        """A failure stops the run: save `captured`, the newest state the weights still match, if
        no checkpoint holds it yet, so that fixing the cause and resuming loses nothing."""
        step = captured[1]["step"]
        if step > (self.saved_step or 0):
            try:
                path = self.save_checkpoint(captured)
                failed = [q.step for q in captured[2] if q.failed()]
                again = f" (generating step(s) {failed} ahead failed: a resumed run generates them again, with " \
                        "that checkpoint's weights)" if failed else ""
                self.monitor.write(f"the run stopped after step {step}; that state is saved in {path}{again}")
            except Exception as e:  # noqa: BLE001 - the original error is the one to report
                self.monitor.write(f"saving step {step} after the failure failed too: {e}")

    def restart_hint(self) -> str:
        if self.saved_step is None:
            return "There is no checkpoint yet. Lower train.learning_rate, or check the rewards and the data."
        checkpoint = self.run_dir / "checkpoints" / f"step-{self.saved_step}"
        return (f"The newest checkpoint, {checkpoint}, holds the weights from before. A resumed run must keep "
                f"its config: to lower train.learning_rate, start a new run from those weights "
                f"(model.name={checkpoint} and another train.output_dir), or check the rewards and the data.")

    def resume(self, folder: Path) -> None:
        """Continue from checkpoint `folder` (its weights are loaded already): optimizer, scheduler,
        RNGs, data position, counters."""
        optimizer_state, rng, state = load_state(folder, self.scheduler)
        if self.config.algorithm.sync_ref_model:
            self.reference.load_state_dict(torch.load(folder / REFERENCE_FILE, map_location="cpu", weights_only=True))
        self.parallel.load_optimizer_state(self.policy, self.optimizer, optimizer_state)
        processes = rng["processes"]
        # Each process its own RNG state; resumed on another process count, process 0's for all.
        set_rng_state(processes[distributed.rank()] if len(processes) == distributed.world_size() else processes[0])
        self.seed_stream.set_state(rng["seed_stream"])
        self.progress = Progress(state["step"], state["num_tokens"], state["skipped_steps"], state["skipped_in_a_row"],
                                 state.get("unscored_in_a_row", 0),  # (not in checkpoints of older versions)
                                 state["examples_seen"])
        self.stream = self.task.train_stream(start=state["examples_seen"])
        if self.ahead is not None:  # the steps generated ahead of the checkpoint, with weights it no longer has
            saved = distributed.on_main(lambda: torch.load(folder / AHEAD_FILE, weights_only=True))
            self.ahead.restore(saved, self.next_prompts)

    # ------------------------------------------------------------------ helpers

    def encode(self, example: Example, truncate: bool = True) -> list[int]:
        # data.long_prompts=truncate keeps the end; with "drop" no longer prompt is left.
        return encode_prompt(self.tokenizer, example.prompt, self.config.data.max_prompt_length if truncate else None,
                             None if self.tools is None else self.tools.schemas)

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

    def hand_weights_to_server(self) -> None:
        """Sharded weights reach the rollout server whole: every process gathers them (a collective)
        when the server needs them, and process 0's engine sends them."""
        if self.parallel.lockstep and distributed.on_main(lambda: self.engine.needs_weights()):
            weights = self.parallel.full_weights(self.policy)
            if distributed.is_main():
                self.engine.use_weights(weights)


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


def quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile's (linear interpolation), without its limit of 2^24 values."""
    ordered = values.sort().values
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return (ordered[low] + (ordered[high] - ordered[low]) * (position - low)).item()


def _mean(values: torch.Tensor) -> float:
    """Mean over the scored values (NaN = not applicable); NaN when none is scored."""
    scored = values[~torch.isnan(values)]
    return scored.mean().item() if scored.numel() else math.nan


def _std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the scored values; 0 with fewer than two."""
    scored = values[~torch.isnan(values)]
    return scored.std() if scored.numel() > 1 else values.new_zeros(())

