"""rollout.decoder: the static decoder (a key/value cache sized once, every step the same shapes,
engines/static_decoder.py) samples what the dynamic decoder samples: the same
tokens from the same seeds, the same masks and finish reasons, log-probs and entropies to 1e-6, for
single-turn completions sharing their prompt's prefill, and for conversations (an agent's requests,
each continuing the one before)."""

import copy

import pytest
import torch

from grpokit.config.loading import load_config
from grpokit.engines.batch import SamplingParams
from grpokit.engines.static_decoder import StaticDecoder
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.runtime.errors import ConfigError
from grpokit.tasks.task import Example

PARAMS = {"sampled": SamplingParams(16, 1.0), "greedy": SamplingParams(16, 0.0),
          "filtered": SamplingParams(16, 0.8, top_p=0.9, top_k=50, min_p=0.01)}


def both(model, tokenizer, stops, generate):
    """generate(engine) with the dynamic decoder, then with the static one."""
    return [generate(TransformersEngine(model, tokenizer.pad_token_id, stops, decoder=d)) for d in ("dynamic", "static")]


def assert_same_samples(a, b, dtype):
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert a.finish_reasons == b.finish_reasons and torch.equal(a.prompt_index, b.prompt_index)
    # Sampling computes in float32 whatever the model's dtype (sample_next): with several threads,
    # its reductions over the vocabulary round by the batch's shape (with one, as `make test` runs,
    # they are equal).
    tol = 1e-12 if a.sampling_logps.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(b.sampling_logps, a.sampling_logps, atol=tol, rtol=0)
    # An entropy sums V terms to ~10 nats: its rounding is relative to that.
    torch.testing.assert_close(b.entropies, a.entropies, atol=tol, rtol=tol)


def ragged(tiny, dtype, params):
    """The tiny model in `dtype`, its tokenizer, three prompts of different lengths (left padding),
    generate(engine): their 3, 1 and 2 completions (sharing their prompt's prefill) from seeds 0-5,
    and that generation with padding the only stop (to choose stop tokens from)."""
    model, tokenizer = tiny
    model = copy.deepcopy(model).to(dtype)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 2?", "Hi", "A longer prompt than the two others")]

    def generate(engine):
        return engine.generate(prompts, [3, 1, 2], PARAMS[params], list(range(6)))

    first = generate(TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.pad_token_id]))
    return model, tokenizer, prompts, generate, first


@pytest.mark.parametrize("dtype, params", [(torch.float64, p) for p in PARAMS] + [(torch.float32, "sampled")],
                         ids=[f"float64-{p}" for p in PARAMS] + ["float32-sampled"])
@pytest.mark.parametrize("ending", ["one-ends-early", "all-end-early", "one-ends-at-each-step"])
def test_the_static_decoder_samples_what_the_dynamic_one_does(tiny, dtype, params, ending):
    """Prompts of different lengths (left padding), several completions sharing a prompt's prefill,
    and stop tokens chosen from a first run so that completions end at different steps (or all
    before max_tokens: the outputs are cut where the last one ended, as the dynamic decoder stops).
    The dynamic decoder drops a completion from its batch when it ends; the static one computes it
    on, masked: the same samples either way."""
    model, tokenizer, _, generate, first = ragged(tiny, dtype, params)
    stops = {"one-ends-early": first.completion_ids[:1, 4], "all-end-early": first.completion_ids[:, 3],
             "one-ends-at-each-step": first.completion_ids.diagonal()}[ending]  # completion i by token i
    a, b = both(model, tokenizer, stops.unique().tolist(), generate)
    assert_same_samples(a, b, dtype)
    if ending == "one-ends-at-each-step" and params != "greedy":  # (greedy, tiny-random repeats one token)
        assert len(set(a.completion_mask.sum(-1).tolist())) > 2
    assert a.completion_mask[0].sum() <= 5
    if ending == "all-end-early":
        assert a.completion_ids.shape[1] <= 4


def test_ended_completions_leave_the_batch(tiny):
    """The dynamic decoder computes each completion for its own length (waste 1: positions run
    through the model = tokens kept); the static one drops the ended rows once half have ended, at
    its checks every CHECK_EVERY tokens. Both sample what they sample whole (the test above)."""
    model, tokenizer = tiny
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 2?", "Hi")]
    params = SamplingParams(24, 1.0)
    first = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.pad_token_id]).generate(
        prompts, 3, params, list(range(6)))
    stops = first.completion_ids[:3, 1].unique().tolist()  # completions 0-2 end by their second token
    for decoder in ("dynamic", "static"):
        engine = TransformersEngine(model, tokenizer.pad_token_id, stops, decoder=decoder)
        batch = engine.generate(prompts, 3, params, list(range(6)))
        lengths = sorted(batch.completion_mask.sum(-1).tolist())
        assert lengths[2] <= 2 and lengths[-1] == 24 and engine.decoded_tokens == sum(lengths)
        if decoder == "dynamic":
            assert engine.decoded_positions == engine.decoded_tokens
        else:  # the rule, step by step: rows dropped at a check (every 8 tokens) once half have ended
            rows, positions = lengths, len(lengths)  # the prefill's last position, once per completion
            for t in range(23):  # the 24th token is sampled, never fed
                positions += len(rows)
                if (t + 1) % 8 == 0 and 2 * sum(n <= t + 1 for n in rows) >= len(rows):
                    rows = [n for n in rows if n > t + 1]
            assert engine.decoded_positions == positions < 6 * 24


def test_an_agent_s_conversations_are_the_same_with_either_decoder(tiny):
    """Multi-turn: each request's context is the one before, its reply and a new message, sampled
    from its turn seed; the recorded conversations are the same, decoded either way."""
    pytest.importorskip("openai")
    from grpokit.engines.prompts import PromptEncoder
    from grpokit.rollouts.agents import Agents

    model, tokenizer = tiny
    model = copy.deepcopy(model).double()

    async def agent(client, name, row):
        messages = list(row["prompt"])
        for _ in range(2):
            reply = await client.chat.completions.create(model=name, messages=messages, max_tokens=6)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More?"}]
        return 0.0

    def generate(engine):
        agents = Agents(agent, "agent", tokenizer, [tokenizer.eos_token_id], timeout=60, encoder=PromptEncoder(tokenizer))
        try:
            return agents.generate(engine, [Example([{"role": "user", "content": "Say something."}], {})], [3],
                                   SamplingParams(24, 1.0), seeds=[4, 5, 6])
        finally:
            agents.close()

    a, b = both(model, tokenizer, [tokenizer.eos_token_id], generate)
    assert a.conversations[0].turns == 2
    assert_same_samples(a, b, torch.float64)
    assert torch.equal(a.trained_mask, b.trained_mask)


def test_auto_decodes_dynamically_on_the_cpu_and_a_bad_name_is_refused(tiny):
    model, tokenizer = tiny
    assert TransformersEngine(model, tokenizer.pad_token_id, [0])._decoder(torch.device("cpu")) == "dynamic"
    assert TransformersEngine(model, tokenizer.pad_token_id, [0])._decoder(torch.device("cuda")) == "static"
    with pytest.raises(ConfigError, match="rollout.decoder='fast': must be one of auto, dynamic, static"):
        load_config(None, ["rollout.decoder=fast"])
    assert StaticDecoder.__doc__  # the path the docs describe exists


def test_a_model_the_static_decoder_cannot_run_decodes_dynamically_or_is_refused():
    """A sliding window (Mistral's, Gemma 3's sliding layers) keeps a cache of the window's size,
    which the static decoder's whole-cache mask does not fit: auto decodes such a model dynamically
    on CUDA too, and rollout.decoder=static is refused at start-up, naming why."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM, MistralConfig, MistralForCausalLM

    from grpokit.config.checks import Facts, check, model_facts
    from grpokit.engines.static_decoder import static_decoding_problem

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    mistral = MistralForCausalLM(MistralConfig(**small, sliding_window=4))
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(**small))
    assert "sliding window of 4 tokens" in static_decoding_problem(mistral.config)
    assert "other kinds than full attention" in static_decoding_problem(gemma.config)
    for model in (mistral, gemma):
        assert TransformersEngine(model, 0, [1])._decoder(torch.device("cuda")) == "dynamic"
        with pytest.raises(ValueError, match="rollout.decoder=static: .*use rollout.decoder=dynamic"):
            TransformersEngine(model, 0, [1], decoder="static")
        # A run that asks for it is refused at start-up, with every other problem (config/checks.py).
        facts = Facts(model=model_facts("a model", model, tokenizer=object()))
        with pytest.raises(ConfigError, match="rollout.decoder=static: .*use rollout.decoder=dynamic"):
            check(load_config(None, ["rollout.decoder=static"], check=False), facts)


@pytest.mark.parametrize("dtype, params, slots", [(torch.float64, "sampled", 1), (torch.float64, "sampled", 2),
                                                  (torch.float64, "greedy", 2), (torch.float64, "filtered", 2),
                                                  (torch.float32, "sampled", 2)],
                         ids=["float64-sampled-1", "float64-sampled-2", "float64-greedy-2", "float64-filtered-2",
                              "float32-sampled-2"])
@pytest.mark.parametrize("ending", ["one-ends-at-each-step", "all-end-at-once", "none-end"])
def test_completions_waiting_for_a_slot_sample_what_they_would_all_at_once(tiny, dtype, params, ending, slots,
                                                                           monkeypatch):
    """rollout.decode_slots: with fewer slots than completions (6), the waiting ones join as others
    end (continuous batching), and every completion samples what it samples when all are decoded
    at once: the same tokens, masks and finish reasons, sampling log-probs and entropies to float32's
    rounding (assert_same_samples). The batch never holds more than `slots` rows, and its key/value
    cache never more columns than the longest prompt plus max_tokens (the columns every row masks
    are cut off)."""
    model, tokenizer, prompts, generate, first = ragged(tiny, dtype, params)
    stops = {"one-ends-at-each-step": first.completion_ids.diagonal(), "all-end-at-once": first.completion_ids[:, 3],
             "none-end": torch.tensor([tokenizer.pad_token_id])}[ending]
    stops = stops.unique().tolist()
    whole = generate(TransformersEngine(model, tokenizer.pad_token_id, stops))
    engine = TransformersEngine(model, tokenizer.pad_token_id, stops, slots=slots)
    shapes, forward = [], engine._next_logits
    monkeypatch.setattr(engine, "_next_logits", lambda tok, attn, *a: shapes.append(attn.shape) or forward(tok, attn, *a))
    slotted = generate(engine)
    assert_same_samples(whole, slotted, dtype)
    lengths = whole.completion_mask.sum(-1)
    assert shapes or lengths.max() == 1  # (greedy, tiny-random repeats its first token: all may end there)
    assert max(rows for rows, _ in shapes or [(slots, 0)]) == slots
    assert max(width for _, width in shapes or [(0, 0)]) <= max(map(len, prompts)) + 16
    assert engine.decoded_positions == 6 + int((lengths - 1).sum())  # no step computes an ended completion
    if ending == "all-end-at-once":
        assert lengths.max() <= 4
    if ending == "none-end":
        assert (lengths == 16).all() and whole.finish_reasons == slotted.finish_reasons == ["length"] * 6


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_completions_waiting_for_a_slot_in_a_sliding_window_model(kind):
    """Layers that keep a sliding window's cache (Mistral's every layer, Gemma 3's local ones):
    a joining completion's prompt rows are padded to the window's cache, and sample the same."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    model = (MistralForCausalLM(MistralConfig(**small, sliding_window=4)) if kind == "mistral" else
             Gemma3ForCausalLM(Gemma3TextConfig(**small, sliding_window=4, layer_types=["sliding_attention",
                                                                                         "full_attention"])))
    model = model.double().eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    params = SamplingParams(12, 1.0)
    whole = TransformersEngine(model, 0, [3]).generate(prompts, 3, params, list(range(9)))
    assert len(set(whole.completion_mask.sum(-1).tolist())) > 1  # completions of different lengths
    slotted = TransformersEngine(model, 0, [3], slots=2).generate(prompts, 3, params, list(range(9)))
    assert_same_samples(whole, slotted, torch.float64)


def test_with_sharded_weights_a_process_whose_completions_ended_keeps_a_row_for_the_forward_calls(tiny,
                                                                                                  monkeypatch):
    """Sharded weights (lockstep): every process makes each forward call while any process still
    decodes. Here another process is made to decode 5 steps longer: this one, its own completions
    all ended, keeps one (already ended) row going, records nothing for it, and its completions
    are what they are alone; the width of its batch is the longest of any process's."""
    from grpokit.runtime import distributed

    model, tokenizer = tiny
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 2?", "Hi")]
    params = SamplingParams(16, 1.0)
    first = TransformersEngine(model, tokenizer.pad_token_id, [tokenizer.pad_token_id]).generate(
        prompts, 2, params, list(range(4)))
    stops = first.completion_ids[:, 2].unique().tolist()  # all end by their third token
    alone = TransformersEngine(model, tokenizer.pad_token_id, stops).generate(prompts, 2, params, list(range(4)))
    longest = int(alone.completion_mask.sum(-1).max())
    assert longest <= 3
    extra = iter([1] * (longest + 4) + [0])  # the other process: a completion of longest + 5 tokens

    def all_reduce(t, op="sum"):
        return t + next(extra) if op == "sum" else torch.maximum(t, torch.tensor(longest + 5))

    monkeypatch.setattr(distributed, "all_reduce", all_reduce)
    engine = TransformersEngine(model, tokenizer.pad_token_id, stops, lockstep=True, slots=3)
    rows, forward = [], engine._next_logits
    monkeypatch.setattr(engine, "_next_logits", lambda tok, attn, *a: rows.append(len(tok)) or forward(tok, attn, *a))
    batch = engine.generate(prompts, 2, params, list(range(4)))
    assert batch.completion_ids.shape[1] == longest + 5
    w = alone.completion_ids.shape[1]
    assert torch.equal(batch.completion_ids[:, :w], alone.completion_ids) and not batch.completion_mask[:, w:].any()
    assert batch.finish_reasons == alone.finish_reasons
    assert len(rows) == longest + 4 and rows[-5:] == [1] * 5  # one row kept for the other's last steps


def test_decode_slots_that_cannot_be_taken_are_refused(tiny):
    from grpokit.config.checks import Facts, check

    model, tokenizer = tiny
    with pytest.raises(ValueError, match="rollout.decode_slots: the static decoder's cache is sized once"):
        TransformersEngine(model, tokenizer.pad_token_id, [0], decoder="static", slots=2)
    assert TransformersEngine(model, tokenizer.pad_token_id, [0], slots=2)._decoder(torch.device("cuda")) == "dynamic"
    for settings, message in ((["rollout.decode_slots=0"], "rollout.decode_slots=0: must be >= 1"),
                              (["rollout.decode_slots=2", "rollout.decoder=static"],
                               "rollout.decode_slots=2 with rollout.decoder=static: the static decoder sizes"),
                              (["rollout.decode_slots=2", "rollout.engine=server",
                                "rollout.server_url=http://127.0.0.1:1"], "rollout.decode_slots")):
        with pytest.raises(ConfigError, match=message):
            check(load_config(None, settings, check=False), Facts())


@pytest.mark.parametrize("params", ["sampled", "greedy", "filtered"])
def test_the_alternatives_an_agent_asks_for_are_the_sampling_distribution_s_most_likely_tokens(tiny, params):
    """SamplingParams.top_logprobs = 3 (an agent's request's top_logprobs): the same samples as
    without, and beside each sampled token the 3 most likely under the distribution it was drawn
    from, from both decoders: against a naive float64 forward of each whole sequence, token by
    token (unfiltered); with filters, the sampled token's own log-prob where it ranks in the 3."""
    from dataclasses import replace

    model, tokenizer, prompts, generate, first = ragged(tiny, torch.float64, params)
    asked = replace(PARAMS[params], top_logprobs=3)
    for batch in both(model, tokenizer, [tokenizer.pad_token_id],
                      lambda engine: engine.generate(prompts, [3, 1, 2], asked, list(range(6)))):
        assert_same_samples(first, batch, torch.float64)
        assert batch.top_logps.shape == (*batch.completion_ids.shape, 3) == batch.top_ids.shape
        for i, p in enumerate(batch.prompt_index.tolist()):
            n = int(batch.completion_mask[i].sum())
            ids = torch.tensor([prompts[p] + batch.completion_ids[i, :n].tolist()])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompts[p]) - 1:-1].double()  # (n, V)
            temperature = PARAMS[params].temperature or 1.0
            reference = torch.topk(torch.log_softmax(logits / temperature, -1), 3, -1)
            top, top_ids = batch.top_logps[i, :n].double(), batch.top_ids[i, :n]
            assert (top[:, :-1] >= top[:, 1:]).all()  # most likely first
            if params != "filtered":  # (sampling computes in float32: sample_next)
                torch.testing.assert_close(top, reference.values, atol=1e-5, rtol=0)
                assert torch.equal(top_ids, reference.indices)
                continue
            assert torch.equal(top_ids[:, 0], reference.indices[:, 0])  # no filter drops the most likely
            sampled = batch.completion_ids[i, :n, None] == top_ids  # (n, 3)
            torch.testing.assert_close(top[sampled], batch.sampling_logps[i, :n][sampled.any(-1)].double(), atol=0, rtol=0)
            assert (top.exp().sum(-1) <= 1 + 1e-6).all()
