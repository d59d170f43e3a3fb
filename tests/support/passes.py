"""Every log-prob pass of grpokit, on one ragged batch, against a plain forward of each whole
sequence: the architecture matrix's measurements (tests/models/test_architectures.py and the command
that writes docs/models.md, benchmarks/architectures.py)."""

from __future__ import annotations

import torch

from grpokit.engines.batch import RolloutBatch
from grpokit.models.logprobs import LogProbs

# Two prompts of 5 and 9 tokens, three completions each, of 3 to 16 tokens: with a window of 8
# (support/architectures.py WINDOW), most sequences are longer than the window.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
LENGTHS = [16, 3, 11, 7, 14, 9]
GROUP = 3


def ragged_batch(vocab: int = 96, seed: int = 0, several_sequences: bool = False, lengths=LENGTHS,
                 after_prompt: bool = False) -> RolloutBatch:
    """The matrix's batch: PROMPTS x GROUP completions of LENGTHS (right-padded, random tokens
    from 20 up), or of `lengths`. With `several_sequences`, completions 0 and 4 are an agent's rows of two
    sequences: their second sequence (from token 6) begins anew, at position 0, or with
    `after_prompt` after the prompt's first tokens (all for row 0, all but one for row 4: it sees
    them, not the first sequence)."""
    g = torch.Generator().manual_seed(seed)
    N, T, Lp = len(lengths), max(lengths), max(map(len, PROMPTS))
    prompt_index = torch.arange(len(PROMPTS)).repeat_interleave(GROUP)
    prompt_ids = torch.zeros((N, Lp), dtype=torch.long)
    prompt_mask = torch.zeros((N, Lp), dtype=torch.long)
    for i, p in enumerate(prompt_index.tolist()):
        prompt_ids[i, Lp - len(PROMPTS[p]):] = torch.tensor(PROMPTS[p])
        prompt_mask[i, Lp - len(PROMPTS[p]):] = 1
    completion_ids = torch.randint(20, vocab, (N, T), generator=g)
    completion_mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    completion_ids[completion_mask == 0] = 0
    batch = RolloutBatch(prompt_index, prompt_ids, prompt_mask, completion_ids, completion_mask,
                         torch.zeros(N, T, dtype=torch.float64), None, ["length"] * N)
    if several_sequences:
        batch.sequence_ids = torch.zeros_like(completion_mask)
        for i in (0, 4):
            batch.sequence_ids[i, 6:lengths[i]] = 1
        if after_prompt:  # the second sequence begins with the prompt (all of it, or all but its last token)
            batch.sequence_prefix = torch.zeros_like(completion_mask)
            for i in (0, 4):
                batch.sequence_prefix[i, 6:lengths[i]] = len(PROMPTS[prompt_index[i]]) - (i == 4)
    return batch


@torch.no_grad()
def plain_logprobs(model, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """(N, T) log-probs of each completion token from a plain forward of its whole sequence, one
    sequence at a time, no padding, no cache: token t is predicted from the sequence of token t-1
    (the prompt and the completion's first sequence, a later sequence alone from its start, or the
    prompt and a later sequence after it); 0 on padding."""
    N, T = batch.completion_ids.shape
    out = torch.zeros(N, T, dtype=torch.float64)
    for i in range(N):
        n = int(batch.completion_mask[i].sum())
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        tokens = batch.completion_ids[i, :n].tolist()
        seqs = [0] * n if batch.sequence_ids is None else batch.sequence_ids[i, :n].tolist()
        shared = [0] * n if batch.sequence_prefix is None else batch.sequence_prefix[i, :n].tolist()
        starts = [t for t in range(n) if t == 0 or seqs[t] != seqs[t - 1]]
        for a, b in zip(starts, [*starts[1:], n]):
            context = (prompt if seqs[a] == 0 else prompt[:shared[a]]) + tokens[a:b]  # this sequence's inputs
            logits = model(input_ids=torch.tensor([context])).logits[0].double() / temperature  # (L, V)
            logp = torch.log_softmax(logits, -1)
            offset = len(context) - (b - a)  # the row index of tokens[a]
            # the output after token t-1 (t in a+1 .. b) predicts token t; a first sequence's also token a
            for t in range(a if seqs[a] == 0 else a + 1, min(b + 1, n)):
                out[i, t] = logp[offset + t - a - 1, tokens[t]]
    return out


def mask_of(batch: RolloutBatch) -> torch.Tensor:
    """Where a pass's log-prob is defined: a completion's tokens, but a later sequence's first
    (predicted from the sequence before it, never trained)."""
    mask = batch.completion_mask.bool().clone()
    if batch.sequence_ids is not None:
        mask[:, 1:] &= batch.sequence_ids[:, 1:] == batch.sequence_ids[:, :-1]
    return mask


PASSES = ("shared prompt", "whole sequences", "padded micro-batches", "packed", "packed, small budget", "chunked",
          "whole model")


def pass_logprobs(model, batch: RolloutBatch, name: str, temperature: float = 1.0) -> torch.Tensor:
    """(N, T) log-probs of `batch`'s completions by the pass `name` (PASSES), as a step's passes
    run (models/logprobs.py LogProbs): micro-batches of 6 completions (2 in "padded micro-batches"),
    or packed ones of at most 10,000 (or 24) tokens."""
    tokens = {"packed": 10_000, "packed, small budget": 24}.get(name)
    passes = LogProbs(model, None, temperature, chunk_size=5 if name == "chunked" else None,
                      checkpointing=name == "whole sequences", whole_model=name == "whole model",
                      micro_batch=2 if name == "padded micro-batches" else 6, device=torch.device("cpu"),
                      micro_batch_tokens=tokens)
    rows = torch.arange(len(batch.finish_reasons))
    was_training = model.training
    model.train(name == "whole sequences")  # (checkpointing runs sequences whole in training mode only)
    try:
        with torch.no_grad():
            return torch.cat([passes.of(model, batch, mb) for mb in passes.micro_batches(batch, rows)])
    finally:
        model.train(was_training)


DECODERS = ("dynamic", "dynamic, 2 slots", "static")


def sampled(model, decoder: str, temperature: float = 1.0, max_tokens: int = 14):
    """A batch sampled from PROMPTS (GROUP each) by the in-process engine's decoder `decoder`
    (DECODERS); the EOS is id 2, which a random model rarely samples, so completions run long."""
    from grpokit.engines.batch import SamplingParams
    from grpokit.engines.transformers_engine import TransformersEngine

    name, slots = ("dynamic", 2) if decoder == "dynamic, 2 slots" else (decoder, None)
    engine = TransformersEngine(model, pad_id=0, eos_ids=[2], decoder=name, slots=slots)
    seeds = list(range(len(PROMPTS) * GROUP))
    return engine.generate(PROMPTS, GROUP, SamplingParams(max_tokens, temperature=temperature), seeds=seeds)
