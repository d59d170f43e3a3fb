"""The tool-call formats of the model families (rollouts/tool_formats.py): each parsed from what
its model writes, rendered back through its template (tool results included) and parsed again, in
the multi-turn engine and in the agents' endpoint. Templates written in the test
(support/family_templates.py), over SmolLM2's tokenizer; the model's turns from the scripted engine."""

import json

import pytest
from support import scripted_engine
from support.family_templates import ADD, CALLS
from support.conversations import ADD_TOOL, WITH_TOOLS_AGENT
from support.runs import completions_log, untimed_metrics

from grpokit.cli import main
from grpokit.engines.protocols import ENGINES
from grpokit.models.loading import load_tokenizer
from grpokit.rollouts.tool_formats import FORMATS, Replies, harmony, hermes, llama3, mistral, tool_format
from grpokit.rollouts.tools import call_message


def _calls(parsed) -> list:
    return [{"name": c.name, "arguments": c.arguments} for c in parsed[1]]


@pytest.mark.parametrize("family", list(CALLS))
def test_a_call_round_trips_through_its_family_s_template(family):
    """The reply its model writes -> the call; the call (and the tool's result) rendered by the
    family's template -> the same reply text; read again -> the same call."""
    template, reply, content, _ = CALLS[family]
    tokenizer = load_tokenizer("tiny-random")
    tokenizer.chat_template = template
    replies = Replies.of(tokenizer)
    assert replies.format.name == family  # auto: the format the template writes
    message, calls, problems = replies.read(replies.text(tokenizer(reply, add_special_tokens=False)["input_ids"]
                                                         + [tokenizer.eos_token_id]))
    assert [{"name": c.name, "arguments": c.arguments} for c in calls] == [ADD] and not problems
    assert message["content"] == content
    message["tool_calls"] = [call_message(c) for c in calls]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, message,
                                              {"role": "tool", "name": "add", "content": "3"}], tokenize=False)
    call_text = reply[reply.index("<|start|>assistant<|channel|>commentary"):] if family == "harmony" else reply
    assert call_text.replace("\n", "") in rendered.replace("\n", "")
    asked = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False)
    turn = rendered[len(asked):].removeprefix("<|im_start|>assistant\n").removeprefix("<|start|>assistant")
    again = replies.read(turn[:turn.index("<|im_end|>")])
    assert _calls(again) == [ADD]


def test_several_calls_and_malformed_ones_in_each_format():
    assert _calls(llama3('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                         '{"name": "add", "parameters": {"a": 3, "b": 4}}')) == [ADD, {"name": "add", "arguments": {"a": 3, "b": 4}}]
    assert llama3('{"answer": 3}') == ('{"answer": 3}', [], [])  # JSON that is no call is an answer
    trailing = llama3('{"name": "add", "parameters": {"a": 1, "b": 2}} Calling add.')
    assert (trailing[0], _calls(trailing), trailing[2]) == ("Calling add.", [ADD], [])
    assert llama3("The sum is 3.") == ("The sum is 3.", [], [])
    assert llama3('<|python_tag|>{"name": "add", "parameters": {"a": 1')[2][0].startswith("error: the tool call is not valid JSON")
    assert _calls(mistral('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}')) == [ADD, ADD]
    assert _calls(mistral('[TOOL_CALLS]add[CALL_ID]abc123[ARGS]{"a": 1, "b": 2}')) == [ADD]
    assert mistral("[TOOL_CALLS][{nope}]")[2][0].startswith("error: the tool calls are not valid JSON")
    assert mistral("[TOOL_CALLS]oops")[2][0].startswith("error: [TOOL_CALLS] followed by neither")
    text = ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b":')
    content, calls, problems = harmony(text)
    assert _calls((content, calls, problems)) == [ADD] and problems[0].startswith("error: the arguments of the call to 'add'")
    assert harmony("<|channel|>final<|message|>3<|return|>") == ("3", [], [])
    assert hermes("<tool_call>{nope}</tool_call>")[2][0].startswith("error: the tool call is not valid JSON")


def test_the_format_is_chosen_by_name_or_from_the_template():
    tokenizer = load_tokenizer("tiny-random")
    assert tool_format("auto", tokenizer).name == "hermes"  # SmolLM2's ChatML writes no calls: grpokit's Hermes
    assert tool_format("mistral", tokenizer) is FORMATS["mistral"]
    with pytest.raises(ValueError, match="rollout.tool_call_format='xml': one of auto, harmony, mistral, hermes, llama3, template"):
        tool_format("xml", tokenizer)


@pytest.fixture
def family_run(monkeypatch, tmp_path):
    """The scripted engine, a dataset of one question, the `add` tool and an agent calling it."""
    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 2?"}],
                                                     "answer": "3"}) + "\n")
    return tmp_path


TOOLS_PY = "import json\n" + ADD_TOOL + WITH_TOOLS_AGENT


@pytest.mark.parametrize("family", list(CALLS))
@pytest.mark.parametrize("path", ["tools", "agent"])
def test_a_run_reads_its_family_s_calls_in_the_engine_and_the_endpoint(family_run, monkeypatch, family, path):
    """The scripted model calls add in its family's format, then answers: the multi-turn engine
    (rollout.tools) and the agents' endpoint (rollout.agent) both read the call and the run goes on
    to the answer."""
    template, reply, _, mark = CALLS[family]
    (family_run / "template.jinja").write_text(template)
    monkeypatch.setattr(scripted_engine, "SCRIPT", [reply, "3"])
    monkeypatch.setattr(scripted_engine, "TURN_MARK", mark)
    which = f"rollout.tools=[{family_run}/tools.py:add]" if path == "tools" else f"rollout.agent={family_run}/tools.py:with_tools"
    assert main(["train", "--no-progress", "model.name=tiny-random", f"model.chat_template={family_run}/template.jinja",
                 f"data.path={family_run}/data.jsonl", "data.eval_size=0", "rollout.engine=scripted", which,
                 "reward.functions=[exact_answer]", "train.prompts_per_step=1", "rollout.num_generations=2",
                 "rollout.max_completion_length=300", "train.max_steps=1", "monitor.log_completions=1",
                 f"train.output_dir={family_run / 'run'}"]) == 0
    row = untimed_metrics(family_run / "run")[0]
    assert row["turns/mean"] == 2 and row["rewards/exact_answer/mean"] == 1.0, row
    if path == "tools":
        assert row["tools/calls_per_rollout"] == 1 and row["tools/failures"] == 0
        record = completions_log(family_run / "run")[0]
        assert record["completion"][1] == {"role": "tool", "name": "add", "content": "3"}
    else:
        assert row["agents/failed"] == 0
