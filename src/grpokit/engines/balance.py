"""A generation split among several engines (rollout servers, vLLM replicas): whole prompt groups
in shares balanced by expected tokens, and the answers joined back in the prompts' order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from grpokit.engines.batch import RolloutBatch, from_completions


def split_groups(costs: list[int], k: int) -> list[list[int]]:
    """Indices of `costs` (one per prompt group, its expected tokens) in k shares of nearly equal
    cost: the costliest group first, each to the share with the least so far (ties: the lower
    share); each share in index order."""
    shares, loads = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(k), key=lambda j: (loads[j], j))
        shares[j].append(i)
        loads[j] += costs[i]
    return [sorted(s) for s in shares]


def split_generation(prompts: list[list[int]], counts: list[int], seeds: Sequence[int] | None, max_tokens: int,
                     k: int, among: list[int] | None = None) -> list[tuple[list[int], list[list[int]], list[int], list[int] | None]]:
    """The prompts `among` (default: all) of a generation, in k shares of whole prompt groups
    balanced by expected tokens (split_groups): each share's prompt indices, and its prompts,
    counts and seeds (None when greedy), what one engine of several is asked for. Shares may be empty."""
    among = list(range(len(prompts))) if among is None else among
    starts = [0, *itertools.accumulate(counts)]  # the completion index of each prompt's first
    shares = split_groups([counts[i] * (len(prompts[i]) + max_tokens) for i in among], k)
    out = []
    for share in shares:
        group = [among[j] for j in share]
        out.append((group, [prompts[i] for i in group], [counts[i] for i in group],
                    None if seeds is None else [int(seeds[c]) for i in group for c in range(starts[i], starts[i + 1])]))
    return out


def join_generation(prompts: list[list[int]], counts: list[int], answered: list[tuple[list[int], list[dict]]],
                    pad_id: int, images: list[tuple] | None = None) -> RolloutBatch:
    """from_completions over the answers to split_generation's shares (each: its prompt indices and
    their completions, in order), put back in the prompts' order."""
    by_prompt = {}
    for group, completions in answered:
        for i in group:
            by_prompt[i], completions = completions[:counts[i]], completions[counts[i]:]
    return from_completions(prompts, counts, [c for i in range(len(prompts)) for c in by_prompt[i]], pad_id, images)
