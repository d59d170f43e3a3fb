"""A run's checkpoints, as the trainer takes them: what a checkpoint holds (`capture`), writing it
(`save`, the files' format in rundir/checkpoint.py), saving the state from before a failure
(`FailureSave`, `save_after_failure`) and continuing from one (`resume`).

Each function takes the `Trainer` whose parts it saves or restores: its weights (the sharding
strategy gathers them), optimizer and schedule, the reference model where it moves
(algorithm.sync_ref_model), the RNGs, the sampler's queued steps and carried groups, and the
counters (training/state.py `Progress`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpokit.models.loading import save_model
from grpokit.rundir.checkpoint import load_state, rng_state, set_rng_state, write_checkpoint, write_state_files
from grpokit.runtime import distributed
from grpokit.sampling.sampler import Pending
from grpokit.training.state import Progress

# A checkpoint's reference model weights, with algorithm.sync_ref_model (it drifts towards the policy).
REFERENCE_FILE = "reference.pt"


def capture(trainer) -> tuple[dict, dict, Pending]:
    """(RNG states, trainer state, the steps queued ahead and the groups carried) as they are
    now; every process calls it (a collective)."""
    rng = {"processes": distributed.gather_lists([rng_state()]),
           "seed_stream": trainer.sampler.seed_stream.get_state()}
    p = trainer.progress
    state = {
        "step": p.step,
        "examples_seen": p.examples_seen,  # the data stream's position
        "num_tokens": p.num_tokens,
        "skipped_steps": p.skipped_steps,
        "skipped_in_a_row": p.skipped_in_a_row,
        "unscored_in_a_row": p.unscored_in_a_row,
    }
    # The steps generated ahead: saved with the checkpoint, their prompts after examples_seen.
    return rng, state, trainer.sampler.pending()


def save(trainer, captured: tuple[dict, dict, Pending] | None = None) -> Path:
    """checkpoints/step-N (rundir/checkpoint.py) from this moment's state, or from a `captured` one
    (the weights and optimizer must not have changed since)."""
    rng, state, pending = captured or capture(trainer)
    # Gathered by every process when sharded; whole on process 0, which writes.
    weights = trainer.parallel.checkpoint_weights(trainer.policy)
    optimizer_state = trainer.parallel.optimizer_state(trainer.policy, trainer.optimizer)

    def write(folder: Path) -> None:
        save_model(trainer.policy, trainer.tokenizer if trainer.vision is None else trainer.vision.processor, folder, weights)
        if trainer.config.algorithm.sync_ref_model:  # the reference has moved from the initial policy
            torch.save(trainer.reference.state_dict(), folder / REFERENCE_FILE)
        trainer.sampler.save(folder, pending)
        write_state_files(folder, trainer.config, optimizer_state, trainer.scheduler, rng, state)

    path = distributed.on_main(
        lambda: write_checkpoint(trainer.run_dir, state["step"], write, trainer.config.train.keep_checkpoints,
                                 trainer.checkpoint_size))
    trainer.progress.saved_step = state["step"]
    return path


def save_after_failure(trainer, captured: tuple[dict, dict, Pending]) -> None:
    """A failure stops the run: save `captured`, the newest state the weights still match, if
    no checkpoint holds it yet, so that fixing the cause and resuming loses nothing."""
    step = captured[1]["step"]
    if step > (trainer.progress.saved_step or 0):
        try:
            path = save(trainer, captured)
            failed = captured[2].failed()
            again = f" (generating step(s) {failed} ahead failed: a resumed run generates them again, with " \
                    "that checkpoint's weights)" if failed else ""
            trainer.monitor.write(f"the run stopped after step {step}; that state is saved in {path}{again}")
        except Exception as e:  # noqa: BLE001 - the original error is the one to report
            trainer.monitor.write(f"saving step {step} after the failure failed too: {e}")


def restart_hint(trainer) -> str:
    if trainer.progress.saved_step is None:
        return "There is no checkpoint yet. Lower train.learning_rate, or check the rewards and the data."
    checkpoint = trainer.run_dir / "checkpoints" / f"step-{trainer.progress.saved_step}"
    return (f"The newest checkpoint, {checkpoint}, holds the weights from before. A resumed run must keep "
            f"its config: to lower train.learning_rate, start a new run from those weights "
            f"(model.name={checkpoint} and another train.output_dir), or check the rewards and the data.")


def resume(trainer, folder: Path) -> Progress:
    """Continue from checkpoint `folder` (its weights are loaded already): optimizer, scheduler,
    RNGs, data position and the steps generated ahead; its counters."""
    optimizer_state, rng, state = load_state(folder, trainer.scheduler)
    if trainer.config.algorithm.sync_ref_model:
        trainer.reference.load_state_dict(torch.load(folder / REFERENCE_FILE, map_location="cpu", weights_only=True))
    trainer.parallel.load_optimizer_state(trainer.policy, trainer.optimizer, optimizer_state)
    processes = rng["processes"]
    # Each process its own RNG state; resumed on another process count, process 0's for all.
    set_rng_state(processes[distributed.rank()] if len(processes) == distributed.world_size() else processes[0])
    trainer.sampler.resume(folder, rng["seed_stream"], state["examples_seen"])
    return Progress(state["step"], state["num_tokens"], state["skipped_steps"], state["skipped_in_a_row"],
                    state.get("unscored_in_a_row", 0),  # (not in checkpoints of older versions)
                    state["examples_seen"], saved_step=state["step"])


class FailureSave:
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
