"""A step's metrics, each computed once, under no_grad, with the name TRL users know: the loss's
over the step's optimizer updates (`LossMetrics`), and the rewards, completion lengths, entropy and
what the rollouts did (`step_metrics`), all over every process's completions."""

from __future__ import annotations

import math

import torch

from grpokit.algorithm.loss import AUX_LOSS, IS_MAX, IS_MEAN, LossOutput
from grpokit.engines.batch import RolloutBatch
from grpokit.models.vision import IMAGE_TOKEN
from grpokit.rollouts.kinds import RolloutKind
from grpokit.runtime import distributed
from grpokit.sampling.scoring import Scored
from grpokit.settings.schema import Config


MAX_LOAD = "router/max_load"


class LossMetrics:
    """The loss's metrics over one step's optimizer updates, normalized here and only here.

    Per update: each token-summed metric (clip ratios, kl) divided by the update's token count,
    the loss as summed over its micro-batches, the gradient norm and learning rate. Then the mean
    over the updates, with every process's share summed. The rollout importance weight's mean and
    out-of-bounds share are over the tokens that had a forward pass, its max over all of them."""

    def __init__(self, names: tuple[str, ...], outside: str | None, balanced: tuple[int, int] | None = None):
        """names: the loss's token-summed metrics (loss.token_metric_names); outside: the importance
        weight's out-of-bounds metric (loss.IS_OUTSIDE) when the weight is on, else None; balanced:
        (the sequences of an update, the experts) when the loss has a load-balancing term (AUX_LOSS,
        its terms summed over the update's sequences and divided by their number, a sequence without
        a trained token adding 0; MAX_LOAD, the most chosen expert's choices over the mean
        expert's), else None."""
        self.names = names
        self.balanced = None if balanced is None else balanced[0]
        self.sums = dict.fromkeys(("loss", *names, *((AUX_LOSS,) if balanced else ())), 0.0)  # this process's shares
        # (E,) the experts' choices at the trained tokens, summed (with `balanced`)
        self.expert_counts = None if balanced is None else torch.zeros(balanced[1], dtype=torch.float64)
        self.shared = {"grad_norm": 0.0, "learning_rate": 0.0}  # the same on every process
        self.corrected = () if outside is None else (IS_MEAN, outside)
        self.counted = dict.fromkeys(self.corrected, 0.0)  # summed over the tokens that had a forward pass
        self.is_count = 0.0
        self.is_max = -math.inf
        self.updates = 0

    def add_micro_batch(self, out: LossOutput, mask: torch.Tensor, num_tokens: float,
                        expert_counts: torch.Tensor | None = None) -> None:
        """mask: (M, T) the micro-batch's; num_tokens: its whole update's, all processes;
        expert_counts: (E,) the experts' choices at its trained tokens (with a load-balancing term)."""
        undeclared = out.token_sums.keys() - {*self.names, *self.corrected}
        if undeclared:
            raise ValueError(f"the loss returned metrics {sorted(undeclared)} that loss.token_metric_names does not name")
        for name in self.names:
            self.sums[name] += (out.token_sums[name] / max(num_tokens, 1.0)).item()
        if self.balanced:
            self.sums[AUX_LOSS] += (out.sequence_sums[AUX_LOSS] / self.balanced).item()
            self.expert_counts += expert_counts.detach().double().cpu()
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
        if self.balanced:
            counts = distributed.all_reduce(self.expert_counts)  # (E,)
            out[MAX_LOAD] = (counts.max() / counts.mean()).item() if counts.sum() > 0 else math.nan
        if self.corrected:
            *totals, count = distributed.all_reduce(
                torch.tensor([*self.counted.values(), self.is_count], dtype=torch.float64)).tolist()
            for name, total in zip(self.corrected, totals):
                out[name] = total / count if count else math.nan  # nan: no token needed a gradient
            top = distributed.all_reduce(torch.tensor(self.is_max, dtype=torch.float64), "max").item()
            out[IS_MAX] = top if count else math.nan
        return out


def step_metrics(config: Config, batch: RolloutBatch, scored: Scored, kind: RolloutKind) -> tuple[dict, int]:
    """The step's reward and completion metrics (TRL's names), over all processes' completions,
    and the number of prompt and completion tokens the step saw. Completion lengths and token
    counts are of the model's own tokens (a conversation's tool results are not counted), as TRL's;
    what the rollouts did is the rollout kind's to say (rollouts/kinds.py)."""
    G = config.rollout.num_generations
    N, U = config.completions_per_step, config.completions_per_update
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
        **kind.metrics(batch, N, U),
        **(_image_metrics(config, batch) if batch.images is not None else {}),
    }, int(totals[2])


def _image_metrics(config: Config, batch: RolloutBatch) -> dict:
    """A vision-language model's prompts: images per prompt, and the share of completions that
    sampled an image placeholder token (which ends a completion: models/vision.py), over all processes."""
    N, U = config.completions_per_step, config.completions_per_update
    per_row = torch.tensor([[len(images), reason == IMAGE_TOKEN] for images, reason in
                            zip(batch.images, batch.finish_reasons)], dtype=torch.float64)  # (n, 2)
    images, sampled = distributed.gather_rows(per_row, N, U).T  # (N,) each
    return {"images/per_prompt": images.mean().item(), "completions/image_token_ratio": sampled.mean().item()}


def _mean(values: torch.Tensor) -> float:
    """Mean over the scored values (NaN = not applicable); NaN when none is scored."""
    scored = values[~torch.isnan(values)]
    return scored.mean().item() if scored.numel() else math.nan


def _std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the scored values; 0 with fewer than two."""
    scored = values[~torch.isnan(values)]
    return scored.std() if scored.numel() > 1 else values.new_zeros(())


class Waste:
    """Compute spent on positions nobody keeps, per step: `waste/decode` is the token positions
    decoding ran through the model (an in-process engine's counts: TransformersEngine) over the
    completion tokens it kept, `waste/passes` the positions the log-prob passes ran (LogProbs'
    counts) over those they needed (each micro-batch's prompts once, each completion's tokens but
    its last). 1.0 wastes nothing; padding and completions computed after they ended add to it.
    Counted from `start` to `step` (an evaluation between steps is not); over every process (a
    collective)."""

    def __init__(self, sampler, logprobs):
        self.sampler, self.logprobs = sampler, logprobs
        self.seen = self._counts()

    def _counts(self) -> list[int]:
        e, lp = self.sampler.engine, self.logprobs
        return [getattr(e, "decoded_positions", 0), getattr(e, "decoded_tokens", 0), lp.computed, int(lp.needed)]

    def start(self) -> None:
        self.seen = self._counts()

    def step(self) -> dict:
        """The waste since `start`, as metrics (a kind with nothing counted is left out)."""
        positions, kept, computed, needed = distributed.all_reduce(
            torch.tensor([b - a for a, b in zip(self.seen, self._counts())], dtype=torch.float64)).tolist()
        return {**({"waste/decode": positions / kept} if kept else {}),
                **({"waste/passes": computed / needed} if needed else {})}


class Pushes:
    """`weights/push_bytes`: the bytes each weight push to the rollout servers carried during a step
    (their mean; one push per server after each update): a LoRA policy's adapters, or the whole
    weights. Counted by process 0's engine (client.py), from `start` to `step`; left out when the
    step pushed nothing."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.seen = self._counts()

    def _counts(self) -> tuple[int, int]:
        return getattr(self.sampler.engine, "pushed", (0, 0))  # (bytes, pushes): a server engine's

    def start(self) -> None:
        self.seen = self._counts()

    def step(self) -> dict:
        if not self.sampler.remote:  # an engine of its own process pushes nothing: no collective per step
            return {}

        def pushed() -> dict:
            (bytes_before, before), (bytes_now, now) = self.seen, self._counts()
            return {"weights/push_bytes": (bytes_now - bytes_before) / (now - before)} if now > before else {}
        return distributed.on_main(pushed)
