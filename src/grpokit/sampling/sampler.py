"""How a step's completions come to be: `Sampler.step(n)` gives step n's prompts and this
process's completions of them, scored; the trainer never asks how they were made.

It owns the engine (in-process, one or several `grpokit serve` servers, vLLM), the data stream
and the sampling seeds, generation ahead of training (rollout.max_staleness, pipeline.py),
rollouts of the run's kind (rollouts/kinds.py: single-turn, conversations, agents), dynamic sampling's rounds
(dynamic_sampling.py), which of a step's completions this process owns, handing the trainer's
weights to the engine, and the greedy sampling of evaluations.

Every process draws the same prompts and seeds. Sampling seeds come one per completion from the
seed stream, so what a completion samples depends on its seed, not on which process samples it.
A remote engine is reached by process 0 alone: it asks for the whole step, and every process
keeps its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.config.checks import engine_problems
from grpokit.engines.batch import RolloutBatch, SamplingParams
from grpokit.engines.protocols import engine_class, make_engine
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.engines.weights import named_weights
from grpokit.models.loading import eos_token_ids
from grpokit.rewards.reward_set import merge_metrics
from grpokit.rollouts.kinds import RolloutKind
from grpokit.runtime import distributed
from grpokit.runtime.errors import ConfigError
from grpokit.sampling.dynamic_sampling import Collector, Round
from grpokit.sampling.evaluation import score
from grpokit.sampling.partial import Group, Partial
from grpokit.sampling.pipeline import Pipeline, Queued
from grpokit.sampling.scoring import Rewarded, Scored, Scorer
from grpokit.settings.schema import Config
from grpokit.tasks.task import Example

# A checkpoint's completions of the steps generated ahead of it, with rollout.max_staleness > 0.
AHEAD_FILE = "rollouts_ahead.pt"


@dataclass
class Pending:
    """The sampling in progress that a checkpoint taken now holds: the steps generated ahead
    (rollout.max_staleness), the groups carried into the next step (rollout.partial; generated
    ahead, the sampling state after the step last trained: Sampler._partial_state)."""

    queued: list[Queued]
    carried: list[Group] | dict | None

    def failed(self) -> list[int]:
        """The steps generated ahead whose generation failed."""
        return [q.step for q in self.queued if q.failed()]


@dataclass
class Sampled:
    """A step's prompts, and this process's completions of them, scored."""

    examples: list[Example]  # the step's prompts, the same on every process
    batch: RolloutBatch  # this process's completions (rows Sampler.rows of the step), on its device
    scored: Scored
    metrics: dict[str, float]  # how they were sampled: staleness (generated ahead), dynamic_sampling/*
    drawn: int  # prompts drawn from the data stream for them
    note: str | None = None  # what the user should hear about how they were sampled


class Sampler:
    def __init__(self, config: Config, task, kind: RolloutKind, tokenizer, policy, parallel, device: torch.device,
                 seed_stream: torch.Generator, vision=None):
        """kind: how a rollout is sampled (rollouts/kinds.py); policy: the model being trained, as
        `parallel` (training/sharding.py) holds it (its wrapping keeps the object); seed_stream: the
        generator each step draws its sampling seeds from; vision: a vision-language model's
        models.vision.Vision (prompts carry images), which the engine is made with."""
        self.config, self.task, self.kind, self.tokenizer, self.vision = config, task, kind, tokenizer, vision
        self.policy, self.parallel, self.device, self.seed_stream = policy, parallel, device, seed_stream
        r = config.rollout
        self.remote = engine_class(r.engine).remote  # generating in another process, reached by process 0 alone
        self.engine, self.is_correction = self._connect()
        # rollout.max_staleness > 0: the next steps are generated while this one trains (pipeline.py).
        self.ahead = Pipeline(self.engine, r.max_staleness, self._partial_ahead if r.partial else self._generate_ahead,
                              r.in_flight_updates) if r.max_staleness else None
        # The global completions of a step this process owns, in update order (runtime/distributed.py).
        self.rows = distributed.shard_rows(config.completions_per_step, config.completions_per_update,
                                           distributed.world_size(), distributed.rank())
        self.sampling, self.greedy = SamplingParams.of(r), SamplingParams.of(r, greedy=True)
        self.stream = task.train_stream()
        self.partial = Partial(config, tokenizer.pad_token_id, device) if r.partial else None
        # Partial rollouts generated ahead: the pipeline's thread alone draws from the streams; the
        # prompts it has drawn, and the sampling state after the step last trained (what a
        # checkpoint holds when no step is queued).
        self.position = 0
        self.taken_state = self._partial_state() if r.partial and r.max_staleness else None

    def _connect(self):
        """The rollout engine (None on the processes other than 0 when it is remote), and whether
        its sampling log-probs need the importance-sampling correction (algorithm/loss.py): they do when
        they come from other kernels than the trainer's."""
        c, engine = self.config, None

        def connect() -> bool:
            nonlocal engine
            engine = make_engine(c.rollout, self.policy, self.tokenizer, eos_token_ids(self.policy, self.tokenizer),
                                 c.model.name, lockstep=self.parallel.lockstep, vision=self.vision)
            found = engine_problems(c, engine.measures_entropies)  # a server says what it runs once reached
            if found:
                raise ConfigError.listing(found)
            return engine.exact_logprobs

        # A server that cannot be used stops every process (on_main hands process 0's error to all).
        exact = distributed.on_main(connect) if self.remote else connect()
        # Completions generated ahead come from older weights than the trainer's: corrected, whatever the kernels.
        self.always_corrected = c.rollout.is_correction and (not exact or c.rollout.max_staleness > 0)
        return engine, self.always_corrected

    # ------------------------------------------------------------------ a step

    def step(self, step: int, scorer: Scorer, state) -> Sampled:
        """Step `step`'s prompts and this process's completions of them, scored by `scorer`
        (state: the reward functions' trainer_state)."""
        if self.config.rollout.dynamic_sampling:
            return self._informative(step, scorer, state)
        if self.partial is not None and self.ahead is not None:
            return self._partial_taken(step, scorer, state)
        if self.partial is not None:
            return self._partial(step, scorer, state)
        if self.ahead is not None:  # queued up to step + k; this step's taken (waiting for it)
            self.queue(step)
            queued = self.ahead.take(step)
            whole = distributed.on_main(queued.result)
            batch = self._own_rows(whole)
            return Sampled(queued.examples, batch, scorer.score(queued.examples, batch, state),
                           {"staleness": step - 1 - queued.weights_step, **token_staleness(whole, step)},
                           len(queued.examples), self.ahead.notes.pop(step, None))
        examples = self.next_prompts()
        batch = self.sample(examples)
        return Sampled(examples, batch, scorer.score(examples, batch, state), {}, len(examples))

    def _partial(self, step: int, scorer: Scorer, state) -> Sampled:
        """Step `step` of partial rollouts (partial.py), with the weights after step - 1; a carried
        token's sampling log-prob is corrected for the lag (the trainer reads is_correction as the
        step trains). Every process runs the same rounds and carries the same groups, then keeps its
        rows of the trained ones: an in-process engine decodes each whole round on every process
        (the same tokens: a seed per completion, the same weights; under sharded weights its
        forwards are collective anyway), a remote one's rounds are process 0's, handed to all."""
        if self.remote:
            self._hand_weights_to_server()
        done = self._partial_rounds(step - 1, _OnMain(self.engine) if self.remote else self.engine)
        if distributed.world_size() > 1 and not self.remote:
            self._check_same_rounds(done)
        return self._partial_sampled(done, scorer, state)

    def _partial_rounds(self, version: int, engine):
        """A step of partial rollouts sampled with the weights after step `version` (partial.Step)."""
        def draw(k: int) -> list[Example]:
            self.position += k
            return [next(self.stream) for _ in range(k)]

        return self.partial.step(version, engine, self.kind.encoder, draw,
                                 lambda n: torch.randint(0, 2**62, (n,), generator=self.seed_stream), self.sampling,
                                 stops=isinstance(self.engine, TransformersEngine))

    def _partial_sampled(self, done, scorer: Scorer, state, metrics: dict | None = None) -> Sampled:
        """What a step of partial rollouts (`done`) gives the trainer: this process's rows, scored."""
        self.is_correction = self.always_corrected or (self.config.rollout.is_correction and done.lagged)
        batch = self._own_rows(done.batch)
        return Sampled(done.examples, batch, scorer.score(done.examples, batch, state), {**done.metrics, **(metrics or {})},
                       done.drawn)

    def _partial_ahead(self, examples: list, seeds: list, weights_step: int) -> tuple:
        """A step of partial rollouts generated ahead, in the pipeline's thread, with the weights
        after `weights_step`: it draws its prompts and seeds itself (`examples` and `seeds` are
        empty). The step, and the sampling state after it."""
        done = self._partial_rounds(weights_step, self.engine)
        done.batch = done.batch.to(torch.device("cpu"))  # (kept in a checkpoint, handed to every process)
        return done, self._partial_state()

    def _partial_state(self) -> dict:
        """What partial rollouts generated ahead resume from: the groups carried, the seed stream,
        the data stream's position (partial.Step lists are not changed once a step is done)."""
        return {"carried": self.partial.carried, "dtypes": self.partial.dtypes,
                "seed_stream": self.seed_stream.get_state(), "position": self.position}

    def _partial_taken(self, step: int, scorer: Scorer, state) -> Sampled:
        """Step `step` of partial rollouts generated ahead (rollout.max_staleness): sampled with the
        weights after w(step), its rounds ended when enough groups had (no wait for the longest
        completion); the lag metrics count from the trainer's weights."""
        self.queue(step)
        queued = self.ahead.take(step)
        done, self.taken_state = distributed.on_main(queued.result)
        stale = step - 1 - queued.weights_step
        metrics = {"staleness": stale, "partial/lag_mean": done.metrics["partial/lag_mean"] + stale,
                   "partial/lag_max": done.metrics["partial/lag_max"] + stale}
        return self._partial_sampled(done, scorer, state, metrics)

    def _check_same_rounds(self, done) -> None:
        """Every process decoded the step's rounds itself: they must have sampled the same tokens
        (the same kernels), or they would train and carry different completions."""
        mine = hash((tuple(done.batch.completion_ids.flatten().tolist()),
                     tuple(len(c.tokens) for g in self.partial.carried for c in g.completions)))
        if len(set(distributed.gather_lists([mine]))) > 1:
            raise RuntimeError("rollout.partial: the processes sampled different tokens from the same seeds and "
                               "weights (their kernels differ), so they would carry different completions; use a "
                               "rollout server (rollout.engine=server), whose rounds every process shares")

    def queue(self, step: int) -> None:
        """Generating ahead, before step `step` trains: queue the steps up to step + k not queued
        yet, with a host copy of the weights after step - 1 (a collective when sharded)."""
        if self.ahead is not None:  # (partial rollouts draw theirs in the pipeline's thread)
            draw = self._draw_ahead if self.partial is None else lambda: ([], [])
            self.ahead.fill(step, self.config.train.max_steps, step - 1, draw, self._weights_snapshot)

    def next_prompts(self) -> list[Example]:
        """A step's prompts, the next train.prompts_per_step of the data stream (the same on every process)."""
        return [next(self.stream) for _ in range(self.config.train.prompts_per_step)]

    def sample(self, examples: list[Example]) -> RolloutBatch:
        """The completions this process owns (rows `self.rows` of the step), grouped by prompt."""
        G = self.config.rollout.num_generations
        seeds = self._step_seeds()  # (N,) the whole step's
        if self.remote:  # process 0 asks for the whole step; each process keeps its rows
            self._hand_weights_to_server()
            batch = distributed.on_main(lambda: self._generate(examples, [G] * len(examples), self.sampling,
                                                               seeds.tolist()))
            return self._own_rows(batch)
        prompts, counts = torch.unique_consecutive(self.rows // G, return_counts=True)
        return self._generate([examples[p] for p in prompts.tolist()], counts.tolist(), self.sampling,
                              seeds[self.rows].tolist())

    def _own_rows(self, batch: RolloutBatch) -> RolloutBatch:
        """This process's rows of a whole step (a remote engine's in host memory), on its device."""
        return (batch if distributed.world_size() == 1 else batch.select(self.rows)).to(self.device)

    def _generate(self, examples: list[Example], counts: list[int], params: SamplingParams,
                  seeds: list[int] | None) -> RolloutBatch:
        """counts[i] completions of examples[i], as the run's rollout kind samples them."""
        return self.kind.generate(self.engine, examples, counts, params, seeds)

    def _step_seeds(self) -> torch.Tensor:
        """(N,) a step's sampling seeds, one per completion, from the seed stream (the same on every process)."""
        return torch.randint(0, 2**62, (self.config.completions_per_step,), generator=self.seed_stream)

    def _draw_ahead(self) -> tuple[list[Example], list[int]]:
        """The prompts and sampling seeds of the next step queued ahead."""
        return self.next_prompts(), self._step_seeds().tolist()

    def _generate_ahead(self, examples: list[Example], seeds: list[int], weights_step: int) -> RolloutBatch:
        """A whole step's completions, generated ahead (in the pipeline's thread)."""
        return self._generate(examples, [self.config.rollout.num_generations] * len(examples), self.sampling, seeds)

    def _informative(self, step: int, scorer: Scorer, state) -> Sampled:
        """Dynamic sampling (dynamic_sampling.py): rounds of sampling and scoring on prompts drawn
        from the data stream, until the step holds prompts_per_step informative groups or
        max_sampling_rounds rounds were sampled."""
        cfg, r = self.config, self.config.rollout
        N, P = cfg.completions_per_step, cfg.train.prompts_per_step
        collector = Collector(P, r.num_generations)
        logged, failed = {}, []  # the rounds' log_metric values, and their failures (kept or not)
        while not (collector.full or collector.rounds == r.max_sampling_rounds):
            examples = self.next_prompts()
            batch = self.sample(examples)
            rewarded = scorer.reward(examples, batch, state)
            logged, failed = merge_metrics(logged, rewarded.logged), failed + rewarded.failures
            batch, samples = self._whole_round(batch, rewarded.samples)
            # Informative: a group the round's advantages do not set to 0 (whatever the estimator and aggregation).
            advantages = scorer.advantages(batch, rewarded, rows=torch.arange(N)).advantages
            informative = (advantages.view(-1, r.num_generations) != 0).any(1).cpu()  # (P,)
            collector.add(Round(examples, batch, rewarded.rewards, rewarded.per_function, samples), informative)
        examples, whole, rewards, per_function, samples = collector.batch()
        metrics, note = collector.metrics(), None
        if metrics["dynamic_sampling/groups_kept"] < P:
            note = (f"step {step}: dynamic sampling found {len(collector.kept)} groups with differing rewards in "
                    f"{collector.rounds} rounds (rollout.max_sampling_rounds={r.max_sampling_rounds}), fewer than "
                    f"train.prompts_per_step={P}: the step trains on those, the batch filled with equal-reward groups")
        batch = whole.select(self.rows)
        owned = Rewarded(rewards, per_function, [samples[i] for i in self.rows.tolist()], logged, failures=failed)
        return Sampled(examples, batch, scorer.advantages(batch, owned), metrics,
                       int(metrics["dynamic_sampling/prompts_sampled"]), note)

    def _whole_round(self, batch: RolloutBatch, samples: list[dict]) -> tuple[RolloutBatch, list[dict]]:
        """A round's completions and their records, every process's, in global order."""
        N, U, W = self.config.completions_per_step, self.config.completions_per_update, distributed.world_size()
        if W > 1:
            # Where each process's completions go in a round's global order (the inverse of shard_rows).
            order = torch.argsort(torch.cat([distributed.shard_rows(N, U, W, k) for k in range(W)]))
            # (through CPU memory: a GPU tensor would be unpickled onto the GPU of the process that sent it)
            parts = distributed.gather_lists([batch.to(torch.device("cpu"))])
            batch = RolloutBatch.concat(parts).select(order).to(batch.completion_ids.device)
            everyone = distributed.gather_lists(samples)
            samples = [everyone[i] for i in order.tolist()]
        batch.prompt_index = torch.arange(N, device=batch.prompt_index.device) // self.config.rollout.num_generations
        return batch, samples

    # ------------------------------------------------------------------ weights

    def before_update(self) -> None:
        """The optimizer is about to update: vLLM in this process frees its memory for it."""
        if self.engine is not None and self.ahead is None:
            self.engine.sleep()

    def weights_changed(self) -> None:
        """An update was applied: the engine samples with the new weights (generating ahead, copies
        are pushed instead, pipeline.py)."""
        if self.engine is not None and self.ahead is None:
            self.engine.weights_updated()

    def _pushed_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What a push to the rollout servers carries, whole on process 0 (every process calls it: a
        collective when sharded): a LoRA policy's adapters where the servers take them, else the
        whole (merged) weights."""
        adapters = distributed.on_main(lambda: getattr(self.engine, "adapter_only", False))
        if adapters:
            return self.parallel.adapter_weights(self.policy)
        if self.parallel.lockstep:
            return self.parallel.full_weights(self.policy)
        return named_weights(self.policy) if distributed.is_main() else []

    def _weights_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of what a push carries (`_pushed_weights`) as it is now, in host memory, to push
        while the trainer changes its own weights."""
        return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in self._pushed_weights()]

    def _hand_weights_to_server(self) -> None:
        """Sharded weights reach the rollout server whole: every process gathers them (a collective)
        when the server needs them, and process 0's engine sends them."""
        if self.parallel.lockstep and distributed.on_main(lambda: self.engine.needs_weights()):
            weights = self._pushed_weights()
            if distributed.is_main():
                self.engine.use_weights(weights)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int, examples: list[Example], rewards, state, logged: dict) -> list[dict]:
        """Greedy completions of `examples` with the weights after `step`, scored by `rewards`
        (evaluate.score's records, in order), each process sampling its slice when the engine is
        its own; `logged` is filled with this process's log_metric values."""
        def scored(first: int, last: int, engine=None) -> list[dict]:
            chunk = [examples[min(i, len(examples) - 1)] for i in range(first, last)]  # padding repeats the last
            return score(self.kind, engine or self.engine, self.tokenizer, rewards, chunk, self.greedy,
                         first_index=first, state=state, logged=logged)

        if self.ahead is not None:  # the weights after `step` through the pipeline, in turn
            self.ahead.publish(step, self._weights_snapshot)
            return distributed.on_main(lambda: scored(0, len(examples), self.ahead.through()))
        if self.remote:  # process 0 alone talks to the server: it scores them all, and shares
            self._hand_weights_to_server()
            return distributed.on_main(lambda: scored(0, len(examples)))
        W, rank = distributed.world_size(), distributed.rank()
        first, last = rank * len(examples) // W, (rank + 1) * len(examples) // W
        if self.parallel.lockstep:  # equal slices (every forward is collective): the last padded, then cut
            share = -(-len(examples) // W)
            first, last = rank * share, rank * share + share
        return distributed.gather_lists(scored(first, last))[:len(examples)]

    # ------------------------------------------------------------------ checkpoints

    def pending(self) -> Pending:
        """The steps generated ahead and the groups carried, now (a checkpoint taken now holds them;
        generating partial rollouts ahead, the sampling state after the step last trained)."""
        carried = self.taken_state if self.taken_state is not None else self.partial and self.partial.carried
        return Pending([] if self.ahead is None else self.ahead.pending(), carried)

    def save(self, folder: Path, pending: Pending) -> None:
        """Write `pending` into checkpoint `folder` (waiting for the steps still being generated).
        Partial rollouts generated ahead: the steps queued up to the first that failed, and the
        sampling state after the last of them (the others are generated again on resume)."""
        queued, carried = pending.queued, pending.carried
        if self.partial is not None and self.ahead is not None:
            failed = next((i for i, q in enumerate(queued) if q.failed()), len(queued))
            queued = queued[:failed]
            carried = queued[-1].result()[1] if queued else carried
        if self.ahead is not None:
            torch.save(Pipeline.saved(queued), folder / AHEAD_FILE)
        if self.partial is not None:
            self.partial.save(folder, carried)

    def resume(self, folder: Path, seed_stream_state: torch.Tensor, examples_seen: int) -> None:
        """Continue from checkpoint `folder`: the seed stream, the data stream's position, and the
        steps generated ahead of it (with weights it no longer has)."""
        self.seed_stream.set_state(seed_stream_state)
        self.stream = self.task.train_stream(start=examples_seen)
        if self.ahead is not None:
            saved = distributed.on_main(lambda: torch.load(folder / AHEAD_FILE, weights_only=True))
            self.ahead.restore(saved, self.next_prompts if self.partial is None else list)
        if self.partial is not None:
            state = self.partial.restore(folder)
            if self.ahead is not None and state is not None and "position" in state:  # the streams as the last step queued left them
                self.seed_stream.set_state(state["seed_stream"])
                self.position = state["position"]
                self.stream = self.task.train_stream(start=self.position)
                self.taken_state = state

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        self.kind.close()
        if self.engine is not None:
            self.engine.close()


class _OnMain:
    """A remote engine, which process 0 alone reaches, as every process's: each generation runs on
    process 0 and its batch (in host memory) reaches every process."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kwargs) -> RolloutBatch:
        return distributed.on_main(lambda: self.engine.generate(*args, **kwargs).to(torch.device("cpu")))


def token_staleness(batch: RolloutBatch, step: int) -> dict[str, float]:
    """With in-flight weight updates (each token's weights known): the updates between the weights
    that sampled each trained token of step `step` and the trainer's (those after step - 1), mean
    and max; none otherwise."""
    if batch.versions is None or not batch.trained_mask.any():
        return {}
    lags = (step - 1 - batch.versions[batch.trained_mask.bool().to(batch.versions.device)]).double()
    return {"staleness/token_mean": lags.mean().item(), "staleness/token_max": lags.max().item()}
