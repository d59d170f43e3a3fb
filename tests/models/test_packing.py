"""Packed passes (models/packing.py, train.micro_batch_tokens): each completion's log-probs are
those of its sequence run alone, in float64; micro-batches follow the token budget."""

import copy

import pytest
import torch

from grpokit.engines.batch import RolloutBatch
from grpokit.models.logprobs import LogProbs, completion_logprobs, packed_logprobs
from grpokit.models.packing import AUTO, AUTO_TOKENS, pack, padded_waste, plan, split_to


@pytest.fixture
def float64(monkeypatch):
    """Float64 all through (exact.py): any difference between two paths is then a bug, not rounding."""
    from support.exact import rmsnorm_in_input_dtype
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)


def alone(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    """log-softmax (L, V) of one unpadded sequence at `positions`, nothing else in its batch."""
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0]
    return torch.log_softmax(out.double() / 0.7, -1)


# Three prompts (left-padded), six completions of ragged lengths (right-padded; 0 pads).
PROMPTS = [[5, 6, 7, 8], [9, 10], [30, 31, 32]]
COMPLETIONS = [([11, 12, 13, 2], 0), ([14, 2], 0), ([15], 0), ([17, 18, 19, 20, 21], 1), ([22, 2], 1), ([23, 24, 2], 2)]


def _batch():
    W, T = max(map(len, PROMPTS)), max(len(c) for c, _ in COMPLETIONS)
    prompt_ids = torch.tensor([[0] * (W - len(p)) + p for p in PROMPTS])
    prompt_mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in PROMPTS])
    completion_ids = torch.tensor([c + [0] * (T - len(c)) for c, _ in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c, _ in COMPLETIONS])
    return prompt_ids, prompt_mask, completion_ids, completion_mask, torch.tensor([p for _, p in COMPLETIONS])


def test_packed_logprobs_are_each_sequence_run_alone(tiny, float64):
    """Values at 1e-12, and the gradient of a weighted sum that of the sequences run alone."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, index = _batch()
    model = copy.deepcopy(tiny[0]).double()
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask, index)
    # Each prompt once, each completion's tokens but the last: no padding.
    assert packed.input_ids.shape[1] == sum(map(len, PROMPTS)) + sum(len(c) - 1 for c, _ in COMPLETIONS)
    got = packed_logprobs(model, packed, completion_ids.shape, 0.7, None, False)
    weights = torch.linspace(-1, 1, got.numel()).view(got.shape).double() * completion_mask
    (got * weights).sum().backward()

    reference = copy.deepcopy(tiny[0]).double()
    total = 0
    for b, (c, p) in enumerate(COMPLETIONS):
        prompt = PROMPTS[p]
        logp = alone(reference, prompt + c[:-1], list(range(len(prompt) + len(c) - 1)))
        want = torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(c)])
        torch.testing.assert_close(got[b, : len(c)], want, rtol=0, atol=1e-12)
        assert (got[b, len(c):] == 0).all()
        total = total + (want * weights[b, : len(c)]).sum()
    total.backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert (a.grad - b.grad).norm() <= 1e-9 * b.grad.norm() + 1e-15, name


@pytest.mark.parametrize("variant", [dict(chunk_size=3), dict(whole_model=True), dict(whole_model=True, chunk_size=2)],
                         ids=["chunk3", "whole-model", "whole-model-chunk2"])
def test_packed_passes_of_every_kind_agree(tiny, float64, variant):
    """The model's own head at the predicting positions, its head chunk by chunk, and a call of the
    whole model (a sharded model's): the same values and gradients."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, index = _batch()
    packed = pack(prompt_ids, prompt_mask, completion_ids, completion_mask, index)

    def run(chunk_size=None, whole_model=False):
        model = copy.deepcopy(tiny[0]).double()
        logps = packed_logprobs(model, packed, completion_ids.shape, 0.7, chunk_size, whole_model)
        (logps * torch.linspace(-1, 1, logps.numel()).view(logps.shape)).sum().backward()
        return logps.detach(), {n: p.grad for n, p in model.named_parameters()}

    (ref, ref_grads), (got, grads) = run(), run(**variant)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    for name, g in grads.items():
        assert (g - ref_grads[name]).norm() <= 1e-9 * ref_grads[name].norm() + 1e-15, name


def test_rows_of_several_sequences_keep_their_layout_in_a_pack(tiny, float64):
    """An agent's row (RolloutBatch.sequence_ids): its second sequence attends only to itself, at
    positions from 0, packed beside other completions as alone."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, index = _batch()
    sequence_ids = torch.zeros_like(completion_ids)
    sequence_ids[3, 2:5] = 1  # completion 3: tokens 0-1 continue the prompt, tokens 2-4 a request of their own
    model = copy.deepcopy(tiny[0]).double()
    got = packed_logprobs(model, pack(prompt_ids, prompt_mask, completion_ids, completion_mask, index, sequence_ids),
                          completion_ids.shape, 0.7, None, False)
    prompt, c = PROMPTS[1], COMPLETIONS[3][0]
    first = alone(model, prompt + c[:2], list(range(len(prompt) + 2)))  # the prompt, then tokens 0 and 1
    second = alone(model, c[2:4], [0, 1])  # tokens 2 and 3, from position 0
    want = [first[len(prompt) - 1, c[0]], first[len(prompt), c[1]], first[len(prompt) + 1, c[2]],
            second[0, c[3]], second[1, c[4]]]  # token 2 is predicted by token 1, of the first sequence
    torch.testing.assert_close(got[3, :5], torch.stack(want), rtol=0, atol=1e-12)
    # The padded pass's layout of such rows (logprobs.sequence_layout) gives the same.
    padded = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, index, 0.7, sequence_ids=sequence_ids)
    torch.testing.assert_close(got, padded * completion_mask, rtol=0, atol=1e-12)
    # The other completions are as without sequence ids.
    plain = packed_logprobs(model, pack(prompt_ids, prompt_mask, completion_ids, completion_mask, index),
                            completion_ids.shape, 0.7, None, False)
    others = [0, 1, 2, 4, 5]
    torch.testing.assert_close(got[others], plain[others], rtol=0, atol=0)


def test_the_plan_fills_each_micro_batch_up_to_the_budget():
    lengths, prompts, groups = [4, 2, 1, 5, 2, 3], [4, 4, 4, 2, 2, 3], [0, 0, 0, 1, 1, 2]
    assert plan(lengths, prompts, groups, 10**6) == [[0, 1, 2, 3, 4, 5]]
    assert plan(lengths, prompts, groups, 1) == [[i] for i in range(6)]  # each alone, over the budget
    # prompt 0 + 3 + 1 + 0 = 8 tokens; completion 3 would add its prompt and 4: a new micro-batch.
    assert plan(lengths, prompts, groups, 9) == [[0, 1, 2], [3, 4], [5]]
    for budget in range(1, 30):
        parts = plan(lengths, prompts, groups, budget)
        assert [i for part in parts for i in part] == list(range(6))  # every completion once, in order
        for part in parts:  # each of its groups' prompt once, each completion's tokens but the last
            cost = sum({groups[i]: prompts[i] for i in part}.values()) + sum(lengths[i] - 1 for i in part)
            assert cost <= budget or len(part) == 1


def test_sharded_weights_split_a_plan_into_as_many_micro_batches_as_another_process_makes():
    """Under sharded weights each forward call is a collective: a process whose plan is shorter
    splits its fullest micro-batches (order kept, each still under its budget) to the longest count."""
    parts = [[0, 1, 2], [3, 4], [5]]
    assert split_to(parts, 3) == parts
    assert split_to(parts, 4) == [[0], [1, 2], [3, 4], [5]]
    assert split_to(parts, 5) == [[0], [1], [2], [3, 4], [5]]
    assert split_to(parts, 6) == [[i] for i in range(6)]
    with pytest.raises(ValueError, match="6 completions cannot make 7 micro-batches"):
        split_to(parts, 7)


def test_log_probs_split_by_tokens_and_count_their_padding(tiny):
    prompt_ids, prompt_mask, completion_ids, completion_mask, index = _batch()
    batch = RolloutBatch(index, prompt_ids[index], prompt_mask[index], completion_ids, completion_mask,
                         torch.zeros(completion_ids.shape), None, ["stop"] * 6)
    model = tiny[0]
    padded = LogProbs(model, None, 0.7, None, False, False, 6, torch.device("cpu"))
    packed = LogProbs(model, None, 0.7, None, False, False, 6, torch.device("cpu"), micro_batch_tokens=11)
    rows = torch.arange(6)
    assert [mb.tolist() for mb in packed.micro_batches(batch, rows)] == [[0, 1, 2], [3, 4], [5]]
    assert [mb.tolist() for mb in padded.micro_batches(batch, rows)] == [[0, 1, 2, 3, 4, 5]]
    for logprobs in (padded, packed):
        for mb in logprobs.micro_batches(batch, rows):
            logprobs.of(model, batch, mb)
    needed = sum(map(len, PROMPTS)) + sum(len(c) - 1 for c, _ in COMPLETIONS)
    assert packed.computed == packed.needed == padded.needed == needed
    # The padded pass: 3 prompts of width 4 but their last token, then 6 rows of 5.
    assert padded.computed == 3 * 3 + 6 * 5


def _rollout_batch(completions=COMPLETIONS):
    prompt_ids, prompt_mask, _, _, _ = _batch()
    T = max(len(c) for c, _ in completions)
    index = torch.tensor([p for _, p in completions])
    completion_ids = torch.tensor([c + [0] * (T - len(c)) for c, _ in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c, _ in completions])
    return RolloutBatch(index, prompt_ids[index], prompt_mask[index], completion_ids, completion_mask,
                        torch.zeros(completion_ids.shape), None, ["stop"] * len(completions))


def test_padded_waste_counts_one_padded_pass_against_the_tokens_it_needs():
    """Counted by hand: each distinct prompt once at the prompts' width, every completion at the longest."""
    batch = _rollout_batch()
    needed = sum(map(len, PROMPTS)) + sum(len(c) for c, _ in COMPLETIONS)  # 9 + 17
    assert padded_waste(batch.prompt_mask, batch.completion_mask, batch.prompt_index) == (3 * 4 + 6 * 5) / needed
    two = _rollout_batch(COMPLETIONS[:2])  # one prompt: counted once
    assert padded_waste(two.prompt_mask, two.completion_mask, two.prompt_index) == (4 + 2 * 4) / (4 + 4 + 2)


def test_by_default_a_step_packs_where_padding_would_be_most_of_its_pass(tiny):
    """packing.AUTO: a batch with one long completion among short ones packs (in rows of
    AUTO_TOKENS), an even one runs padded; the choice is made once per batch, for all its passes."""
    model = tiny[0]
    auto = LogProbs(model, None, 0.7, None, False, False, 6, torch.device("cpu"), micro_batch_tokens=AUTO)
    even = _rollout_batch([([11, 2], 0), ([14, 2], 0), ([15, 16], 1), ([22, 2], 2)])
    ragged = _rollout_batch([([11, 2], 0), ([14, 2], 0), ([15] + [16] * 20, 1), ([22, 2], 2)])
    assert padded_waste(ragged.prompt_mask, ragged.completion_mask, ragged.prompt_index) > 2
    assert auto.budget(even) is None and auto.budget(ragged) == AUTO_TOKENS
    assert [mb.tolist() for mb in auto.micro_batches(even, torch.arange(4))] == [[0, 1, 2, 3]]
    assert [mb.tolist() for mb in auto.micro_batches(ragged, torch.arange(4))] == [[0, 1, 2, 3]]
    for batch, computed in ((even, 3 * 3 + 4 * 2), (ragged, 4 + 2 + 3 + (1 + 1 + 20 + 1))):
        before = auto.computed
        auto.of(model, batch, torch.arange(4))
        assert auto.computed - before == computed  # padded: prompts but their last token, then 4 rows of 2
    padded = LogProbs(model, None, 0.7, None, False, False, 6, torch.device("cpu"))
    mask = ragged.completion_mask.bool()
    assert torch.allclose(auto.of(model, ragged, torch.arange(4))[mask], padded.of(model, ragged, torch.arange(4))[mask],
                          atol=1e-5)


def test_under_sharded_weights_every_process_packs_where_one_does(tiny, monkeypatch):
    """Their forward calls pair up: a process whose own batch is even packs when another's is ragged
    (the decision all-reduced with max; here the other process is played by the all-reduce)."""
    from grpokit.runtime import distributed

    asked = []
    monkeypatch.setattr(distributed, "all_reduce", lambda t, op="sum": asked.append((int(t), op)) or torch.ones_like(t))
    even = _rollout_batch([([11, 2], 0), ([14, 2], 0), ([15, 16], 1), ([22, 2], 2)])
    lockstep = LogProbs(tiny[0], None, 0.7, None, False, False, 6, torch.device("cpu"), micro_batch_tokens=AUTO,
                        lockstep=True)
    assert lockstep.budget(even) == AUTO_TOKENS and asked == [(0, "max")]
    lockstep.budget(even)
    assert len(asked) == 1  # decided once per batch


@pytest.mark.parametrize("given, vision, expected", [
    ([], False, AUTO), (["train.micro_batch_size=4"], False, None), ([], True, None),
    (["train.micro_batch_tokens=512"], False, 512)])
def test_the_passes_pick_by_lengths_unless_a_micro_batch_setting_or_images_say_otherwise(given, vision, expected):
    from grpokit.config.loading import load_config
    from grpokit.training.setup import micro_batch_tokens

    assert micro_batch_tokens(load_config(None, given), vision) == expected


@pytest.mark.parametrize("case", ["vision", "both-sizes"])
def test_what_packing_does_not_run_with_is_refused_at_start_up(case):
    """Images (their features are not in a packed row), and train.micro_batch_size set too."""
    from grpokit.config.checks import Facts, ModelFacts, check
    from grpokit.config.loading import load_config
    from grpokit.runtime.errors import ConfigError

    overrides = ["train.micro_batch_tokens=2048", *(["train.micro_batch_size=4"] if case == "both-sizes" else [])]
    facts = {"vision": Facts(model=ModelFacts(vision=True)), "both-sizes": Facts()}[case]
    message = {"vision": "train.micro_batch_tokens with a vision-language model is not supported",
               "both-sizes": "each set the micro-batches .*: set one of them"}[case]
    with pytest.raises(ConfigError, match=message):
        check(load_config(None, overrides), facts)
