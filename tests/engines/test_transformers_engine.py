import copy

import pytest
import torch

from grpokit.engines.batch import SamplingParams
from grpokit.engines.transformers_engine import TransformersEngine, sample_next
from grpokit.models.loading import eos_token_ids




def test_pad_equal_to_eos_keeps_the_eos_in_the_mask(tiny):
    model, tokenizer = tiny
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # the trap in SmolLM2's tokenizer
    eos = tokenizer.eos_token_id
    engine = TransformersEngine(model, pad_id=eos, eos_ids=[eos])
    batch = engine.generate([[5, 6, 7], [8, 9]], 3, SamplingParams(max_tokens=6), seeds=range(6))
    N, T = batch.completion_ids.shape
    assert N == 6 and T <= 6
    assert batch.prompt_ids.shape == (6, 3) and batch.prompt_mask[3:].tolist()[0] == [0, 1, 1]
    for i in range(N):
        ids, m = batch.completion_ids[i].tolist(), batch.completion_mask[i].tolist()
        n = sum(m)
        assert m == [1] * n + [0] * (T - n)
        if batch.finish_reasons[i] == "stop":
            assert ids[n - 1] == eos and eos not in ids[: n - 1]
        else:
            assert n == 6 and eos not in ids
    assert batch.entropies.shape == (N, T) and (batch.entropies[batch.completion_mask == 0] == 0).all()


def test_forced_eos_gives_stop_and_mask_with_eos(tiny):
    """Force EOS as the 3rd token by biasing the output layer: masks include it, pad after it."""
    model, tokenizer = tiny
    eos = eos_token_ids(model, tokenizer)[0]

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.step = model, 0
            self.parameters = model.parameters

        def forward(self, **kw):
            out = self.inner(**kw)
            if self.step == 2:  # third sampled token: prefill, decode 1, decode 2
                out.logits[..., eos] = 1e4
            self.step += 1
            return out

    engine = TransformersEngine(Biased(), pad_id=eos, eos_ids=[eos])
    engine.model.training, engine.model.eval, engine.model.train = False, lambda: None, lambda mode=True: None
    batch = engine.generate([[5, 6, 7]], 4, SamplingParams(max_tokens=8), seeds=[1, 2, 3, 4])
    assert batch.finish_reasons == ["stop"] * 4
    assert batch.completion_ids.shape[1] == 3
    assert (batch.completion_ids[:, 2] == eos).all()
    assert batch.completion_mask.tolist() == [[1, 1, 1]] * 4


def test_lockstep_decoding_goes_on_until_every_process_is_done(tiny, monkeypatch):
    """Sharded weights (sharding.py): a process whose completions all finished keeps making forward
    calls (masked, padding) while another process's are still running, and stops with the last."""
    from grpokit.runtime import distributed

    model, tokenizer = tiny
    every_token = list(range(model.config.vocab_size))  # every token ends a completion: done at once here
    others_running = [3, 2, 1, 0]  # what the all-reduce reports after each decoding step
    calls = []

    def all_reduce(t, op="sum"):
        if op == "max":  # the longest completion of any process: the other's, of 4 tokens
            return torch.maximum(t, torch.tensor(4))
        calls.append(t.item())
        return torch.tensor(t.item() + others_running[len(calls) - 1])

    monkeypatch.setattr(distributed, "all_reduce", all_reduce)
    forwards = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    engine = TransformersEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=every_token, lockstep=True)
    batch = engine.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=8), seeds=[1, 2])
    assert calls == [0, 0, 0, 0]  # this process had no unfinished completion after its first token
    assert len(forwards) == 1 + 3  # the prefill, then one decoding step per step another process ran
    assert batch.completion_mask.tolist() == [[1, 0, 0, 0]] * 2 and batch.finish_reasons == ["stop"] * 2
    alone = TransformersEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=every_token)
    assert alone.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=8), seeds=[1, 2]).completion_ids.shape[1] == 1


def test_sampling_is_seeded_and_greedy_is_argmax(tiny):
    model, tokenizer = tiny
    engine = TransformersEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id])
    params = SamplingParams(max_tokens=5)
    a = engine.generate([[1, 2, 3]], 4, params, seeds=[3, 4, 5, 6])
    b = engine.generate([[1, 2, 3]], 4, params, seeds=[3, 4, 5, 6])
    assert torch.equal(a.completion_ids, b.completion_ids)
    greedy = engine.generate([[1, 2, 3]], 2, SamplingParams(max_tokens=5, temperature=0))
    assert torch.equal(greedy.completion_ids[0], greedy.completion_ids[1])


def test_sampling_logps_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        tok, lp, ent, _ = sample_next(logits, SamplingParams(1, temperature=1.0, top_k=2), torch.rand(1, generator=g))
        seen.add(tok.item())
        expected = torch.log_softmax(logits[0, :2], -1)[tok.item()]
        assert abs(lp.item() - expected.item()) < 1e-6
    assert seen == {0, 1}
    # top_p=0.5: token 0 alone has p=0.64 >= 0.5, so it is the only one kept.
    for _ in range(20):
        tok, lp, _, _ = sample_next(logits, SamplingParams(1, temperature=1.0, top_p=0.5), torch.rand(1, generator=g))
        assert tok.item() == 0 and abs(lp.item()) < 1e-6
    # Entropy is the unfiltered tempered distribution's.
    p = torch.softmax(logits[0] / 0.5, -1)
    _, _, ent, _ = sample_next(logits, SamplingParams(1, temperature=0.5, top_k=1), torch.rand(1, generator=g))
    assert abs(ent.item() - (-(p * p.log()).sum()).item()) < 1e-5


def transformers_filtered(logits, params):
    """The logits transformers samples from with `params`: its warpers, in the order generate() chains them."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    warpers.append(MinPLogitsWarper(params.min_p))
    return warpers(None, logits.clone())


# On the tiny model's flat logits min-p keeps 816 tokens at temperature 0.3 and min_p 0.3, and 4188 of
# top-k's 10000 and of top-p's half of the mass at 0.7 and 0.5 (where vLLM's order would keep fewer).
@pytest.mark.parametrize("params", [SamplingParams(1, temperature=0.3, min_p=0.3),
                                    SamplingParams(1, temperature=0.7, min_p=0.5, top_k=10000),
                                    SamplingParams(1, temperature=0.7, min_p=0.5, top_p=0.5)],
                         ids=["min_p", "with-top_k", "with-top_p"])
def test_min_p_drops_the_tokens_transformers_drops(tiny, params):
    """On the tiny model's logits (nearly flat: min-p drops most of the mass): no sampled token is
    less likely than min_p times the most likely one, and each sampled token's log-prob is that of
    transformers' filtered, renormalised distribution (top-k and top-p first, as in generate())."""
    model, _ = tiny
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]])).logits[:, -1]  # (2, V)
    draws = 100
    rows = logits.repeat_interleave(draws, 0)  # (2 * draws, V)
    tok, lp, ent, _ = sample_next(rows, params, torch.rand(2 * draws, generator=torch.Generator().manual_seed(0)))
    p = torch.softmax(rows / params.temperature, -1)  # the naive reference: the tempered, unfiltered distribution
    assert (p.gather(-1, tok[:, None]).squeeze(-1) >= params.min_p * p.amax(-1)).all()
    filtered = transformers_filtered(rows, params)
    assert torch.isfinite(filtered.gather(-1, tok[:, None])).all()
    torch.testing.assert_close(lp, torch.log_softmax(filtered, -1).gather(-1, tok[:, None]).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=0, atol=1e-4)  # entropy: unfiltered, as with top-k/top-p
    # Without min-p, most draws from these flat distributions would be tokens it drops.
    plain, _, _, _ = sample_next(rows, SamplingParams(1, params.temperature, params.top_p, params.top_k),
                              torch.rand(2 * draws, generator=torch.Generator().manual_seed(0)))
    assert (p.gather(-1, plain[:, None]).squeeze(-1) < params.min_p * p.amax(-1)).float().mean() > 0.2


def test_the_engine_samples_with_min_p(tiny):
    """Through generate(): every sampled token passes min-p under the logits of its context
    (recomputed with the whole sequence), and its sampling log-prob is of the filtered distribution.
    A float64 model, so that the recomputed logits match the decoded ones to rounding."""
    from grpokit.models.logprobs import position_ids

    model = copy.deepcopy(tiny[0]).double()
    engine = TransformersEngine(model, pad_id=tiny[1].pad_token_id, eos_ids=[tiny[1].eos_token_id])
    params = SamplingParams(max_tokens=5, temperature=0.7, min_p=0.5)
    batch = engine.generate([[5, 6, 7], [8, 9]], 3, params, seeds=range(6))
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    Lp, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    logits = logits[:, Lp - 1 : Lp - 1 + T] / params.temperature  # (N, T, V): each completion token's context
    p = torch.softmax(logits, -1)
    tok = batch.completion_ids[..., None]
    on = batch.completion_mask.bool()
    assert (p.gather(-1, tok).squeeze(-1) >= params.min_p * p.amax(-1))[on].all()
    kept = logits.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), float("-inf"))
    expected = torch.log_softmax(kept, -1).gather(-1, tok).squeeze(-1)
    torch.testing.assert_close(batch.sampling_logps[on], expected[on].float(), rtol=0, atol=1e-5)


def test_per_prompt_counts_and_select(tiny):
    """A data-parallel process may own part of a group: n per prompt, and prompt_index names each."""
    model, tokenizer = tiny
    engine = TransformersEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id])
    params = SamplingParams(max_tokens=4)
    batch = engine.generate([[5, 6, 7], [8, 9]], [1, 3], params, seeds=[0, 1, 2, 3])
    assert batch.prompt_index.tolist() == [0, 1, 1, 1]
    assert batch.prompt_mask.tolist() == [[1, 1, 1]] + [[0, 1, 1]] * 3
    # One prompt with count n is the same request as the int n.
    a = engine.generate([[5, 6, 7]], [3], params, seeds=[4, 5, 6])
    b = engine.generate([[5, 6, 7]], 3, params, seeds=[4, 5, 6])
    assert torch.equal(a.completion_ids, b.completion_ids)
    with pytest.raises(ValueError, match="one positive count per prompt"):
        engine.generate([[5, 6, 7]], [1, 2], params, seeds=[0, 1, 2])
    with pytest.raises(ValueError, match="one seed per completion"):
        engine.generate([[5, 6, 7]], 2, params, seeds=[0])
    picked = batch.select(torch.tensor([3, 0]))
    assert picked.prompt_index.tolist() == [1, 0]
    assert torch.equal(picked.completion_ids, batch.completion_ids[[3, 0]])
    assert picked.finish_reasons == [batch.finish_reasons[3], batch.finish_reasons[0]]


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, -30.0, 0.0, -1.0]])  # token 2 has ~0 probability
    p = torch.softmax(logits[0] / 0.7, -1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    tokens, logps, _, _ = sample_next(logits.expand(20000, -1), SamplingParams(1, temperature=0.7), u)
    freq = torch.bincount(tokens, minlength=5).double() / 20000
    assert (freq - p).abs().max() < 0.01  # 4 standard errors at most
    assert torch.allclose(logps, p.log()[tokens].float())
    # The extremes of [0, 1) land on tokens of positive probability.
    edge, _, _, _ = sample_next(logits.expand(2, -1), SamplingParams(1, top_k=2), torch.tensor([0.0, 1 - 2**-24]))
    assert edge.tolist() == [0, 1]


def test_a_completion_samples_the_same_whatever_its_batch(tiny):
    """Seeded per completion: sampled alone or among others, on one process or another. (float64,
    so that the batch's float rounding cannot move a draw across a token boundary.)"""
    model, tokenizer = tiny
    engine = TransformersEngine(copy.deepcopy(model).double(), pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id])
    params = SamplingParams(max_tokens=5)
    together = engine.generate([[5, 6, 7], [8, 9]], 2, params, seeds=[10, 11, 12, 13])
    alone = engine.generate([[8, 9]], [1], params, seeds=[12])
    assert torch.equal(alone.completion_ids[0], together.completion_ids[2])


def test_completions_take_the_shape_of_their_prompt(tiny):
    """As in TRL: messages after a chat prompt, a string after a plain-text prompt."""
    from grpokit.engines.batch import decode_completions

    model, tokenizer = tiny
    engine = TransformersEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id])
    batch = engine.generate([[5, 6, 7]], 2, SamplingParams(max_tokens=3), seeds=[0, 1])
    chat, plain = decode_completions(tokenizer, batch, [[{"role": "user", "content": "q"}], "q"])
    assert chat[0]["role"] == "assistant" and isinstance(chat[0]["content"], str)
    assert isinstance(plain, str) and plain == tokenizer.decode(batch.completion_ids[1], skip_special_tokens=True)


def test_every_engine_implements_the_whole_protocol():
    """The trainer uses an engine only through RolloutEngine: every registered engine has all of it."""
    from grpokit.engines.protocols import ENGINES, RolloutEngine, engine_class

    members = set(RolloutEngine.__annotations__) | {n for n in vars(RolloutEngine) if not n.startswith("_")}
    assert {"exact_logprobs", "remote", "from_config", "generate", "needs_weights", "use_weights", "sleep",
            "close"} <= members
    for name in ENGINES:
        cls = engine_class(name)
        missing = [m for m in members if not (hasattr(cls, m) or m in cls.__annotations__)]  # set per instance
        assert not missing, (name, missing)
        assert isinstance(cls.remote, bool) and (name == "server") == cls.remote


def test_concat_pads_prompts_left_and_completions_right():
    from grpokit.engines.batch import RolloutBatch

    def batch(width, length, tag):
        return RolloutBatch(torch.zeros(2, dtype=torch.long), torch.full((2, width), tag), torch.ones(2, width, dtype=torch.long),
                            torch.full((2, length), tag), torch.ones(2, length, dtype=torch.long),
                            torch.full((2, length), -1.0), torch.ones(2, length), ["stop", "length"])

    joined = RolloutBatch.concat([batch(3, 5, 7), batch(4, 2, 8)])
    assert joined.prompt_ids.shape == (4, 4) and joined.completion_ids.shape == (4, 5)
    assert joined.prompt_mask.tolist() == [[0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2
    assert joined.completion_mask.tolist() == [[1] * 5] * 2 + [[1, 1, 0, 0, 0]] * 2
    assert torch.equal(joined.trained_mask, joined.completion_mask) and joined.finish_reasons == ["stop", "length"] * 2
    assert (joined.prompt_ids[:2, 1:] == 7).all() and (joined.completion_ids[2:, :2] == 8).all()
    assert (joined.sampling_logps[2:, 2:] == 0).all() and (joined.entropies[2:, 2:] == 0).all()


@pytest.mark.parametrize("decoder", ["dynamic", "static"])
def test_an_abandoned_generation_stops_at_the_next_look(tiny, decoder):
    """A served request whose client has gone (runtime/abandoned.py) ends at the next token the
    decoder looks at: every token for the dynamic decoder, every CHECK_EVERY for the static one."""
    import threading

    from grpokit.engines.static_decoder import CHECK_EVERY

    model, tok = tiny
    engine = TransformersEngine(model, tok.pad_token_id, eos_token_ids(model, tok), decoder=decoder)
    prompts, params = [tok.encode("hello there")], SamplingParams(64, temperature=1.0)
    whole = engine.generate(prompts, 3, params, [1, 2, 3])
    gone = threading.Event()
    gone.set()
    cut = engine.generate(prompts, 3, params, [1, 2, 3], abandoned=gone)
    assert whole.completion_mask.sum(-1).tolist() == [64] * 3  # (these seeds sample no EOS)
    assert cut.completion_mask.sum(-1).tolist() == [1 if decoder == "dynamic" else CHECK_EVERY] * 3
    assert torch.equal(cut.completion_ids, whole.completion_ids[:, :cut.completion_ids.shape[1]])
