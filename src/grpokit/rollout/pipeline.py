"""`rollout.max_staleness = k >= 1`: generation ahead of training, with bounded staleness.

The rollout server(s) generate the completions of step n while the steps before it train. Which
weights sample which step is fixed by k alone: step n samples with the weights after step

    w(n) = max(0, n - 1 - k)        (0: the weights the run started from)

so its staleness, (n - 1) - w(n) = min(k, n - 1) steps, is at most k, and a run is reproducible
from its seed whatever the timing. When step m starts, the trainer's weights (those after step
m - 1) are copied, since training goes on changing them, and step m + k is queued with them; steps
m .. m + k - 1 were queued before. One worker thread runs the queue in order, so the servers see
pushes and generations in the schedule's order, and the engine is only ever used from that thread
(an evaluation goes through the queue too: `call`).

The prompts and sampling seeds of a queued step are drawn when it is queued. A checkpoint after
step m holds the completions of steps m + 1 .. m + k (waited for): they were sampled with weights
the checkpoint no longer has, so a resumed run takes them from it instead of sampling them again.
A run resumed with a larger train.max_steps samples the steps its checkpoint did not hold ahead
with its newest weights (the `staleness` metric, read from the servers' answers, says so).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from grpokit.rollout import RolloutBatch


class ScheduleError(RuntimeError):
    """A server sampled a step with other weights than the schedule's."""


@dataclass
class Queued:
    """One step generated ahead."""

    step: int
    examples: list  # the step's prompts (tasks.Example)
    weights_step: int  # w(step): the weights it samples with
    batch: Future | RolloutBatch | None  # on the process with the engine; a Future until generated

    def failed(self) -> bool:
        """Whether its generation raised (waiting for it to end)."""
        return isinstance(self.batch, Future) and self.batch.exception() is not None

    def result(self) -> RolloutBatch:
        """The step's completions (waiting for them), checked against the schedule."""
        if isinstance(self.batch, RolloutBatch):
            return self.batch
        batch, answered = self.batch.result()
        if answered != self.weights_step:
            raise ScheduleError(f"step {self.step} was sampled with the weights after step {answered}; rollout."
                                f"max_staleness schedules those after step {self.weights_step}")
        return batch


class Pipeline:
    def __init__(self, engine, max_staleness: int, generate: Callable[[list, list[int]], RolloutBatch]):
        """engine: the rollout engine (None on the processes that have none: they draw the same
        prompts and seeds, and are handed their completions); generate(examples, seeds): a step's
        completions, run in the worker thread."""
        self.engine, self.k, self.generate = engine, max_staleness, generate
        self.queued: dict[int, Queued] = {}
        self.published: int | None = None  # the step of the weights last handed to the engine
        self.worker = None if engine is None else ThreadPoolExecutor(1, thread_name_prefix="grpokit-rollout")

    def weights_step(self, step: int) -> int:
        """w(step): the step whose weights sample step `step`."""
        return max(0, step - 1 - self.k)

    def publish(self, step: int, snapshot: Callable[[], list]) -> None:
        """Queue the weights after step `step` (taken now by `snapshot()`) for the generations queued
        after this, unless they are the engine's already."""
        if self.worker is not None and self.published != step:
            weights = snapshot()
            self.worker.submit(self.engine.use_weights, weights, step)
            self.published = step

    def fill(self, step: int, last: int, trained: int, draw: Callable[[], tuple[list, list[int]]],
             snapshot: Callable[[], list]) -> None:
        """Queue every step from `step` to min(step + k, `last`) not queued yet; `trained`: the step
        of the trainer's weights now; draw(): a step's prompts and seeds."""
        for n in range(step, min(step + self.k, last) + 1):
            if n in self.queued:
                continue
            examples, seeds = draw()
            w = trained  # w(n) for every step queued in order; fresher only after train.max_steps grew on resume
            if self.worker is None:
                self.queued[n] = Queued(n, examples, w, None)
                continue
            self.publish(w, snapshot)
            self.queued[n] = Queued(n, examples, w, self.worker.submit(self._generate, examples, seeds))

    def _generate(self, examples: list, seeds: list[int]) -> tuple[RolloutBatch, int | None]:
        batch = self.generate(examples, seeds)
        return batch, self.engine.weights_step

    def take(self, step: int) -> Queued:
        return self.queued.pop(step)

    def through(self):
        """The engine, its generations run in the worker thread in turn (an evaluation's)."""
        pipeline = self

        class Through:
            def generate(self, *args, **kwargs):
                return pipeline.call(lambda: pipeline.engine.generate(*args, **kwargs))

        return Through()

    def call(self, fn: Callable):
        """fn() in the worker thread, after everything queued before it; its result."""
        return fn() if self.worker is None else self.worker.submit(fn).result()

    # ---------------------------------------------------------------- checkpoints

    def pending(self) -> list[Queued]:
        """The steps queued now, in order (what a checkpoint taken now holds)."""
        return [self.queued[n] for n in sorted(self.queued)]

    @staticmethod
    def saved(pending: list[Queued]) -> list[dict]:
        """`pending` as a checkpoint stores them (waiting for their completions)."""
        out = []
        for q in pending:
            batch = q.result()
            out.append({"step": q.step, "weights_step": q.weights_step,
                        "batch": {f.name: getattr(batch, f.name) for f in fields(batch) if f.name != "conversations"}})
        return out

    def restore(self, saved: list[dict] | None, steps: list[int], draw_examples: Callable[[], list]) -> None:
        """Take back the queued `steps` of a checkpoint (`saved`: its completions, on the process
        with the engine), their prompts drawn again by draw_examples()."""
        entries = {e["step"]: e for e in saved or ()}
        for n in steps:
            examples = draw_examples()
            if self.worker is None:
                self.queued[n] = Queued(n, examples, self.weights_step(n), None)
            else:
                e = entries[n]
                self.queued[n] = Queued(n, examples, e["weights_step"], RolloutBatch(**e["batch"]))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=False, cancel_futures=True)
