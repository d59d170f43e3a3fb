"""Thinking models: the reasoning apart from the answer (models/reasoning.py), model.chat_template_kwargs,
and a conversation whose history the chat template renders otherwise (Qwen3's real rule with
thinking off, a template that drops earlier reasoning): the next turn sampled in the context the
template renders, a sequence of its own after the prompt tokens it shares, every turn's log-probs
exact against that sequence alone. Templates written in the test (support/family_templates.py);
the rollouts on tiny-random, replied by the scripted engine."""

import json

import pytest
import torch
from support import scripted_engine
from support.family_templates import QWEN3, STRIPPING
from support.passes import mask_of, plain_logprobs
from support.runs import training_rows

from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.engines.batch import RolloutBatch, SamplingParams, decode_completions
from grpokit.engines.prompts import PromptEncoder
from grpokit.engines.protocols import ENGINES
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.models.logprobs import LogProbs
from grpokit.models.reasoning import Reasoning
from grpokit.models.templates import with_arguments
from grpokit.rewards.exact_answer import exact_answer, leading_number
from grpokit.rewards.math_answer import format_reward, think_format
from grpokit.rollouts.conversation import MultiTurn
from grpokit.rollouts.tool_formats import Replies
from grpokit.rollouts.tools import Tools
from grpokit.tasks.calculator import question
from grpokit.tasks.task import Example

THINKING_CALL = ('<think>\nI multiply with the calculator.\n</think>\n\n<tool_call>\n{"name": "calculator", '
                 '"arguments": {"expression": "347 * 58"}}\n</tool_call>')
THINKING_ANSWER = "<think>\nThe calculator said 20126.\n</think>\n\n20126"
PLAIN_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 58"}}\n</tool_call>'


# ---------------------------------------------------------------- the reasoning apart from the answer


def test_the_reasoning_is_told_apart_from_the_answer():
    think, opened = Reasoning("think"), Reasoning("think", opened=True)
    assert think.split("<think>\nadd them\n</think>\n\n8470").message() == {
        "role": "assistant", "content": "8470", "reasoning_content": "add them"}
    assert think.split("8470").message() == {"role": "assistant", "content": "8470"}  # no block: all answer
    assert think.split("<think>\nstill going").message() == {  # cut inside its reasoning
        "role": "assistant", "content": "", "reasoning_content": "still going", "reasoning_cut": True}
    # the generation prompt opened the block (Qwen3.5's, DeepSeek-R1's templates): no opening tag written
    assert opened.split("add them\n</think>\n\n8470").answer == "8470"
    assert opened.split("add them").message()["reasoning_cut"] is True
    harmony = Reasoning("harmony").split("<|channel|>analysis<|message|>add them<|end|><|start|>assistant"
                                         "<|channel|>final<|message|>8470<|return|>")
    assert (harmony.answer, harmony.reasoning, harmony.cut) == ("8470", "add them", False)
    assert Reasoning("harmony").split("<|channel|>analysis<|message|>add th").cut
    call = Reasoning("harmony").split("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>")
    assert (call.answer, call.reasoning, call.cut) == ("", None, False)  # a call alone: no answer, nothing cut


def test_auto_reads_the_template():
    tokenizer = load_tokenizer("tiny-random")
    assert Reasoning.of("auto", tokenizer).kind == "none"  # SmolLM2's ChatML writes no <think>
    tokenizer.chat_template = QWEN3
    assert Reasoning.of("auto", tokenizer) == Reasoning("think", opened=False)
    tokenizer.chat_template = QWEN3.replace("{{- '<|im_start|>assistant\\n' }}\n", "").replace(
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert Reasoning.of("auto", tokenizer).opened  # a template that opens the block for the model
    assert Reasoning.of("none", tokenizer).kind == "none"
    with pytest.raises(ValueError, match="model.reasoning_parser='r1': one of auto, think, harmony, none"):
        Reasoning.of("r1", tokenizer)


def test_the_built_in_answer_rewards_read_what_follows_the_reasoning():
    """A chat completion's content is its answer where the model reasons (decode_completions); the
    format rewards read the reply as written."""
    tokenizer = load_tokenizer("tiny-random")
    texts = ["<think>\n347 times 58\n</think>\n\n20126", "<think>\n347 times 58 is", "20126"]
    batch = _batch(tokenizer, texts)
    completions = decode_completions(tokenizer, batch, [[{"role": "user", "content": "?"}]] * 3, Reasoning("think"))
    assert exact_answer(completions, [20126] * 3, ["stop"] * 3) == [1.0, 0.0, 1.0]
    assert leading_number(completions, [20126] * 3) == [1.0, 0.0, 1.0]
    assert think_format(completions) == [1.0, 0.0, 0.0]
    assert think_format([[{"role": "assistant", "content": "3", "reasoning_content": ""}]]) == [0.0]  # an empty block
    assert format_reward(completions, pattern=r"<think>.*</think>\s*\d+") == [1.0, 0.0, 0.0]
    assert completions[1][0]["reasoning_cut"] is True
    plain = decode_completions(tokenizer, batch, [[{"role": "user", "content": "?"}]] * 3)  # no parser: as written
    assert exact_answer(plain, [20126] * 3, ["stop"] * 3) == [0.0, 0.0, 1.0]


def _batch(tokenizer, texts: list[str]) -> RolloutBatch:
    from grpokit.engines.batch import from_completions

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return from_completions([[1, 2]], [len(texts)], [{"token_ids": i, "logprobs": [0.0] * len(i), "entropies": None,
                                                      "finish_reason": "stop"} for i in ids], tokenizer.pad_token_id)


def test_chat_template_kwargs_reach_every_rendering_and_the_saved_template(tmp_path):
    tokenizer = load_tokenizer("tiny-random")
    tokenizer.chat_template = with_arguments(QWEN3, {"enable_thinking": False})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tokenizer.save_pretrained(tmp_path)  # what final/ holds: renders as it was trained
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tmp_path)
    assert saved.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True,
                                     tokenize=False) == prompt
    assert tokenizer.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True, tokenize=False,
                                         enable_thinking=True).endswith("<|im_start|>assistant\n")  # a caller still decides
    echo = with_arguments("{{ extra | tojson }}", {"extra": {"a": None, "b": [True, "é😀"]}})
    from jinja2 import Environment

    assert json.loads(Environment().from_string(echo).render()) == {"a": None, "b": [True, "é😀"]}
    from grpokit.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="'add_generation_prompt' is not an argument of the template's own"):
        with_arguments(QWEN3, {"add_generation_prompt": True})
    config = load_config(None, ["model.chat_template_kwargs={enable_thinking: false}"])
    assert config.model.chat_template_kwargs == {"enable_thinking": False}
    from grpokit import from_trl

    converted, _ = from_trl({"chat_template_kwargs": {"enable_thinking": False}})
    assert converted["model"]["chat_template_kwargs"] == {"enable_thinking": False}


# ---------------------------------------------------------------- conversations with tools


@pytest.fixture
def thinking(monkeypatch, tmp_path):
    """The scripted engine, the Qwen3-style templates as files, and a dataset of one calculator question."""
    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")
    (tmp_path / "qwen3.jinja").write_text(QWEN3)
    (tmp_path / "stripping.jinja").write_text(STRIPPING)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": question(347, 58)}],
                                                     "answer": 20126}) + "\n")
    return tmp_path


def _rollouts(tmp_path, template: str, kwargs: dict, replies: list[str], monkeypatch, *settings) -> tuple:
    """Two rollouts of the calculator question with `template` (and chat_template_kwargs, and
    config `settings`), the scripted engine replying `replies` turn by turn: the batch, the
    tokenizer, the engine (its `calls`: each turn's contexts)."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", replies)
    config = load_config(None, [f"model.chat_template={tmp_path / template}", "rollout.tools=[grpokit.tasks.calculator:calculator]",
                                f"model.chat_template_kwargs={json.dumps(kwargs)}", *settings])
    tokenizer = load_tokenizer("tiny-random")
    tools = Tools.from_config(config.rollout, config.data, config.model, tokenizer)
    encoder = PromptEncoder(tokenizer, tools.schemas, config.data.max_prompt_length)
    kind = MultiTurn(tokenizer, tools, 5, [tokenizer.eos_token_id], encoder, Replies.of(tokenizer))
    example = Example([{"role": "user", "content": question(347, 58)}], {"answer": 20126})
    engine = scripted_engine.ScriptedEngine(tokenizer, tokenizer.eos_token_id)
    return kind.generate(engine, [example], [2], SamplingParams(config.rollout.max_completion_length, 1.0), [1, 2]), \
        tokenizer, engine


def test_qwen3_s_real_history_rule_trains_with_tools_and_the_rewards_read_the_answer(thinking, monkeypatch):
    """Thinking on: every turn after the question keeps its reasoning, so the next turn's context is
    the one sampled, followed by the tool's result: one sequence per row."""
    batch, _, _ = _rollouts(thinking, "qwen3.jinja", {}, [THINKING_CALL, THINKING_ANSWER], monkeypatch,
                            "rollout.max_completion_length=400")
    c = batch.conversations[0]
    assert batch.sequence_ids is None and (c.turns, c.calls, c.failures) == (2, 1, 0)
    assert c.messages[0]["reasoning_content"] == "I multiply with the calculator."
    assert c.messages[-1] == {"role": "assistant", "content": "20126", "reasoning_content": "The calculator said 20126."}
    run = ["train", "--no-progress", "model.name=tiny-random", f"model.chat_template={thinking / 'qwen3.jinja'}",
           f"data.path={thinking / 'data.jsonl'}", "data.eval_size=0", "rollout.engine=scripted",
           "rollout.tools=[grpokit.tasks.calculator:calculator]", "reward.functions=[exact_answer, think_format]",
           "train.prompts_per_step=1", "rollout.num_generations=2", "rollout.max_completion_length=200",
           "train.max_steps=1", f"train.output_dir={thinking / 'run'}"]
    assert main(run) == 0
    row = training_rows(thinking / "run")[0]
    assert row["rewards/exact_answer/mean"] == 1.0 and row["rewards/think_format/mean"] == 1.0
    assert row["tools/calls_per_rollout"] == 1 and row["completions/reasoning_cut_ratio"] == 0.0


@pytest.mark.parametrize("template,kwargs,replies", [
    ("qwen3.jinja", {"enable_thinking": False}, [PLAIN_CALL, PLAIN_CALL, "20126"]),  # the empty think block dropped
    ("stripping.jinja", {}, [THINKING_CALL, THINKING_CALL, THINKING_ANSWER]),  # earlier reasoning dropped
], ids=["qwen3-no-thinking", "reasoning-dropped"])
def test_a_history_the_template_renders_otherwise_is_a_sequence_of_its_own_after_the_shared_prompt(
        thinking, monkeypatch, template, kwargs, replies):
    """Each later turn is sampled in the context the template renders (what the engine was asked
    for), a sequence after the prompt's tokens that context shares; the passes give every turn the
    log-probs of its own sequence alone, in float64, which is the context it was sampled in; the
    shared prefix is computed once (the positions saved counted)."""
    batch, tokenizer, engine = _rollouts(thinking, template, kwargs, replies, monkeypatch,
                                         "rollout.max_completion_length=400")
    c = batch.conversations[0]
    assert (c.turns, c.calls, c.failures) == (3, 2, 0) and c.messages[-1]["content"] == "20126"
    assert batch.sequence_ids is not None and batch.sequence_ids.max() == 2  # the two later turns
    shared = batch.sequence_prefix[batch.sequence_ids > 0].unique().tolist()
    prompt = int(batch.prompt_mask[0].sum())
    assert len(shared) == 1 and 0 < shared[0] <= prompt  # the prompt's tokens the rendering begins with
    tooled = load_config(None, ["rollout.tools=[grpokit.tasks.calculator:calculator]"])
    schemas = Tools.from_config(tooled.rollout, tooled.data, tooled.model, tokenizer).schemas
    for turn in (1, 2):  # what the engine was asked: the conversation as the template renders it
        rendered = tokenizer.apply_chat_template([*c.prompt, *_as_template_takes(c.messages[:2 * turn])], tools=schemas,
                                                 tokenize=False, add_generation_prompt=True)
        assert engine.calls[turn][0] == tokenizer(rendered, add_special_tokens=False)["input_ids"], turn
        assert engine.calls[turn][0] == contexts(batch)[turn], turn  # and the row's sequence of that turn
    model = load_model("tiny-random", "float64").eval()
    plain, where = plain_logprobs(model, batch), mask_of(batch)
    for budget in (None, 64, 10**6):  # padded, packed in rows of 64 tokens, packed whole
        passes = LogProbs(model, None, 1.0, None, False, False, 2, torch.device("cpu"), micro_batch_tokens=budget)
        got = passes.frozen(model, batch, torch.ones(2, dtype=torch.bool))
        assert ((got - plain).abs() * where).max() < 1e-12, budget
    # The positions the shared prefix saves: each later sequence would hold it again.
    saved = int((batch.sequence_prefix[:, 1:] * (batch.sequence_ids[:, 1:] != batch.sequence_ids[:, :-1])).sum())
    assert saved == 2 * 2 * shared[0]  # two later sequences a row, two rows


def _as_template_takes(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "reasoning_cut"} for m in messages]


def contexts(batch: RolloutBatch) -> list[list[int]]:
    """Row 0's context of each turn from the batch: its prompt, then each later sequence's shared
    prompt tokens and its own tokens before its turn (the trained tokens)."""
    ids = batch.completion_ids[0][batch.completion_mask[0].bool()].tolist()
    trained = batch.trained_mask[0].tolist()
    seqs, shared = batch.sequence_ids[0].tolist(), batch.sequence_prefix[0].tolist()
    prompt = batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist()
    out = [prompt]
    for s in sorted(set(seqs[:len(ids)]) - {0}):
        first = seqs.index(s)
        own = [t for t, k, m in zip(ids, seqs, trained) if k == s]
        untrained = next(i for i, (k, m) in enumerate(zip(seqs[first:], trained[first:])) if m)  # the context's end
        out.append(prompt[:shared[first]] + own[:untrained])
    return out


def test_a_prompt_cut_by_max_prompt_length_is_cut_alike_in_a_new_sequence(thinking, monkeypatch):
    """data.max_prompt_length keeps a prompt's end: a later sequence's context loses the same front,
    so it shares the cut prompt's tokens as the first turn's context did."""
    batch, tokenizer, engine = _rollouts(thinking, "qwen3.jinja", {"enable_thinking": False},
                                         [PLAIN_CALL, PLAIN_CALL, "20126"], monkeypatch, "data.max_prompt_length=100",
                                         "rollout.max_completion_length=400")
    assert int(batch.prompt_mask[0].sum()) == 100
    assert batch.sequence_prefix is not None and batch.sequence_prefix.max() > 90  # most of the cut prompt, shared
    assert engine.calls[1][0][:90] == engine.calls[0][0][:90]


def test_the_arithmetic_task_shows_two_worked_thinking_exchanges_when_asked():
    from grpokit.tasks.arithmetic import ArithmeticTask

    plain, thinking = ArithmeticTask(eval_size=2), ArithmeticTask(eval_size=2, thinking=True)
    assert len(plain.eval_examples[0].prompt) == 1
    shown = thinking.eval_examples[0].prompt
    assert [m["role"] for m in shown] == ["user", "assistant", "user", "assistant", "user"]
    assert shown[1]["content"] == "<think>\n3 + 4 = 7\n</think>\n\n7" and shown[-1] == plain.eval_examples[0].prompt[0]
    assert Reasoning("think").split(shown[3]["content"]).answer == "30"
