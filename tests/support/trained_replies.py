"""Tiny models trained to give chosen replies, for runs that need a model that does something at
tiny-random's cost (a random model never writes a tool call or a right answer; the bundled 135M
model does, slowly).

tiny-random's shape, with an output layer of its own whose rows are zero except for the tokens
of the replies: every other token's logit is exactly 0, so the loss over the whole vocabulary is
the loss over those rows plus a constant count of zero logits, and training never computes the
others. Its embeddings stay as drawn. Each prompt is answered by one of its replies at even odds,
so completions differ and rewards vary within a group.

- `tool_caller`: answers any question with
      <tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>
  or with "6 * 70" instead (in the template's layout); after the tool's reply it calls again,
  until the token budget.
- `answerer`: answers each arithmetic question with the right number or with that number plus 10.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from grpokit.models.bundled import tiny_config
from grpokit.models.loading import load_tokenizer, save_model
from grpokit.models.templates import TOOLS_TEMPLATE
from grpokit.rollouts.tools import schema
from grpokit.tasks.calculator import calculator, question

EXPRESSIONS = ("6 * 7", "6 * 70")


def _call(expression: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}


def tool_caller(folder: Path, questions=((347, 58), (512, 33)), steps: int = 150, family: str | None = None,
                answers: bool = False) -> Path:
    """Train the model on `questions` and save it (weights, tokenizer, the tools template) in `folder`.
    family: a family of support/architectures.py to build the model as, two layers of it (default
    tiny-random's Llama); answers: it also answers at once, with a bare "1", as often as it calls (its completions
    then end at once or run to the token budget: ragged)."""
    tokenizer = load_tokenizer("tiny-random")
    tokenizer.chat_template = TOOLS_TEMPLATE.read_text()
    asked = [[{"role": "user", "content": question(a, b)}] for a, b in questions]
    replies = [_call(e) for e in EXPRESSIONS] + ([{"role": "assistant", "content": "1"}] if answers else [])
    return _trained(folder, tokenizer, [(q, replies) for q in asked], [schema(calculator, "tool")], steps, family,
                    choices=2 if answers else 1)


def answerer(folder: Path, examples, steps: int = 100) -> Path:
    """Train the model on arithmetic `examples` (grpokit.tasks Examples with an "answer" column)
    and save it in `folder`, tiny-random's chat template kept."""
    replies = [(e.prompt, [{"role": "assistant", "content": str(e.columns["answer"] + shift)} for shift in (0, 10)])
               for e in examples]
    return _trained(folder, load_tokenizer("tiny-random"), replies, None, steps)


def _trained(folder: Path, tokenizer, conversations: list[tuple[list[dict], list[dict]]], tools, steps: int,
             family: str | None = None, choices: int = 1) -> Path:
    """conversations: (the messages asked, the assistant messages to answer them with at even odds);
    choices: the tokens of a reply at most where its prompt's replies part ways."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []  # (prompt ids, reply ids)
    for asked, replies in conversations:
        prompt = tokenizer.apply_chat_template(asked, tools=tools, tokenize=False, add_generation_prompt=True)
        for reply in replies:
            whole = tokenizer.apply_chat_template([*asked, reply], tools=tools, tokenize=False)
            assert whole.startswith(prompt)
            rows.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"]))
    vocab = sorted({t for _, reply in rows for t in reply})  # the tokens the model writes
    index = {t: i for i, t in enumerate(vocab)}
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # (R, T)
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # (R, T)
    where, targets = [], []  # the positions that predict a reply's token, and that token's row in `vocab`
    for r, (prompt, reply) in enumerate(rows):
        ids[r, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        mask[r, : len(prompt) + len(reply)] = 1
        where += [(r, len(prompt) - 1 + j) for j in range(len(reply))]
        targets += [index[t] for t in reply]
    where, targets = torch.tensor(where), torch.tensor(targets)  # (N, 2), (N,)

    ids_of = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(**{**tiny_config().to_dict(), "tie_word_embeddings": False, "vocab_size": len(tokenizer),
                            **ids_of})
    with torch.random.fork_rng():  # the same model every time, whatever the caller's seed
        torch.manual_seed(0)
        if family is None:
            model = LlamaForCausalLM(config)
        else:
            from support.architectures import build

            model = build(family, len(tokenizer), torch.float32, layers=2, **ids_of).train()
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        decoder, hidden_size = model.get_decoder(), model.config.get_text_config().hidden_size
        heads = torch.nn.Parameter(torch.randn(len(vocab), hidden_size) * 0.02)  # (V', H)
        model.get_input_embeddings().requires_grad_(False)  # random inputs do; it holds most of the weights
        optimizer = torch.optim.Adam([*(p for p in decoder.parameters() if p.requires_grad), heads],
                                     lr=1e-2 if family is None else 3e-2)
        others = math.log(len(tokenizer) - len(vocab))  # logsumexp of the zero logits of every other token
        for _ in range(steps):
            hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state[where[:, 0], where[:, 1]]  # (N, H)
            logits = hidden @ heads.T  # (N, V')
            every = torch.cat([logits, torch.full_like(logits[:, :1], others)], dim=-1)  # (N, V' + 1)
            loss = (every.logsumexp(-1) - logits.gather(-1, targets[:, None])[:, 0]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
        model.get_output_embeddings().weight[vocab] = heads
        # Each reply token but the first that tells a prompt's replies apart, taken with
        # probability near 1 (every other token included): the model writes its replies.
        chosen = model(input_ids=ids, attention_mask=mask).logits[where[:, 0], where[:, 1]].log_softmax(-1)
        p = chosen.gather(-1, torch.tensor(vocab)[targets][:, None])[:, 0].exp()
    assert (p > 0.99).sum() >= len(p) - choices * len(rows) and (p > (0.4 if choices == 1 else 0.25)).all(), p
    save_model(model, tokenizer, folder)
    return folder
