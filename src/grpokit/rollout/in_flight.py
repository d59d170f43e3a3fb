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

from grpokit.rollout.batch import SamplingParams, consecutive_groups


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
                 params: SamplingParams, seeds: Sequence[int] | None, weights: Callable[[], int | None]) -> list[dict]:
        """counts[i] completions of prompts[i] by `engine` (its generate takes until and offsets),
        each segment under `lock`, which a push takes between two; weights(), called under the
        lock before each segment, checks that the engine still holds the request's weights (or
        newer ones of the same trainer) and gives the label of those it holds. Each completion as
        a server answers it, with the label of every token's weights (`weights_steps`)."""
        own = [p for p, k in zip(prompts, counts) for _ in range(k)]  # each completion's prompt
        out = [{"token_ids": [], "logprobs": [], "entropies": [], "weights_steps": [], "finish_reason": None}
               for _ in own]
        while todo := [i for i, c in enumerate(out) if c["finish_reason"] is None]:
            with self.turn:
                self.turn.wait_for(lambda: self.waiting == 0)
            with lock:
                label = weights()
                room = [params.max_tokens - len(out[i]["token_ids"]) for i in todo]
                # Completions not begun share their prompt's prefill (consecutive identical prompts).
                unique, runs = consecutive_groups([own[i] + out[i]["token_ids"] for i in todo])
                batch = engine.generate(unique, runs, replace(params, max_tokens=max(room)),
                                        None if seeds is None else [seeds[i] for i in todo],
                                        until=lambda *_: self.waiting > 0,
                                        offsets=[len(out[i]["token_ids"]) for i in todo])
            lengths = batch.completion_mask.sum(-1).tolist()
            for j, i in enumerate(todo):
                c, n = out[i], lengths[j]
                kept = min(n, room[j])  # (a completion with less room than the segment's is cut)
                c["token_ids"] += batch.completion_ids[j, :kept].tolist()
                c["logprobs"] += batch.sampling_logps[j, :kept].tolist()
                c["entropies"] = None if batch.entropies is None or c["entropies"] is None else \
                    c["entropies"] + batch.entropies[j, :kept].tolist()
                c["weights_steps"] += [label] * kept
                if batch.finish_reasons[j] != "length" and kept == n:  # an EOS within its room
                    c["finish_reason"] = batch.finish_reasons[j]
                elif len(c["token_ids"]) >= params.max_tokens:
                    c["finish_reason"] = "length"
        return out
