"""The prompt-shared log-prob pass equals running every sequence whole: values and gradients."""

import copy
import math

import pytest
import torch

from grpokit.models.logprobs import completion_logprobs


def naive_logprobs(model, prompt, completion, temperature):
    """One unpadded sequence at a time, full logits, float64."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].double() / temperature  # (L, V)
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(completion)])


def test_shared_prompt_logprobs_equal_whole_sequences(tiny):
    model = copy.deepcopy(tiny[0]).double()
    prompts = [[5, 6, 7, 8], [9, 10]]
    completions = [[11, 12, 13], [14, 15, 2], [16, 2, 0], [17, 18, 19], [20, 2, 0]]  # 0 pads after EOS (2)
    lengths = [3, 3, 2, 3, 2]
    prompt_index = torch.tensor([0, 0, 0, 1, 1])
    prompt_ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])

    shared = copy.deepcopy(model)
    got = completion_logprobs(shared, prompt_ids, prompt_mask, torch.tensor(completions), prompt_index, 0.7)
    mask = torch.tensor([[1] * n + [0] * (3 - n) for n in lengths])
    (got * mask).sum().backward()

    total = 0
    for i, (c, n) in enumerate(zip(completions, lengths)):
        ref = naive_logprobs(model, prompts[prompt_index[i]], c[:n], 0.7)
        torch.testing.assert_close(got[i, :n], ref, rtol=1e-10, atol=1e-10)
        total = total + ref.sum()
    total.backward()
    # transformers' LlamaRMSNorm computes in float32 even in a float64 model, so summation order
    # shows at ~1e-8 relative; a wrong gradient (a prompt counted once instead of per completion)
    # is off by O(1).
    for (name, a), b in zip(shared.named_parameters(), model.parameters()):
        assert (a.grad - b.grad).norm() <= 1e-6 * b.grad.norm(), name


def test_one_prompt_per_row_without_index(tiny):
    model = copy.deepcopy(tiny[0]).double()
    got = completion_logprobs(model, torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.long), torch.tensor([[3], [4]]))
    assert got.shape == (2, 1)
    torch.testing.assert_close(got[1], naive_logprobs(model, [7, 8], [4], 1.0), rtol=1e-10, atol=1e-10)


def test_gradients_are_repeatable_bit_for_bit_on_several_threads():
    """Completions sharing a prompt sum their gradients into its cache; on 2 CPU threads that sum
    must come out the same every time, or two runs of one config (and a resumed run) drift apart.
    (Indexing the cache with Tensor[index] failed this: ~1 in 2 repeats differed.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=4)
        model = LlamaForCausalLM(config)
        prompt_ids = torch.randint(0, 64, (1, 60))
        completions = torch.randint(0, 64, (8, 4))

        def gradients():
            model.zero_grad(set_to_none=True)
            logps = completion_logprobs(model, prompt_ids, torch.ones_like(prompt_ids), completions,
                                        torch.zeros(8, dtype=torch.long))
            (logps * torch.linspace(-1, 1, 8)[:, None]).sum().backward()
            return [p.grad.clone() for p in model.parameters()]

        first = gradients()
        for _ in range(10):
            assert all(torch.equal(a, b) for a, b in zip(first, gradients()))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def float64(monkeypatch):
    """Float64 all through (exact.py): any difference between two paths is then a bug, not rounding."""
    from support.exact import rmsnorm_in_input_dtype
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)


def _batch():
    prompt_ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    completions = torch.tensor([[11, 12, 13, 2], [14, 15, 2, 0], [16, 2, 0, 0], [17, 18, 19, 20], [21, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return prompt_ids, prompt_mask, completions, torch.tensor([0, 0, 0, 1, 1]), mask


@pytest.mark.parametrize("variant", [dict(chunk_size=1), dict(chunk_size=3), dict(chunk_size=7), dict(chunk_size=1000),
                                     dict(share_prompt=False), dict(share_prompt=False, chunk_size=4),
                                     dict(whole_model=True), dict(whole_model=True, chunk_size=3)],
                         ids=["chunk1", "chunk3", "chunk7", "chunk-all", "whole", "whole-chunk4", "whole-model",
                              "whole-model-chunk3"])
def test_chunked_and_whole_sequence_logprobs_equal_the_shared_pass(tiny, float64, variant):
    """float64: the default path's values and gradients, for chunks of 1 position, sizes that do
    not divide the 20 positions, and more; with every completion run whole; and split as a sharded
    model's pass splits them (whole_model: the whole prompt first, each pass a call of the whole model)."""
    prompt_ids, prompt_mask, completions, index, mask = _batch()
    weights = torch.linspace(-1, 1, completions.numel()).view(completions.shape).double() * mask

    def run(**kw):
        model = copy.deepcopy(tiny[0]).double()
        logps = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, 0.7, **kw)
        (logps * weights).sum().backward()
        return logps.detach() * mask, {n: p.grad for n, p in model.named_parameters()}

    ref, ref_grads = run()
    got, grads = run(**variant)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    for name, g in grads.items():
        assert (g - ref_grads[name]).norm() <= 1e-9 * ref_grads[name].norm() + 1e-15, name


def test_activation_checkpointing_gives_the_same_gradients(tiny, float64):
    """model.gradient_checkpointing: the trainer's policy pass runs whole sequences (the checkpointed
    layers drop the cache in training mode); its gradients are the plain ones."""
    prompt_ids, prompt_mask, completions, index, mask = _batch()

    def grads(checkpointed: bool):
        model = copy.deepcopy(tiny[0]).double().train()
        if checkpointed:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        logps = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, 1.0, chunk_size=5,
                                    share_prompt=not checkpointed)
        (logps * mask).sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, checkpointed = grads(False), grads(True)
    for name, g in checkpointed.items():
        assert (g - plain[name]).norm() <= 1e-9 * plain[name].norm() + 1e-15, name


def test_chunking_refuses_heads_that_do_more_than_the_output_layer(tiny):
    from grpokit.models.logprobs import check_chunkable

    model = copy.deepcopy(tiny[0])
    check_chunkable(model)
    forward = model.forward

    def soft_capped(*args, **kwargs):  # as Gemma 2's head does after its output layer
        out = forward(*args, **kwargs)
        out.logits = 0.5 * torch.tanh(out.logits / 0.5)
        return out

    model.forward = soft_capped
    with pytest.raises(ValueError, match="this model's head does more"):
        check_chunkable(model)


def test_the_chunk_size_left_null_is_the_device_s(tiny):
    """train.logprob_chunk_size=null: chunks of GPU_CHUNK on a GPU for a text model whose head is
    the output layer alone; all at once on the CPU, for such a head, and for a vision-language
    model; 0 is all at once, a number that number."""
    from grpokit.models.logprobs import GPU_CHUNK, chunk_size

    model = copy.deepcopy(tiny[0])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # the check runs where the model is
    assert chunk_size(None, model, cpu) is None and chunk_size(None, model, cuda) == GPU_CHUNK
    assert chunk_size(0, model, cuda) is None and chunk_size(5, model, cpu) == 5
    assert chunk_size(None, model, cuda, vision=object()) is None
    forward = model.forward

    def soft_capped(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = 0.5 * torch.tanh(out.logits / 0.5)
        return out

    model.forward = soft_capped
    assert chunk_size(None, model, cuda) is None


@pytest.mark.parametrize("prompts", [[[5], [9]], [[9], [5, 6, 7, 8]]], ids=["all-one-token", "one-token-and-longer"])
@pytest.mark.parametrize("variant", [{}, dict(whole_model=True)], ids=["default", "whole-model"])
def test_one_token_prompts(tiny, float64, prompts, variant):
    """The shared pass runs a prompt's last token with the completions: with one-token prompts
    there is nothing before it (no prefix pass), or a prefix row of padding only."""
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    completions = torch.tensor([[11, 12, 2], [13, 2, 0], [14, 15, 16]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    index = torch.tensor([0, 0, 1])

    def run(**kw):
        model = copy.deepcopy(tiny[0]).double()
        logps = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, 1.0, **kw)
        (logps * mask).sum().backward()
        return logps.detach() * mask, {n: p.grad for n, p in model.named_parameters()}

    ref, ref_grads = run(share_prompt=False)
    got, grads = run(**variant)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    for name, g in grads.items():
        assert (g - ref_grads[name]).norm() <= 1e-9 * ref_grads[name].norm() + 1e-15, name


def test_embedding_and_output_layer_run_once(tiny):
    """The shared pass looks every token up in one call and applies the output layer once: the
    tied vocabulary x hidden table gets one gradient from each, not two (with a 49k vocabulary, a
    dense gradient of that table is one of the update's largest tensors)."""
    model = copy.deepcopy(tiny[0])
    calls = {"embedding": 0, "output": 0}
    model.get_input_embeddings().register_forward_hook(lambda *_: calls.__setitem__("embedding", calls["embedding"] + 1))
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.__setitem__("output", calls["output"] + 1))
    prompt_ids, prompt_mask, completions, index, mask = _batch()
    completion_logprobs(model, prompt_ids, prompt_mask, completions, index).sum().backward()
    assert calls == {"embedding": 1, "output": 1}


def test_token_logprobs_backward_is_autograds():
    """token_logprobs has its own backward (one vocabulary-sized tensor instead of five): float64
    gradcheck, and in float32 the values and gradients of autograd's logsumexp and gather, bit for bit."""
    from grpokit.models.logprobs import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 4, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 4))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.7), (logits,))

    logits = (torch.randn(4, 5, 3000) * 4).requires_grad_()
    targets, weights = torch.randint(0, 3000, (4, 5)), torch.randn(4, 5)
    got = token_logprobs(logits, targets, 1.0)
    got.backward(weights)
    ours, logits.grad = logits.grad, None
    ref = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    ref.backward(weights)
    assert torch.equal(got, ref) and torch.equal(ours, logits.grad)


def test_models_that_use_token_ids_beyond_the_lookup_get_whole_model_passes(tiny):
    """The shared pass gives the model embeddings it looked up itself; a model whose ids do more
    (Gemma 3n's per-layer inputs) is found at start-up, and the trainer calls it with ids."""
    from grpokit.models.logprobs import check_inputs_embeds

    model = copy.deepcopy(tiny[0])
    assert check_inputs_embeds(model)
    forward = model.forward

    def ids_matter(input_ids=None, inputs_embeds=None, **kwargs):
        out = forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if input_ids is not None:
            out.logits = out.logits + 1.0
        return out

    model.forward = ids_matter
    assert not check_inputs_embeds(model)


@pytest.mark.parametrize("variant", [{}, dict(chunk_size=3), dict(whole_model=True), "packed-chunk2"])
def test_the_entropies_beside_the_logprobs_are_each_distribution_s_from_the_same_logits(tiny, float64, variant):
    """algorithm.entropy_coef's entropies: -sum_v p log p of softmax(logits / temperature) at each
    completion position, against one unpadded float64 sequence at a time, token by token; every
    pass (shared prompt, chunked, a whole-model call, packed and chunked) gives the same values
    and the same gradients for a loss of log-probs and entropies both; the log-probs are those of
    the pass without entropies."""
    from grpokit.models.logprobs import packed_logprobs
    from grpokit.models.packing import pack

    prompt_ids, prompt_mask, completions, index, mask = _batch()
    weights = torch.linspace(-1, 1, completions.numel()).view(completions.shape).double() * mask

    def run(kw):
        model = copy.deepcopy(tiny[0]).double()
        if isinstance(kw, str):
            packed = pack(prompt_ids, prompt_mask, completions, mask, index)
            logps, entropies = packed_logprobs(model, packed, completions.shape, 0.7, 2 if "chunk" in kw else None,
                                               False, entropies=True)
        else:
            logps, entropies = completion_logprobs(model, prompt_ids, prompt_mask, completions, index, 0.7,
                                                   entropies=True, **kw)
        (logps * weights + entropies * weights.flip(-1) * mask).sum().backward()
        return model, logps.detach() * mask, entropies.detach() * mask, {n: p.grad for n, p in model.named_parameters()}

    model, logps, entropies, grads = run(variant)
    for i, p in enumerate(index.tolist()):
        prompt = prompt_ids[p][prompt_mask[p].bool()].tolist()
        completion = completions[i][mask[i].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double() / 0.7  # (L, V)
        for t in range(len(completion)):
            probs = [math.exp(x) for x in torch.log_softmax(logits[len(prompt) - 1 + t], -1).tolist()]
            naive = -sum(q * math.log(q) for q in probs if q > 0)
            assert abs(entropies[i, t].item() - naive) < 1e-10, (i, t)
    plain = completion_logprobs(copy.deepcopy(tiny[0]).double(), prompt_ids, prompt_mask, completions, index, 0.7)
    torch.testing.assert_close(logps, plain.detach() * mask, rtol=0, atol=1e-12)
    if variant:
        _, _, _, reference = run({})
        for name, g in grads.items():
            assert (g - reference[name]).norm() <= 1e-9 * reference[name].norm() + 1e-15, name
