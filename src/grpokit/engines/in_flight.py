"""In-flight weight updates (PipelineRL's): a rollout server takes a weight push between two decode
steps of a generation, without dropping the completions in flight.

A generation that lets pushes in (`Pushes.generate`) runs in segments. A push that arrives asks
the segment in hand to stop after its current token (the engine's `until`), loads its weights,
and the generation goes on: each unfinished completion continues from its prompt and its tokens
so far, so its prefix is computed again under the new weights and each later token is sampled from
them given everything before it (the in-process engine's continuation, as partial rollouts',
sampling/partial.py). A continued completion draws the uniforms its seed's stream holds from its
length on (the engine's `offsets`): under unchanged weights it samples what it would have
sampled uninterrupted. Every token is tagged with the weights that sampled it (the trainer step
they are from); the trainer's importance weights are per token (rollout.is_correction).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace

from grpokit.engines.batch import Completion, SamplingParams, consecutive_groups
from grpokit.runtime.abandoned import holding


class Pushes:
    """The pushes waiting for a server's engine, and the generations that let them in."""

    def __init__(self):
        self.waiting = 0  # pushes waiting for the engine
        self.turn = threading.Condition()

    @contextmanager
    def arriving(self):
        """Around a push: a generation in flight stops at its next token and waits until it is done."""
        with self.turn:
            self.waiting += 1
        try:
            yield
        finally:
            with self.turn:
                self.waiting -= 1
                self.turn.notify_all()

    def generate(self, engine, lock: threading.Lock, prompts: list[list[int]], counts: list[int],
                 params: SamplingParams, seeds: Sequence[int] | None, weights: Callable[[], int | None],
                 abandoned: threading.Event | None = None) -> list[dict]:
        """counts[i] completions of prompts[i] by `engine` (its generate takes until and offsets),
        each segment under `lock`, which a push takes between two; weights(), called under the
        lock before each segment, checks that the engine still holds the request's weights (or
        newer ones of the same trainer) and gives the label of those it holds. Each completion as
        a server answers it, with the label of every token's weights (`weights_steps`). `abandoned`,
        once set, stops it at its next token or before its next segment (Abandoned)."""
        own = [p for p, k in zip(prompts, counts) for _ in range(k)]  # each completion's prompt
        out = [Completion([], [], [], []) for _ in own]
        while todo := [i for i, c in enumerate(out) if c.finish is None]:
            with self.turn:
                self.turn.wait_for(lambda: self.waiting == 0)
            with holding(lock, abandoned):
                label = weights()
                # Completions not begun share their prompt's prefill (consecutive identical prompts).
                unique, runs = consecutive_groups([own[i] + out[i].tokens for i in todo])
                batch = engine.generate(unique, runs,
                                        replace(params, max_tokens=params.max_tokens - min(len(out[i].tokens) for i in todo)),
                                        None if seeds is None else [seeds[i] for i in todo],
                                        until=lambda *_: self.waiting > 0, offsets=[len(out[i].tokens) for i in todo],
                                        abandoned=abandoned)
            for j, (i, n) in enumerate(zip(todo, batch.completion_mask.sum(-1).tolist())):
                out[i].extend(batch, j, n, params.max_tokens, label)
        return [{"token_ids": c.tokens, "logprobs": c.logps, "entropies": c.entropies, "weights_steps": c.versions,
                 "finish_reason": c.finish} for c in out]
