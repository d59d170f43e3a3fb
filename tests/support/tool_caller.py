"""A tiny model that calls the calculator, for multi-turn runs that need real tool calls at
tiny-random's cost (a random model never writes one; the bundled 135M model does, slowly).

tiny-random's shape, with an output layer of its own whose rows are zero except for the tokens
of the call: every other token's logit is exactly 0, so the loss over the whole vocabulary is
the loss over those rows plus a constant count of zero logits, and training never computes the
others. Its embeddings stay as drawn. It is trained to answer any question with

    <tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>

or with "6 * 70" instead, at even odds (in the template's layout): so completions differ, and
after the tool's reply it calls again, until the token budget.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from grpokit.models.bundled import tiny_config
from grpokit.models.loading import load_tokenizer, save_model
from grpokit.models.templates import TOOLS_TEMPLATE
from grpokit.multiturn.tools import schema
from grpokit.tasks.calculator import calculator, question

EXPRESSIONS = ("6 * 7", "6 * 70")


def _call(expression: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}


def tool_caller(folder: Path, questions=((347, 58), (512, 33)), steps: int = 150) -> Path:
    """Train the model on `questions` and save it (weights, tokenizer, the tools template) in `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer("tiny-random")
    tokenizer.chat_template = TOOLS_TEMPLATE.read_text()
    tools = [schema(calculator, "tool")]
    rows = []  # (prompt ids, call ids)
    for a, b in questions:
        asked = [{"role": "user", "content": question(a, b)}]
        prompt = tokenizer.apply_chat_template(asked, tools=tools, tokenize=False, add_generation_prompt=True)
        for expression in EXPRESSIONS:
            whole = tokenizer.apply_chat_template([*asked, _call(expression)], tools=tools, tokenize=False)
            assert whole.startswith(prompt)
            rows.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"]))
    vocab = sorted({t for _, call in rows for t in call})  # the tokens the model writes
    index = {t: i for i, t in enumerate(vocab)}
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # (R, T)
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # (R, T)
    where, targets = [], []  # the positions that predict a call's token, and that token's row in `vocab`
    for r, (prompt, call) in enumerate(rows):
        ids[r, : len(prompt) + len(call)] = torch.tensor(prompt + call)
        mask[r, : len(prompt) + len(call)] = 1
        where += [(r, len(prompt) - 1 + j) for j in range(len(call))]
        targets += [index[t] for t in call]
    where, targets = torch.tensor(where), torch.tensor(targets)  # (N, 2), (N,)

    config = LlamaConfig(**{**tiny_config().to_dict(), "tie_word_embeddings": False, "vocab_size": len(tokenizer),
                            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                            "pad_token_id": tokenizer.pad_token_id})
    with torch.random.fork_rng():  # the same model every time, whatever the caller's seed
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        heads = torch.nn.Parameter(torch.randn(len(vocab), config.hidden_size) * 0.02)  # (V', H)
        model.model.embed_tokens.requires_grad_(False)  # random inputs do; it holds most of the weights
        optimizer = torch.optim.Adam([*(p for p in model.model.parameters() if p.requires_grad), heads], lr=1e-2)
        others = math.log(config.vocab_size - len(vocab))  # logsumexp of the zero logits of every other token
        for _ in range(steps):
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[where[:, 0], where[:, 1]]  # (N, H)
            logits = hidden @ heads.T  # (N, V')
            every = torch.cat([logits, torch.full_like(logits[:, :1], others)], dim=-1)  # (N, V' + 1)
            loss = (every.logsumexp(-1) - logits.gather(-1, targets[:, None])[:, 0]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[vocab] = heads
        # Each call token but the one that picks the expression, in every row, taken with
        # probability near 1 (every other token included): the model writes the call.
        chosen = model(input_ids=ids, attention_mask=mask).logits[where[:, 0], where[:, 1]].log_softmax(-1)
        p = chosen.gather(-1, torch.tensor(vocab)[targets][:, None])[:, 0].exp()
    assert (p > 0.99).sum() >= len(p) - len(rows) and (p > 0.4).all(), p
    save_model(model, tokenizer, folder)
    return folder
