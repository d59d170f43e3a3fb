"""`rollout.max_staleness = k >= 1`: generation ahead of training, with bounded staleness.

The rollout server(s) generate the completions of step n while the steps before it train. Which
weights sample which step is fixed by k alone: step n samples with the weights after step

    w(n) = max(0, n - 1 - k)        (0: the weights the run started from)

so its staleness, (n - 1) - w(n) = min(k, n - 1) steps, is at most k, and a run is reproducible
from its seed whatever the timing. When step m starts, the trainer's weights (those after step
m - 1) are copied to host memory, since training goes on changing them, and step m + k is queued
with them; steps m .. m + k - 1 were queued before. One worker thread runs the queue in order, so
the servers see pushes and generations in the schedule's order, and the engine is only ever used
from that thread (an evaluation goes through the queue too: `call`). Each answer says which
weights it was sampled with, and one that is not the schedule's stops the run.

The prompts and sampling seeds of a queued step are drawn when it is queued. A checkpoint after
step m holds the completions of steps m + 1 .. m + k (waited for): they were sampled with weights
the checkpoint no longer has, so a resumed run takes them from it instead of sampling them again.
Multi-turn completions (tools, environments, agents) are held with their conversations, pickled
with the environment instances the reward functions read. A step whose generation failed (its
servers down), or whose environments cannot be pickled, is held by its seeds instead: a resumed
run generates it again, with its newest weights. So does a run resumed with a larger
train.max_steps for the steps its checkpoint did not hold. The `staleness` metric says so.

Multi-turn generation runs in the worker thread too, tools and agents included: they overlap the
training of the steps before, as the engine's calls do.

With rollout.partial a queued step is a step of partial rollouts (partial.py): its job draws its
own prompts and seeds in the worker thread, which alone uses the streams then, and gives the step
with the sampling state after it (groups carried, seed stream, data position), which a checkpoint
holds with the steps queued (pickled) up to the first that failed.

With rollout.in_flight_updates the weights are pushed by a thread of their own as soon as they
are published, into the generations in flight (engines/in_flight.py): a generation begins once the
weights published before it was queued have reached the servers (w(step) or newer), and its later
tokens may be sampled by weights published since, each token tagged with its step. Which weights
sample which token then depends on timing: such a run is not reproducible from its seed.
"""

from __future__ import annotations

import io
import pickle
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields

from grpokit.engines.batch import RolloutBatch
from grpokit.engines.protocols import PipelineEngine


class ScheduleError(RuntimeError):
    """A server sampled a step with other weights than the schedule's."""


@dataclass
class Queued:
    """One step generated ahead."""

    step: int
    examples: list  # the step's prompts (tasks.Example)
    seeds: list[int]  # one per completion
    weights_step: int  # the step whose weights sample it: w(step), unless generated again on resume
    batch: Future | RolloutBatch | tuple | None  # on the process with the engine; a Future until generated
    newer: bool = False  # in-flight updates: it may begin with newer weights than weights_step

    def failed(self) -> bool:
        """Whether its generation raised (waiting for it to end)."""
        return isinstance(self.batch, Future) and self.batch.exception() is not None

    def result(self) -> RolloutBatch:
        """The step's completions (waiting for them), checked against the schedule."""
        if not isinstance(self.batch, Future):  # (taken back from a checkpoint)
            return self.batch
        batch, answered = self.batch.result()
        if answered is None:
            raise ScheduleError("the rollout server does not say which weights it sampled with (no weights_step in its "
                                "answer): an older grpokit serve? rollout.max_staleness needs the servers upgraded")
        if answered != self.weights_step and not (self.newer and answered > self.weights_step):
            raise ScheduleError(f"step {self.step} was sampled with the weights after step {answered}; rollout."
                                f"max_staleness schedules those after step {self.weights_step}")
        return batch


class Pipeline:
    def __init__(self, engine: PipelineEngine | None, max_staleness: int,
                 generate: Callable[[list, list[int], int], RolloutBatch], in_flight: bool = False):
        """engine: the rollout engine (None on the processes that have none: they draw the same
        prompts and seeds, and are handed their completions); generate(examples, seeds,
        weights_step): a step's completions (partial rollouts: the step and the sampling state after
        it, rollouts.py), run in the worker thread; in_flight: pushes go into the generations in flight."""
        self.engine, self.k, self.generate, self.in_flight = engine, max_staleness, generate, in_flight
        self.queued: dict[int, Queued] = {}
        self.again: dict[int, list[int]] = {}  # steps of a checkpoint to generate again: their seeds
        self.notes: dict[int, str] = {}  # what the user hears when such a step trains
        self.published: int | None = None  # the step of the weights last handed to the engine
        self.jobs: queue.Queue | None = None
        self.pushes: queue.Queue | None = None  # in flight: the pushes, in a thread of their own
        self.last_push: Future | None = None  # in flight: the push of the weights published last
        if engine is not None:
            # Daemon threads: a generation still waiting on a server never holds the process's exit.
            self.jobs = queue.Queue()
            threading.Thread(target=self._work, args=(self.jobs,), daemon=True, name="grpokit-rollout").start()
            if in_flight:
                self.pushes = queue.Queue()
                threading.Thread(target=self._work, args=(self.pushes,), daemon=True, name="grpokit-push").start()

    @staticmethod
    def _work(jobs: queue.Queue) -> None:
        while (job := jobs.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    future.set_exception(e)

    def submit(self, fn: Callable, jobs: queue.Queue | None = None) -> Future:
        """fn() queued in the worker thread (or on `jobs`); in flight, a generation waits first for
        the push of the weights published before it was queued."""
        future, push = Future(), self.last_push
        if jobs is None and push is not None:
            fn = lambda fn=fn: (push.exception(), fn())[1]  # noqa: E731 - (a failed push: the request pushes again)
        (jobs or self.jobs).put((future, fn))
        return future

    def weights_step(self, step: int) -> int:
        """w(step): the step whose weights sample step `step`."""
        return max(0, step - 1 - self.k)

    def publish(self, step: int, snapshot: Callable[[], list]) -> None:
        """Queue the weights after step `step`, taken now by `snapshot()` (on every process: a
        collective when the weights are sharded), for the generations queued after this, unless
        they are the engine's already."""
        if self.published == step:
            return
        weights = snapshot()
        if self.engine is not None and self.in_flight:
            self.last_push = self.submit(lambda: self.engine.push(weights, step), self.pushes)
        elif self.engine is not None:
            self.submit(lambda: self.engine.use_weights(weights, step))
        self.published = step

    def fill(self, step: int, last: int, trained: int, draw: Callable[[], tuple[list, list[int]]],
             snapshot: Callable[[], list]) -> None:
        """Queue every step from `step` to min(step + k, `last`) not queued yet; `trained`: the step
        of the trainer's weights now; draw(): a new step's prompts and seeds."""
        for n in range(step, min(step + self.k, last) + 1):
            if n in self.queued:
                continue
            if n in self.again:  # prompts and seeds drawn before the checkpoint
                examples, seeds = self.again.pop(n)
            else:
                examples, seeds = draw()
            self.publish(trained, snapshot)  # w(n) for every step queued in order; fresher only on resume
            batch = None if self.engine is None else self.submit(lambda e=examples, s=seeds, w=trained: self._generate(e, s, w))
            self.queued[n] = Queued(n, examples, seeds, trained, batch, self.in_flight)

    def _generate(self, examples: list, seeds: list[int], weights_step: int) -> tuple[RolloutBatch, int | None]:
        batch = self.generate(examples, seeds, weights_step)
        return batch, self.engine.weights_step

    def take(self, step: int) -> Queued:
        return self.queued.pop(step)

    def through(self):
        """The engine, its generations run in the worker thread in turn (an evaluation's, whose
        multi-turn loop and reward functions run in the trainer's thread)."""
        pipeline = self

        class Through:
            def generate(self, *args, **kwargs):
                return pipeline.call(lambda: pipeline.engine.generate(*args, **kwargs))

        return Through()

    def call(self, fn: Callable):
        """fn() in the worker thread, after everything queued before it; its result."""
        return fn() if self.jobs is None else self.submit(fn).result()

    # ---------------------------------------------------------------- checkpoints

    def pending(self) -> list[Queued]:
        """The steps queued now, in order (what a checkpoint taken now holds)."""
        return [self.queued[n] for n in sorted(self.queued)]

    @staticmethod
    def saved(pending: list[Queued]) -> list[dict]:
        """`pending` as a checkpoint stores them (waiting for their completions): each step's
        completions, or the seeds to generate it again with when its generation failed."""
        out = []
        for q in pending:
            entry = {"step": q.step, "weights_step": q.weights_step, "seeds": q.seeds}
            batch = None if q.failed() else q.result()
            if batch is not None and not isinstance(batch, RolloutBatch):  # partial rollouts' (step, state)
                entry["pickled"] = pickle.dumps(batch)
            elif batch is not None:
                # A vision-language model's images come back with the prompts, drawn again (restore).
                entry["batch"] = {f.name: getattr(batch, f.name) for f in fields(batch)
                                  if f.name not in ("conversations", "images")}
                entry["images"] = batch.images is not None
                if batch.conversations is not None:  # with their environments, which reward functions read
                    try:
                        entry["conversations"] = pickle.dumps(batch.conversations)
                    except Exception as e:  # noqa: BLE001 - an environment holding a connection, say
                        del entry["batch"]
                        entry["unsaved"] = f"its environments cannot be saved ({type(e).__name__}: {e})"
            out.append(entry)
        return out

    def restore(self, saved: list[dict], draw_examples: Callable[[], list]) -> None:
        """Take back a checkpoint's queued steps (`saved` as `saved` wrote them), their prompts
        drawn again by draw_examples(); those without completions are generated again."""
        for e in saved:
            examples = draw_examples()
            if "pickled" in e:  # (the run's own checkpoint)
                result = _Unpickler(io.BytesIO(e["pickled"])).load() if self.engine is not None else None
                self.queued[e["step"]] = Queued(e["step"], examples, e["seeds"], e["weights_step"], result)
                continue
            if "batch" not in e:
                self._again(e, examples, e.get("unsaved"))
                continue
            batch = RolloutBatch(**e["batch"]) if self.engine is not None else None
            if batch is not None and e.get("images"):
                batch.images = [examples[p].images for p in batch.prompt_index.tolist()]
            if batch is not None and "conversations" in e:
                try:
                    batch.conversations = _Unpickler(io.BytesIO(e["conversations"])).load()  # the run's own checkpoint
                except Exception as error:  # noqa: BLE001 - an environment's class moved or changed since
                    self._again(e, examples, f"its environments could not be read back ({type(error).__name__}: {error})")
                    continue
            self.queued[e["step"]] = Queued(e["step"], examples, e["seeds"], e["weights_step"], batch, self.in_flight)

    def _again(self, entry: dict, examples: list, why: str | None) -> None:
        """A checkpoint's step held by its seeds, generated again on resume; `why`, when it is not
        a failed generation, is said when the step trains."""
        self.again[entry["step"]] = (examples, entry["seeds"])
        if why is not None:
            self.notes[entry["step"]] = (f"step {entry['step']} was generated again on resume, with the checkpoint's "
                                         f"weights: {why}")

    def close(self) -> None:
        """Cancel what is queued; the workers end after the job in hand, and nothing waits for them."""
        for jobs in (self.jobs, self.pushes):
            if jobs is None:
                continue
            while True:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            jobs.put(None)


# Modules whose classes a checkpoint's pickles name (queued steps, carried groups: batches,
# completions, conversations, agents' outcomes), where they were when it was written and where they
# are now: a checkpoint of an older grpokit resumes. Each module's first home -> its home now.
MOVED_MODULES = {
    # rollout/ was grpokit's first layer of rollouts, then of engines alone; multiturn/ held the
    # rollouts of several generations. Now engines/ holds the engines, rollouts/ every rollout kind.
    **{f"grpokit.rollout.{name}": f"grpokit.rollouts.{name}" for name in ("conversation", "agents", "tools", "endpoint")},
    **{f"grpokit.multiturn.{name}": f"grpokit.rollouts.{name}"
       for name in ("agents", "conversation", "endpoint", "kinds", "request_fields", "responses_api", "tool_formats",
                    "tools", "transcript")},
    **{f"grpokit.rollout.{name}": f"grpokit.engines.{name}"
       for name in ("balance", "batch", "client", "decoding", "in_flight", "prompts", "protocols", "static_decoder",
                    "transformers_engine", "vllm_engine", "weights", "wire")},
    "grpokit.sampling.rollouts": "grpokit.sampling.sampler",
}


class _Unpickler(pickle.Unpickler):
    """pickle.loads that finds a class of MOVED_MODULES where it is now."""

    def find_class(self, module: str, name: str):
        return super().find_class(MOVED_MODULES.get(module, module), name)
