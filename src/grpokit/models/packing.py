"""Packed passes (train.micro_batch_tokens): a micro-batch's completions in one row, no padding.

A padded micro-batch is (completions, longest completion): with ragged lengths most of its
positions are padding, computed and thrown away. A packed micro-batch is one row that holds, for
each prompt group in it, the prompt's tokens once and then each of its completions' tokens but
the last (the inputs that predict them), up to a budget of tokens:

    [prompt A][A's completion 1][A's completion 2][prompt B][B's completion 1] ...

A 4D attention mask keeps every sequence alone: a completion token attends to its own prompt and
its own earlier tokens, nothing else; positions restart per sequence (the prompt at 0, a
completion after its prompt), so each token's log-prob is the one it has run alone. The prompt's
last token predicts every completion's first token; completion token t-1 predicts token t. Only
those positions reach the output layer (`predictors`). An agent's row of several sequences
(RolloutBatch.sequence_ids) keeps its layout inside the pack: a later sequence attends only to
itself, at positions from 0, or also to the prompt's first tokens it begins with, after them
(models/sequences.py).

The row costs its length in the model's linear layers (no padding); its attention is computed
over the whole row and masked (L x L per micro-batch, where padded rows cost rows x T x T).

By default (neither train.micro_batch_size nor train.micro_batch_tokens set) a text model's step
picks by its lengths (`AUTO`): one padded pass where padding is a small part of it, as the default
run's short, even answers are; packed rows of AUTO_TOKENS where one padded pass would compute more
than AUTO_WASTE times the positions it needs (`padded_waste`), as long, ragged completions do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


AUTO = "auto"
AUTO_TOKENS = 1024  # the budget measured on a CPU (docs/speed-and-memory.md); set train.micro_batch_tokens elsewhere
AUTO_WASTE = 2.0  # as the waste alert's threshold: padding more than half the positions


def padded_waste(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, prompt_index: torch.Tensor) -> float:
    """Positions one padded pass over completions (B, T) computes (each distinct prompt once at the
    prompts' width, each completion at the longest's) over those it needs (each distinct prompt's
    tokens once, each completion's own). prompt_mask (B, Lp): completion b's prompt's;
    prompt_index (B,): which prompt it continues."""
    lengths = completion_mask.sum(-1)  # (B,)
    prompt_lengths = dict(zip(prompt_index.tolist(), prompt_mask.sum(-1).tolist()))  # one per distinct prompt
    needed = sum(prompt_lengths.values()) + int(lengths.sum())
    padded = len(prompt_lengths) * prompt_mask.shape[1] + len(lengths) * int(lengths.max())
    return padded / max(needed, 1)


def plan(lengths: list[int], prompt_lengths: list[int], groups: list[int], budget: int) -> list[list[int]]:
    """Micro-batches (lists of positions into `lengths`, in order) of at most `budget` packed
    tokens each: a micro-batch holds each of its groups' prompt once (prompt_lengths[i], of
    completion i's group groups[i]) and each completion's length but one. A completion whose
    tokens alone pass the budget gets a micro-batch of its own."""
    parts: list[list[int]] = []
    used, seen = 0, set()
    for i, (n, p, g) in enumerate(zip(lengths, prompt_lengths, groups)):
        cost = n - 1 + (0 if g in seen else p)
        if parts and used + cost <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
            used, seen = 0, set()
            cost = n - 1 + p
        used += cost
        seen.add(g)
    return parts


def split_to(parts: list[list[int]], count: int) -> list[list[int]]:
    """`parts` (a plan) split until there are `count` micro-batches, order kept: the one with the
    most completions (the first of equals) halved each time. Under sharded weights every process
    must make as many forward calls as the others (each is a collective); splitting only makes
    micro-batches smaller, so each stays under its budget. Needs count <= the completions in parts."""
    parts = list(parts)
    while len(parts) < count:
        i = max(range(len(parts)), key=lambda j: len(parts[j]))
        if len(parts[i]) < 2:
            raise ValueError(f"{sum(map(len, parts))} completions cannot make {count} micro-batches")
        half = len(parts[i]) // 2
        parts[i:i + 1] = [parts[i][:half], parts[i][half:]]
    return parts


@dataclass
class Packed:
    """One packed row: what the model takes, and where each completion token's log-prob comes from."""

    input_ids: torch.Tensor  # (1, L)
    position_ids: torch.Tensor  # (1, L)
    allowed: torch.Tensor  # (1, 1, L, L) True where a query sees a key
    predictors: torch.Tensor  # (K,) the row position whose output predicts each completion token
    targets: torch.Tensor  # (K,) that token
    slots: torch.Tensor  # (K,) where it goes in the (B, T) output, flattened: b * T + t


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
         completion_mask: torch.Tensor, prompt_index: torch.Tensor, sequence_ids: torch.Tensor | None = None,
         prefix: torch.Tensor | None = None) -> Packed:
    """The packed row of completions (B, T) after their prompts (P, Lp) (left-padded; completion
    b continues prompt prompt_index[b]; completions of one prompt follow it in the row in their
    order). completion_mask (B, T): 1 on each completion's tokens (right-padded); sequence_ids,
    prefix (B, T) or None: RolloutBatch.sequence_ids and sequence_prefix."""
    B, T = completion_ids.shape
    lengths = completion_mask.sum(-1).tolist()
    prompt_lengths = prompt_mask.sum(-1).tolist()
    order = prompt_index.tolist()
    ids, positions, group, owner, sequence, sees = [], [], [], [], [], []  # per row position
    index_in_prompt = []  # per row position: a prompt token's index in its prompt (a completion token's: -1)
    predictors, targets, slots = [], [], []
    last_of = {}  # prompt -> the row position of its last token
    for b in range(B):
        p = order[b]
        if p not in last_of:  # the prompt, once, before its first completion
            Lp, n = prompt_ids.shape[1], prompt_lengths[p]
            start = len(ids)
            ids += prompt_ids[p, Lp - n:].tolist()
            positions += range(n)
            group += [p] * n
            owner += [-1] * n
            sequence += [0] * n
            sees += [0] * n
            index_in_prompt += range(n)
            last_of[p] = start + n - 1
        n = lengths[b]
        seqs = [0] * n if sequence_ids is None else sequence_ids[b, :n].tolist()
        shared = [0] * n if prefix is None else prefix[b, :n].tolist()
        start = len(ids)
        # Inputs: tokens 0 .. n-2; token t at position prompt length + t, or, in a later sequence
        # of the row, at t minus that sequence's first token (plus the prompt length, after it).
        first = 0
        for t in range(n - 1):
            if t == 0 or seqs[t] != seqs[t - 1]:
                first = t
            positions.append(prompt_lengths[p] + t if seqs[t] == 0 else t - first + shared[t])
        ids += completion_ids[b, : n - 1].tolist()
        group += [p] * (n - 1)
        owner += [b] * (n - 1)
        sequence += seqs[: n - 1]
        sees += [prompt_lengths[p] if seqs[t] == 0 else shared[t] for t in range(n - 1)]
        index_in_prompt += [-1] * (n - 1)
        predictors += [last_of[p]] + list(range(start, start + n - 1))
        targets += completion_ids[b, :n].tolist()
        slots += [b * T + t for t in range(n)]
    device = completion_ids.device
    group_, owner_, sequence_, sees_, in_prompt = (torch.tensor(x, device=device)
                                                   for x in (group, owner, sequence, sees, index_in_prompt))
    index = torch.arange(len(ids), device=device)
    same = (owner_[:, None] == owner_) & (sequence_[:, None] == sequence_)  # (L, L) one sequence
    # a query sees its prompt's first `sees` tokens: all of it in a first sequence, a later one's prefix
    from_prompt = (owner_ == -1)[None, :] & (in_prompt[None, :] < sees_[:, None])
    allowed = (index[:, None] >= index) & (group_[:, None] == group_) & (same | from_prompt)  # (L, L)
    as_long = dict(dtype=torch.long, device=device)
    return Packed(torch.tensor([ids], **as_long), torch.tensor([positions], **as_long), allowed[None, None],
                  torch.tensor(predictors, **as_long), torch.tensor(targets, **as_long), torch.tensor(slots, **as_long))
