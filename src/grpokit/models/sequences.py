"""Rows of several sequences (RolloutBatch.sequence_ids): an agent's request that did not extend
the one before, or a multi-turn rollout's turn whose history the chat template renders otherwise
(a thinking model's earlier reasoning dropped), begins a sequence of its own, so each token's
log-prob is the one it was sampled with. A sequence k > 0 attends only to its own tokens, at
positions from 0, or, where it begins with the first m tokens of the row's prompt
(RolloutBatch.sequence_prefix), to those and its own (not the row's earlier sequences), at
positions after them: the prefix they share is computed once.

Two ways to give a pass such rows, the same values:
- `sequence_layout`: the row as it is, under a 4D attention mask that keeps each sequence to
  itself (for models whose layers all take one: models/architecture.py `masks`);
- `Split`: each sequence as a row of its own (a later sequence's first token as its one-token
  prompt), for models with a layer that carries a state from token to token (linear attention, a
  convolution), which no mask can stop at a sequence's end. The first token of a later sequence is
  predicted from the sequence before it, as in the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token of every row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def sequence_layout(prompt_mask: torch.Tensor, sequence_ids: torch.Tensor,
                    prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys each query sees (B, 1, L, L) and the positions (B, L) of rows that are a prompt,
    then completion tokens but the last (L = Lp + T - 1), where completion token t is of sequence
    sequence_ids[:, t] (0: the prompt's; the module docstring): a token attends to the earlier
    tokens of its own sequence (the prompt's real tokens are sequence 0's) and to the first
    prefix[:, t] prompt tokens (a later sequence that begins with them); a later sequence's
    positions start after those. Every token attends to itself, so no row of the mask is empty
    (padding's included, whose outputs nothing reads). architecture.masks makes the mask each layer
    takes.

    prompt_mask: (B, Lp) left-padded; sequence_ids, prefix: (B, T) (prefix None: 0)."""
    Lp = prompt_mask.shape[1]
    sequence = torch.cat([torch.zeros_like(prompt_mask), sequence_ids[:, :-1]], 1)  # (B, L)
    real = torch.cat([prompt_mask, torch.ones_like(sequence_ids[:, :-1])], 1).bool()  # (B, L)
    index = torch.arange(sequence.shape[1], device=sequence.device)  # (L,)
    allowed = (index[:, None] >= index) & (sequence[:, :, None] == sequence[:, None, :]) & real[:, None, :]  # (B, L, L)
    begins = torch.ones_like(real)  # (B, L) where a sequence's first token is
    begins[:, 1:] = sequence[:, 1:] != sequence[:, :-1]
    first = torch.where(begins, index, 0).cummax(1).values  # (B, L) the index of each token's sequence's first token
    positions = torch.where(sequence == 0, position_ids(real), index - first)  # (B, L)
    if prefix is not None:  # a later sequence also sees the prompt's first m tokens, and follows them
        m = torch.cat([torch.zeros_like(prompt_mask), prefix[:, :-1]], 1) * (sequence != 0)  # (B, L)
        prompt_positions = torch.where(index < Lp, position_ids(real), Lp)  # (B, L) a prompt token's, else past any m
        allowed |= (prompt_positions[:, None, :] < m[:, :, None]) & real[:, None, :]
        positions = positions + m
    allowed |= torch.eye(len(index), dtype=torch.bool, device=sequence.device)
    return allowed[:, None], positions


@dataclass
class Split:
    """Completions (B, T) whose rows hold several sequences, as rows of one sequence each: a pass
    over `prompt_ids`, `prompt_mask` (P', Lp'), `completion_ids` (B', T'), `prompt_index` (B',)
    gives log-probs (B', T') that `back` puts where they belong in (B, T)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    prompt_index: torch.Tensor
    slots: torch.Tensor  # (K,) of each split token with a log-prob: b * T + t in the rows' (B, T)
    sources: torch.Tensor  # (K,) where it is in the split rows' (B', T'), flattened
    shape: tuple[int, int]  # (B, T)

    @classmethod
    def of(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
           completion_mask: torch.Tensor, prompt_index: torch.Tensor, sequence_ids: torch.Tensor,
           prefix: torch.Tensor | None = None) -> Split:
        """Row b (continuing prompt prompt_index[b] of (P, Lp)) split at its sequences: sequence 0
        continues the prompt, and takes its tokens and the next sequence's first (which its last
        token predicts); a later sequence is a new prompt of its first token (after the prompt's
        first `prefix` tokens, where it begins with them), then its other tokens and the next one's
        first."""
        B, T = completion_ids.shape
        lengths, seqs = completion_mask.sum(-1).tolist(), sequence_ids.tolist()
        shared = [[0] * len(row) for row in seqs] if prefix is None else prefix.tolist()
        prompts = [prompt_ids[p][prompt_mask[p].bool()].tolist() for p in range(len(prompt_ids))]
        pieces, index, slots = [], [], []  # per split row: its tokens, its prompt, and where each goes
        for b in range(B):
            n = lengths[b]
            starts = [t for t in range(n) if t == 0 or seqs[b][t] != seqs[b][t - 1]]
            for a, e in zip(starts, [*starts[1:], n]):
                first = a if a == 0 else a + 1  # the first token this row predicts
                if first >= min(e + 1, n):  # a one-token sequence at the end: nothing left to predict
                    continue
                if a > 0:  # a new prompt: this sequence's first token, after the prompt's tokens it begins with
                    before = prompts[int(prompt_index[b])][:shared[b][a]]
                    prompts.append(before + [int(completion_ids[b, a])])
                index.append(prompt_index[b].item() if a == 0 else len(prompts) - 1)
                pieces.append(completion_ids[b, first:min(e + 1, n)].tolist())
                slots.append([b * T + t for t in range(first, min(e + 1, n))])
        Lp, T2 = max(map(len, prompts)), max(map(len, pieces))
        device = completion_ids.device
        as_long = dict(dtype=torch.long, device=device)
        new_ids = torch.zeros((len(prompts), Lp), **as_long)
        new_mask = torch.zeros((len(prompts), Lp), **as_long)
        for i, p in enumerate(prompts):
            new_ids[i, Lp - len(p):], new_mask[i, Lp - len(p):] = torch.tensor(p, **as_long), 1
        ids = torch.zeros((len(pieces), T2), **as_long)
        for i, piece in enumerate(pieces):
            ids[i, :len(piece)] = torch.tensor(piece, **as_long)
        sources = [i * T2 + j for i, s in enumerate(slots) for j in range(len(s))]
        return cls(new_ids, new_mask, ids, torch.tensor(index, **as_long),
                   torch.tensor([x for s in slots for x in s], **as_long), torch.tensor(sources, **as_long), (B, T))

    def back(self, values: torch.Tensor) -> torch.Tensor:
        """Split rows' values (B', T', ...) in the rows' (B, T, ...), 0 where none is (differentiable)."""
        (B, T), rest = self.shape, values.shape[2:]
        kept = values.reshape(-1, *rest)[self.sources]  # (K, ...)
        return values.new_zeros(B * T, *rest).index_put((self.slots,), kept).view(B, T, *rest)
