"""Agents as they are (rollouts/agents.py) through the run's OpenAI-compatible endpoint
(rollouts/endpoint.py): real `openai` clients against a real HTTP endpoint on 127.0.0.1."""

import asyncio
import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch
from support.exact import update_difference
from support.conversations import ADD_TOOL, FOLLOW_UP_AGENT, WITH_TOOLS_AGENT, tool_call
from support.processes import grpokit, run_worker
from support.trained_replies import answerer
from support.runs import assert_close_metrics, completions_log, measured, metric_rows, training_rows, untimed_metrics
from safetensors.torch import load_file

from support import scripted_engine
from grpokit.cli import main
from grpokit.engines.batch import SamplingParams
from grpokit.engines.prompts import PromptEncoder
from grpokit.engines.protocols import ENGINES
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.rollouts.agents import NO_REQUEST, Agents
from grpokit.rollouts.conversation import turn_seed
from grpokit.tasks.task import Example

pytest.importorskip("openai")

AGENT_PY = '''
import asyncio
import json
import pathlib
''' + ADD_TOOL + WITH_TOOLS_AGENT + '''


def with_tools_sync(client, model, row):
    """with_tools as a plain function, on a blocking client."""
    from transformers.utils import get_json_schema

    messages = list(row["prompt"])
    for turn in range(5):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[get_json_schema(add)])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length" or turn == 4:
            return 0.0
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(add(**json.loads(call.function.arguments)))})


async def with_tools_responses(client, model, row):
    """with_tools on the Responses API: the output items go back as input items."""
    from transformers.utils import get_json_schema

    items = list(row["prompt"])
    for turn in range(5):
        reply = await client.responses.create(model=model, input=items,
                                              tools=[{"type": "function", **get_json_schema(add)["function"]}])
        items += [item.model_dump(exclude_none=True) for item in reply.output]
        calls = [item for item in reply.output if item.type == "function_call"]
        if not calls or reply.status == "incomplete" or turn == 4:
            return 0.0
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": str(add(**json.loads(call.arguments)))})


async def always_fails(client, model, row):
    await client.chat.completions.create(model=model, messages=row["prompt"])
    raise RuntimeError("the agent broke")


async def wrong_signature(client, row):
    return 1.0


async def with_tools_streamed(client, model, row):
    """with_tools, each reply streamed and its chunks joined back into the message; a reply (of
    tool calls only, too) carries its tokens' log-probs."""
    from transformers.utils import get_json_schema

    messages = list(row["prompt"])
    for turn in range(5):
        chunks = await client.chat.completions.create(model=model, messages=messages, tools=[get_json_schema(add)],
                                                      stream=True, logprobs=True)
        content, calls, finish, logprobs = "", {}, None, []
        async for chunk in chunks:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                logprobs += choice.logprobs.content if choice.logprobs else []
                for call in choice.delta.tool_calls or ():
                    joined = calls.setdefault(call.index, {"id": "", "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                    joined["id"] += call.id or ""
                    joined["function"]["name"] += call.function.name or ""
                    joined["function"]["arguments"] += call.function.arguments or ""
                finish = choice.finish_reason or finish
        messages.append({"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})})
        if not logprobs:
            raise AssertionError(f"a streamed reply without its log-probs: {messages[-1]}")
        if not calls or finish == "length" or turn == 4:
            return 0.0
        for call in calls.values():
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": str(add(**json.loads(call["function"]["arguments"])))})


CACHE = pathlib.Path(__file__).parent / "cache.json"


async def cached(client, model, row):
    """Answers from a cache on disk keyed by the messages alone, as DSPy's is by default."""
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    key = json.dumps(row["prompt"])
    if key not in cache:
        reply = await client.chat.completions.create(model=model, messages=row["prompt"])
        cache = {**(json.loads(CACHE.read_text()) if CACHE.exists() else {}), key: reply.choices[0].message.content}
        CACHE.write_text(json.dumps(cache))
    return {"answered": float(cache[key] == "3")}


async def misbehaving(client, model, row):
    """Row by row: fine, raises, another model, a bad reward, no request, never returns."""
    kind = int(row["kind"])
    if kind == 4:
        return 1.0
    if kind == 5:
        await asyncio.sleep(60)
    reply = await client.chat.completions.create(model="gpt-4o" if kind == 2 else model, messages=row["prompt"])
    if kind == 1:
        raise RuntimeError("the agent broke")
    return "great" if kind == 3 else {"tidy": 1.0, "short": -len(reply.choices[0].message.content or "") / 100}
''' + FOLLOW_UP_AGENT

T = ["model.name=tiny-random", "train.max_steps=2", "rollout.num_generations=2", "train.prompts_per_step=2",
     "rollout.max_completion_length=400", "data.eval_size=0", "reward.functions=[exact_answer]"]


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """The scripted engine (tiny-random's random weights never write a tool call), the agents, the tool and data."""
    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")
    (tmp_path / "agents.py").write_text(AGENT_PY)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": "3", "kind": i}) + "\n"
        for i in range(6)))
    return tmp_path


def test_an_agent_trains_as_the_same_conversations_through_grpokit_s_tools(scripted, monkeypatch):
    """The same tool loop, once as rollout.tools (grpokit's multi-turn path) and once as an agent
    through the endpoint: the same contexts reach the engine, and the runs are the same bit for bit.
    So are the agent's replies streamed (content and tool-call deltas joined by the agent), and the
    agent as a plain `def` on a blocking client (run in threads, the rollouts together)."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", [tool_call("add", a=1, b=2), "3"])
    common = [*T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl", "monitor.log_completions=1"]
    assert main(["train", "--no-progress", *common, f"rollout.tools=[{scripted}/agents.py:add]",
                 f"train.output_dir={scripted}/tools"]) == 0
    others = ("with_tools_streamed", "with_tools_sync", "with_tools_responses")
    for name in ("with_tools", *others):
        assert main(["train", "--no-progress", *common, f"rollout.agent={scripted}/agents.py:{name}",
                     f"train.output_dir={scripted}/{name}"]) == 0
    tools, agent = untimed_metrics(scripted / "tools"), untimed_metrics(scripted / "with_tools")
    for a, b in zip(tools, agent):
        assert a["turns/mean"] == b["turns/mean"] == 2 and b["agents/failed"] == 0
        assert {k: v for k, v in a.items() if not k.startswith(("tools/", "turns/"))} == \
            {k: v for k, v in b.items() if not k.startswith(("agents/", "rewards/agent", "turns/"))}
    for other in others:
        assert agent == [{k.replace(other, "with_tools"): v for k, v in row.items()}
                         for row in untimed_metrics(scripted / other)]
        assert completions_log(scripted / other) == completions_log(scripted / "with_tools")
    weights = [load_file(scripted / run / "final" / "model.safetensors") for run in ("tools", "with_tools", *others)]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])
    record = completions_log(scripted / "with_tools")[0]
    assert [m["role"] for m in record["completion"]] == ["assistant", "tool", "assistant"]
    assert record["completion"][1]["content"] == "3" and record["reward"] == 1.0


def assert_example_trains_alike(scripted, monkeypatch, example: str, names: tuple[str, ...]) -> None:
    """examples/agents/<example> as shipped, each agent of `names` for a step on the calculator
    task through the endpoint: the tool called and answered, and the runs the same bit for bit."""
    # The prompt's two worked examples hold two tool results already: the reply to a context with
    # two is a call, to one with three the answer.
    call = tool_call("calculator", expression="2 * 3")
    monkeypatch.setattr(scripted_engine, "SCRIPT", [call, call, call, "6"])
    path = Path(__file__).parents[2] / "examples" / "agents" / example
    for name in names:
        assert main(["train", "--no-progress", "model.name=tiny-random", "train.max_steps=1",
                     "rollout.num_generations=2", "train.prompts_per_step=2", "rollout.max_completion_length=400",
                     "data.eval_size=0", "data.task=calculator", "rollout.tools=[]", "rollout.engine=scripted",
                     "monitor.log_completions=1", f"rollout.agent={path}:{name}",
                     f"train.output_dir={scripted / name}"]) == 0
        row = training_rows(scripted / name)[0]
        assert row["agents/failed"] == 0 and row["agents/refused_requests"] == 0 and row["turns/mean"] == 2
        record = completions_log(scripted / name)[0]
        assert [m["role"] for m in record["completion"]] == ["assistant", "tool", "assistant"]
        assert record["completion"][1]["content"] == "6" and record["completion"][2]["content"] == "6"
    first = untimed_metrics(scripted / names[0])
    weights = [load_file(scripted / name / "final" / "model.safetensors") for name in names]
    for name, w in zip(names[1:], weights[1:]):
        assert first == [{k.replace(name, names[0]): v for k, v in r.items()} for r in untimed_metrics(scripted / name)]
        assert all(torch.equal(weights[0][k], w[k]) for k in w)


def test_the_agents_sdk_example_trains_alike_on_either_api_streamed_or_not(scripted, monkeypatch):
    """The SDK's tool loop on its default Responses API, on chat completions, and streamed."""
    pytest.importorskip("agents", reason="the Agents SDK example needs: pip install openai-agents")
    assert_example_trains_alike(scripted, monkeypatch, "openai_agents_sdk.py", ("agent", "agent_chat", "agent_streamed"))


def test_the_langgraph_example_trains_alike_streamed_or_not(scripted, monkeypatch):
    """A LangGraph ReAct agent (LangChain's create_agent) on ChatOpenAI, invoked and streamed."""
    for module in ("langchain", "langgraph", "langchain_openai"):
        pytest.importorskip(module, reason="the LangGraph example needs: pip install langchain langgraph langchain-openai")
    assert_example_trains_alike(scripted, monkeypatch, "langgraph_react.py", ("agent", "agent_streamed"))


def test_the_langgraph_example_does_not_hold_the_loop_its_rollouts_share(scripted, monkeypatch):
    """Each rollout's ChatOpenAI makes two HTTP clients, each loading the CA certificates: made on
    the event loop every rollout shares, 32 rollouts held it 1.5 to 5 s at a step's start and
    tripped grpokit's own warning. The example builds its agent in a worker thread."""
    import warnings

    pytest.importorskip("langchain_openai", reason="the LangGraph example needs: pip install langchain-openai")
    monkeypatch.setattr(scripted_engine, "SCRIPT", ["6"])
    path = Path(__file__).parents[2] / "examples" / "agents" / "langgraph_react.py"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--no-progress", "model.name=tiny-random", "train.max_steps=1", "data.eval_size=0",
                     "rollout.num_generations=8", "train.prompts_per_step=4", "data.task=calculator",
                     "rollout.tools=[]", "rollout.engine=scripted", f"rollout.agent={path}:agent",
                     f"train.output_dir={scripted / 'run'}"]) == 0
    assert not [w for w in caught if "held the event loop" in str(w.message)]


def test_an_agent_that_cannot_take_client_model_row_is_refused_at_start_up(scripted, capsys):
    assert main(["train", "--no-progress", *T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl",
                 f"rollout.agent={scripted}/agents.py:wrong_signature", f"train.output_dir={scripted}/run"]) == 2
    assert f"rollout.agent '{scripted}/agents.py:wrong_signature' must take (client, model, row): too many " \
           "positional arguments" in capsys.readouterr().err


def test_an_empty_reward_functions_beside_an_agent_is_the_agent_s_reward_alone(scripted, monkeypatch, capsys):
    """docs/agents.md's command: reward.functions=[] with an agent trains on what it returns; with
    no agent, an empty list is refused, naming what it is for."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", ["3"])
    run = ["train", "--no-progress", *T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl",
           "train.max_steps=1", "reward.functions=[]"]
    assert main([*run, f"rollout.agent={scripted}/agents.py:with_tools", f"train.output_dir={scripted}/run"]) == 0
    row = training_rows(scripted / "run")[0]
    assert [k for k in row if k.startswith("rewards/") and k.endswith("/mean")] == ["rewards/agent/mean"]
    assert main([*run, f"train.output_dir={scripted}/none"]) == 2
    assert "reward.functions is empty: name at least one function, or null for the task's own (an empty list is " \
           "for rollout.agent" in capsys.readouterr().err


def test_every_rollout_failing_three_steps_in_a_row_stops_the_run(scripted, monkeypatch, capsys):
    """Loud: each step's failures raise the `agents` alert on the console, and once every rollout's
    agent has failed in 3 steps in a row the run stops (exit 1) with the error and the step to
    resume from (step 2: saved before the failing step), as rewards that are all None do."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", ["3"])
    out = scripted / "run"
    code = main(["train", "--no-progress", *T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl",
                 "train.max_steps=6", f"rollout.agent={scripted}/agents.py:always_fails", f"train.output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert ("every rollout's agent ('" + str(scripted) + "/agents.py:always_fails') failed in 3 steps in a row, the "
            "last for instance: raised RuntimeError: the agent broke") in err
    assert "resume from step-2" in err
    assert [r["step"] for r in metric_rows(out)] == [1, 2]
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    assert [a["kind"] for a in alerts] == ["agents"] and "4 of 4 rollouts' agents failed" in alerts[0]["evidence"]
    # Where the message points: every failed rollout's record, the stopping step's too, at its step
    # (completions.jsonl is written every monitor.log_completions=20 steps: none here).
    assert "failures.jsonl has every agent_error" in err and not (out / "completions.jsonl").exists()
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [r["step"] for r in failures] == [1] * 4 + [2] * 4 + [3] * 4
    assert {r["agent_error"] for r in failures} == {"raised RuntimeError: the agent broke"}


def test_a_malformed_tool_call_reaches_the_agent_as_written(scripted, monkeypatch):
    """The model writes a call that is not JSON: the agent gets the model's whole text as the
    reply's content (no tool call), and completions.jsonl records the problem."""
    malformed = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    monkeypatch.setattr(scripted_engine, "SCRIPT", [malformed, "3"])
    assert main(["train", "--no-progress", *T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl",
                 "monitor.log_completions=1", "train.max_steps=1", f"rollout.agent={scripted}/agents.py:with_tools",
                 f"train.output_dir={scripted}/run"]) == 0
    record = completions_log(scripted / "run")[0]
    assert [m["role"] for m in record["completion"]] == ["assistant"]
    assert record["completion"][0]["content"].strip() == malformed
    assert record["tool_call_problems"] == ["error: the tool call is not valid JSON (Expecting property name "
                                            'enclosed in double quotes): {"name": "add", "arguments": {"a": 1,}}']


@pytest.mark.process
def test_an_agent_on_a_rollout_server_s_openai_routes_is_the_in_process_run(scripted, server):
    """rollout.engine=server: the agents' requests go to `grpokit serve`'s own OpenAI routes, which
    generate them in the same rounds from the same seeds as the trainer's endpoint in front of the
    in-process engine: the same run, bit for bit (evaluations included). The server also renders
    with the trainer's chat template (here one that rewrites history, which it sends)."""
    from support.runs import assert_same_run

    (scripted / "rewriting.jinja").write_text(REWRITING_TEMPLATE)
    s = server()
    common = ["model.name=tiny-random", f"rollout.agent={scripted}/agents.py:follow_up", "train.max_steps=2",
              "rollout.num_generations=2", "train.prompts_per_step=2", "rollout.max_completion_length=16",
              "data.eval_size=2", "train.eval_every=2", "train.learning_rate=1e-3",
              f"model.chat_template={scripted}/rewriting.jinja"]
    assert main(["train", "--no-progress", *common, "rollout.engine=server", f"rollout.server_url={s.url}",
                 f"train.output_dir={scripted}/served"]) == 0
    assert main(["train", "--no-progress", *common, f"train.output_dir={scripted}/local"]) == 0
    assert_same_run(scripted / "served", scripted / "local", steps=2)
    assert training_rows(scripted / "served")[0]["agents/new_sequences"] == 4


def test_recorded_tokens_are_what_the_engine_sampled(tiny):
    """Each request samples from its rollout's turn seed; a request that extends the previous
    exchange reuses its ids (never decoded and encoded again), and only sampled tokens are trained."""
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    engine = TransformersEngine(model, tokenizer.pad_token_id, [eos])
    seen = {}

    async def agent(client, model_name, row):
        messages = list(row["prompt"])
        first = await client.chat.completions.create(model=model_name, messages=messages, max_tokens=5)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        second = await client.chat.completions.create(model=model_name, messages=messages)
        seen.setdefault(row["n"], []).append((first.choices[0].message.content, second.usage.prompt_tokens))
        return 1.0

    agents = Agents(agent, "agent", tokenizer, [eos], timeout=60, encoder=PromptEncoder(tokenizer))
    try:
        prompt = [{"role": "user", "content": "Say something."}]
        params = SamplingParams(40, 1.0)
        batch = agents.generate(engine, [Example(prompt, {"n": 0}), Example(prompt, {"n": 1})], [2, 1], params,
                                seeds=[7, 8, 9])
        transcripts = list(agents.endpoint.transcripts.values())
    finally:
        agents.close()
    ids = tokenizer(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    for r, t in enumerate(transcripts):
        first, second = t.exchanges
        alone = engine.generate([ids], 1, SamplingParams(5, 1.0), [turn_seed([7, 8, 9][r], 0)])
        assert first.prompt == ids and first.sampled == alone.completion_ids[0, :int(alone.completion_mask[0].sum())].tolist()
        assert second.extends and second.prompt[:len(ids) + len(first.sampled)] == ids + first.sampled
        room = 40 - (len(second.prompt) - len(ids))
        assert 0 < room < 40
        again = engine.generate([second.prompt], 1, SamplingParams(room, 1.0), [turn_seed([7, 8, 9][r], 1)])
        assert second.sampled == again.completion_ids[0, :int(again.completion_mask[0].sum())].tolist()
        n = len(second.prompt) + len(second.sampled) - len(ids)
        assert batch.completion_ids[r, :n].tolist() == second.prompt[len(ids):] + second.sampled
        trained = [1] * len(first.sampled) + [0] * (len(second.prompt) - len(ids) - len(first.sampled)) + \
            [1] * len(second.sampled)
        assert batch.trained_mask[r, :n].tolist() == trained and batch.completion_mask[r].sum() == n
        assert batch.conversations[r].environment.reward == 1.0 and batch.conversations[r].turns == 2
    assert len(seen[0]) == 2 and len(seen[1]) == 1


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_streamed_reply_is_the_whole_reply_and_records_the_same_tokens(tiny, route):
    """stream=True (with stream_options.include_usage): the chunks join into the reply a request
    without it gets (text, finish reason, usage, log-probs), from the same sampled tokens, recorded
    alike."""
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    engine = TransformersEngine(model, tokenizer.pad_token_id, [eos])
    prompt = [{"role": "user", "content": "Say something."}]

    def run(stream: bool):
        got = []

        async def agent(client, model_name, row):
            create, kwargs = ((client.chat.completions.create, {"messages": row["prompt"]}) if route == "chat" else
                              (client.completions.create, {"prompt": "Once upon a time"}))
            kwargs.update(model=model_name, max_tokens=12, logprobs=True if route == "chat" else 0)

            def logprobs(choice) -> list[float]:
                if choice.logprobs is None:
                    return []
                return [t.logprob for t in choice.logprobs.content] if route == "chat" else \
                    choice.logprobs.token_logprobs

            if not stream:
                reply = await create(**kwargs)
                choice = reply.choices[0]
                text = choice.message.content if route == "chat" else choice.text
                got.append((text, choice.finish_reason, reply.usage.completion_tokens, logprobs(choice), reply.object))
                return 1.0
            text, finish, usage, logps, kinds = "", None, None, [], set()
            async for chunk in await create(**kwargs, stream=True, stream_options={"include_usage": True}):
                kinds.add(chunk.object)
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    text += (choice.delta.content or "") if route == "chat" else choice.text
                    finish = choice.finish_reason or finish
                    logps += logprobs(choice)
            got.append((text, finish, usage.completion_tokens, logps, kinds.pop().removesuffix(".chunk")))
            assert not kinds
            return 1.0

        agents = Agents(agent, "agent", tokenizer, [eos], timeout=60, encoder=PromptEncoder(tokenizer))
        try:
            batch = agents.generate(engine, [Example(prompt, {})], [2], SamplingParams(12, 1.0), seeds=[3, 4])
            sampled = [t.exchanges[0].sampled for t in agents.endpoint.transcripts.values()]
        finally:
            agents.close()
        assert [c.environment.reward for c in batch.conversations] == [1.0, 1.0]  # no agent failed
        return sorted(got), sampled

    streamed, whole = run(stream=True), run(stream=False)
    assert streamed == whole and all(text and logps for text, _, _, logps, _ in streamed[0])
    assert {kind for *_, kind in whole[0]} == {"chat.completion" if route == "chat" else "text_completion"}


def one_rollout(tiny, agent, max_tokens: int = 12, error: str | None = None):
    """`agent` as the one rollout of a generation on tiny-random (temperature 1, seed 3): its
    transcript's exchanges; error: the rollout's outcome."""
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    agents = Agents(agent, "agent", tokenizer, [eos], timeout=60, encoder=PromptEncoder(tokenizer))
    try:
        batch = agents.generate(TransformersEngine(model, tokenizer.pad_token_id, [eos]),
                                [Example([{"role": "user", "content": "Say something."}], {})], [1],
                                SamplingParams(max_tokens, 1.0), seeds=[3])
        exchanges = agents.endpoint.transcripts[0].exchanges
    finally:
        agents.close()
    assert batch.conversations[0].environment.error == error
    return exchanges


def test_a_stop_string_ends_the_reply_and_the_conversation_goes_on_from_its_tokens(tiny):
    """`stop`: the text returned ends before the stop string, the tokens recorded end with the one
    that completes it (a prefix of what was sampled without it), and the agent's next request,
    the reply as returned then a user turn, continues that sequence token in, token out. With it,
    `top_logprobs` (chat) and `logprobs` = 2 (/completions): the alternatives beside each token,
    which change nothing sampled."""
    _, tokenizer = tiny
    got = {}

    async def agent(client, model_name, row):
        messages = list(row["prompt"])
        reply = await client.chat.completions.create(model=model_name, messages=messages, logprobs=True,
                                                     **got.get("stop", {}))
        got.setdefault("replies", []).append(reply)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And?"}]
        await client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
        if "stop" in got:
            got["text"] = await client.completions.create(model=model_name, prompt="Once", max_tokens=3, logprobs=2)
        return 1.0

    whole = one_rollout(tiny, agent)
    text = tokenizer.decode(whole[0].sampled, skip_special_tokens=True)
    stop = text[5:8]
    assert len(text) > 10 and stop.strip() and text.find(stop) == 5
    got["stop"] = {"stop": ["never written", stop], "top_logprobs": 3}
    cut = one_rollout(tiny, agent)
    plain, stopped = (r.choices[0] for r in got["replies"])
    assert plain.finish_reason == "length" and plain.message.content == text
    assert stopped.finish_reason == "stop" and stopped.message.content == text[:5]
    n = len(cut[0].sampled)
    assert cut[0].sampled == whole[0].sampled[:n] and cut[0].logps == whole[0].logps[:n]
    assert stop in tokenizer.decode(cut[0].sampled) and stop not in tokenizer.decode(cut[0].sampled[:-1])
    assert cut[1].extends and cut[1].prompt[:len(cut[0].prompt) + n] == cut[0].prompt + cut[0].sampled
    # logprobs: each token's, under the distribution it was sampled from
    assert [t.logprob for t in plain.logprobs.content] == whole[0].logps
    assert "".join(t.token for t in plain.logprobs.content) == text
    assert [t.logprob for t in stopped.logprobs.content] == cut[0].logps
    # top_logprobs: the sampling pass's most likely tokens beside each (rollout/test_decoding.py
    # checks them against a naive forward), most likely first; the sampled one among them where it ranks
    for token, sampled, logp, alternatives in zip(stopped.logprobs.content, cut[0].sampled, cut[0].logps,
                                                  cut[0].alternatives):
        assert [(t.token, t.logprob) for t in token.top_logprobs] == \
            [(tokenizer.decode([i]), lp) for i, lp in alternatives] and len(alternatives) == 3
        assert alternatives[0][1] >= alternatives[1][1] >= alternatives[2][1] and alternatives[0][1] >= logp
        assert (sampled in [i for i, _ in alternatives]) == (logp >= alternatives[2][1])
    assert whole[0].alternatives is None and all(t.top_logprobs == [] for t in plain.logprobs.content)
    text_logprobs = got["text"].choices[0].logprobs
    assert text_logprobs.top_logprobs == [{tokenizer.decode([i]): lp for i, lp in a} for a in cut[2].alternatives]
    assert text_logprobs.token_logprobs == cut[2].logps and all(len(a) == 2 for a in cut[2].alternatives)


REFUSED = [
    ("chat", {"temperature": 0.5}, "temperature=0.5: the run samples at temperature=1.0 (rollout.temperature)"),
    ("chat", {"tool_choice": "required"}, "tool_choice='required': not supported: forcing or forbidding a tool call"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format {'type': 'json_object'}: not supported"),
    ("chat", {"logit_bias": {"5": 10}}, "logit_bias={'5': 10}: not supported: a bias changes the distribution"),
    ("chat", {"seed": 1}, "seed=1: not supported: each rollout samples from its own seed"),
    ("chat", {"top_logprobs": 2}, "top_logprobs=2 lists alternatives beside each token's log-prob, which the request "
                                  "does not ask for: add logprobs: true"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs=21: must be an integer from 0 to 20"),
    ("chat", {"n": 2}, "n must be 1"),
    ("chat", {"extra_body": {"guided_json": {}}}, "unknown field guided_json for /chat/completions"),
    ("completions", {"logprobs": 6}, "logprobs=6: must be an integer from 0 to 5"),
    ("completions", {"echo": True}, "echo=True: not supported: the prompt is not returned"),
    ("responses", {"previous_response_id": "resp_1"}, "previous_response_id: not supported: this endpoint stores no "
                                                      "responses"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
     "text.format {'type': 'json_schema', 'name': 'x', 'schema': {}}: not supported: decoding constrained"),
    ("responses", {"tools": [{"type": "web_search"}]}, "tools: only function tools are supported, got ['web_search']"),
    ("chat", {"stream": True, "stream_options": {"x": 1}}, "stream_options: only include_usage is supported, got {'x': 1}"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true"),
    ("responses", {"reasoning": "high"}, "reasoning='high': must be an object"),
]


def test_a_field_that_would_change_what_is_sampled_is_refused_by_name(tiny):
    """Each of REFUSED's requests, one after the other in one rollout: answered 400 with its
    message, and nothing generated or recorded."""
    import openai

    refused = []

    async def agent(client, model_name, row):
        for route, fields, _ in REFUSED:
            create, kwargs = {"chat": (client.chat.completions.create, {"messages": row["prompt"], "max_tokens": 2}),
                              "completions": (client.completions.create, {"prompt": "Once", "max_tokens": 2}),
                              "responses": (client.responses.create, {"input": "Hi", "max_output_tokens": 2})}[route]
            try:
                await create(model=model_name, **kwargs, **fields)
            except openai.BadRequestError as e:
                refused.append(e.body["message"])
        return 1.0

    assert one_rollout(tiny, agent, error=NO_REQUEST) == []  # nothing generated or recorded
    assert len(refused) == len(REFUSED)
    for (_, _, message), got in zip(REFUSED, refused):
        assert message in got, (message, got)


def test_the_docs_table_of_request_fields_is_the_one_the_endpoint_applies():
    from grpokit.rollouts.request_fields import table

    docs = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    assert table() in docs, "docs/agents.md's request-field table is stale: paste request_fields.table()"


def test_a_responses_reply_streamed_is_the_reply_whole(tiny):
    """stream=True on /responses: the events' deltas join into the text, and the completed event
    carries the response a request without it gets, from the same tokens."""
    got = []

    async def agent(client, model_name, row):
        whole = await client.responses.create(model=model_name, input=row["prompt"], max_output_tokens=6,
                                              include=["message.output_text.logprobs"], top_logprobs=2)
        events = [e async for e in await client.responses.create(model=model_name, input=row["prompt"],
                                                                 max_output_tokens=6, stream=True)]
        got.append((whole, events))
        return 1.0

    first, second = one_rollout(tiny, agent, max_tokens=40)
    whole, events = got[0]
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete"  # the message cut at the limit says so too, as the response does
    assert [t.logprob for t in whole.output[0].content[0].logprobs] == first.logps
    assert [[t.logprob for t in token.top_logprobs] for token in whole.output[0].content[0].logprobs] == \
        [[lp for _, lp in a] for a in first.alternatives] and all(len(a) == 2 for a in first.alternatives)
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    streamed = events[-1].response
    assert text == streamed.output_text and streamed.usage.output_tokens == whole.usage.output_tokens == 6
    # Two requests of one rollout: the second is a new sequence from the same context, its own turn seed.
    assert first.prompt == second.prompt and not second.extends


class SlowEngine(TransformersEngine):
    """Generation that takes two seconds a round."""

    def generate(self, *args, **kwargs):
        time.sleep(2.0)
        return super().generate(*args, **kwargs)


def test_the_agent_timeout_counts_the_agent_s_own_time_not_the_wait_for_generation(tiny):
    """rollout.agent_timeout=1: an agent whose request waits two seconds for generation is in time;
    one that spends 1.6 s itself is not, and says so. (The quick agent's own time, its client's
    work, stays well under the second on a loaded machine; at 0.5 s it did not always.)"""
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id

    async def agent(client, model_name, row):
        if row["slow"]:
            await asyncio.sleep(1.6)
        await client.chat.completions.create(model=model_name, messages=row["prompt"], max_tokens=2)
        return 1.0

    agents = Agents(agent, "agent", tokenizer, [eos], timeout=1.0, encoder=PromptEncoder(tokenizer))
    prompt = [{"role": "user", "content": "Hi"}]
    try:
        batch = agents.generate(SlowEngine(model, tokenizer.pad_token_id, [eos]),
                                [Example(prompt, {"slow": False}), Example(prompt, {"slow": True})], [1, 1],
                                SamplingParams(2, 1.0), seeds=[0, 1])
    finally:
        agents.close()
    quick, slow = (c.environment for c in batch.conversations)
    assert quick.error is None and quick.reward == 1.0
    assert slow.error == ("did not return within rollout.agent_timeout=1 s of its own time (its requests' wait for "
                          "generation not counted)")


def test_an_async_agent_that_blocks_the_loop_and_a_failed_rollout_are_said_on_the_console(tiny):
    """A blocking call in a task an async agent's framework started holds the loop every agent
    runs on: named once a run. A generation with failed rollouts says how many and the first error."""
    from grpokit.rollouts.agents import AgentWarning

    model, tokenizer = tiny
    eos = tokenizer.eos_token_id

    async def framework_step():
        time.sleep(1.5)  # a framework's synchronous call, in a task of its own

    async def agent(client, model_name, row):
        if row["fails"]:
            raise RuntimeError("the agent broke")
        await asyncio.gather(asyncio.create_task(framework_step()))
        await client.chat.completions.create(model=model_name, messages=row["prompt"], max_tokens=2)
        return 1.0

    agents = Agents(agent, "agent", tokenizer, [eos], timeout=60, encoder=PromptEncoder(tokenizer))
    prompt = [{"role": "user", "content": "Hi"}]
    try:
        with pytest.warns(AgentWarning) as said:
            agents.generate(TransformersEngine(model, tokenizer.pad_token_id, [eos]),
                            [Example(prompt, {"fails": False}), Example(prompt, {"fails": True})], [1, 1],
                            SamplingParams(2, 1.0), seeds=[0, 1])
    finally:
        agents.close()
    messages = [str(w.message) for w in said]
    assert messages[0] == "1 of 2 rollouts' agents ('agent') failed, the first: raised RuntimeError: the agent broke " \
                          "(every agent_error is in failures.jsonl)"
    assert messages[1].startswith("rollout.agent 'agent' held the event loop every rollout's agent runs on for ")
    assert "asyncio.to_thread" in messages[1] and len(messages) == 2


def test_a_client_shared_by_the_rollouts_is_refused_and_nothing_of_it_trained(tiny):
    """A global client (made once, here the first rollout's, used by every rollout): the rollouts'
    requests all reach one rollout's URL. One is that rollout's; the others are refused, naming
    the likely cause and the fix, and only the one request is recorded."""
    import openai

    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    shared, refused = {}, []

    async def agent(client, model_name, row):
        client = shared.setdefault("client", client)
        try:
            await client.chat.completions.create(model=model_name, messages=row["prompt"], max_tokens=3)
        except openai.BadRequestError as e:
            refused.append(e.body["message"])
            raise
        return 1.0

    agents = Agents(agent, "agent", tokenizer, [eos], timeout=60, encoder=PromptEncoder(tokenizer))
    try:
        batch = agents.generate(TransformersEngine(model, tokenizer.pad_token_id, [eos]),
                                [Example([{"role": "user", "content": "Hi"}], {})], [3], SamplingParams(3, 1.0),
                                seeds=[0, 1, 2])
        exchanges = [len(t.exchanges) for t in agents.endpoint.transcripts.values()]
    finally:
        agents.close()
    assert sorted(exchanges) == [0, 0, 1] and len(refused) == 2
    assert all("set_default_openai_client" in m and "Nothing from this request is trained" in m for m in refused)
    # Two agents raised the refusal; the third got the one reply. Whose request that was is timing's:
    # the URL's own rollout (no error), or another (the URL's rollout then failed, and the other
    # made no request to its own URL): either way no rollout is credited with another's tokens.
    errors = [c.environment.error or "" for c in batch.conversations]
    assert sum(e.startswith("raised BadRequestError") for e in errors) == 2


# ChatML that drops the content of the assistant turns before the last user turn, as a thinking
# model's template drops their reasoning (here all of a reply counts as reasoning).
REWRITING_TEMPLATE = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role != 'assistant' or loop.index0 > ns.last %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_history_trains_each_request_as_its_own_sequence(tiny, monkeypatch):
    """A chat template that renders earlier turns otherwise once a later one follows: the second
    request does not extend the first, is counted in agents/new_sequences, and is trained as a
    sequence of its own in the rollout's row: its log-probs there (float64) are those it was
    sampled with alone, and the row's loss mask covers both requests' sampled tokens."""
    from grpokit.models.logprobs import LogProbs

    model, tokenizer = tiny
    model = copy.deepcopy(model).double()
    monkeypatch.setattr(tokenizer, "chat_template", REWRITING_TEMPLATE)
    eos = tokenizer.eos_token_id
    engine = TransformersEngine(model, tokenizer.pad_token_id, [eos])

    async def agent(client, model_name, row):
        messages = list(row["prompt"])
        first = await client.chat.completions.create(model=model_name, messages=messages, max_tokens=6)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        await client.chat.completions.create(model=model_name, messages=messages, max_tokens=6)
        return 0.5

    agents = Agents(agent, "agent", tokenizer, [eos], timeout=60, encoder=PromptEncoder(tokenizer))
    try:
        batch = agents.generate(engine, [Example([{"role": "user", "content": "Say something."}], {})], [2],
                                SamplingParams(8, 1.0), seeds=[1, 2])
        transcripts = list(agents.endpoint.transcripts.values())
    finally:
        agents.close()
    logps = LogProbs(model, None, 1.0, None, False, False, 2, torch.device("cpu")).of(model, batch, torch.arange(2))
    for r, t in enumerate(transcripts):
        first, second = t.exchanges
        assert not second.extends and batch.conversations[r].environment.new_sequences == 1
        assert second.prompt[:len(first.prompt)] != first.prompt + first.sampled[:1]  # the history was rewritten
        row = first.sampled + second.prompt + second.sampled
        n = len(row)
        assert batch.completion_ids[r, :n].tolist() == row and batch.completion_mask[r].sum() == n
        assert batch.sequence_ids[r, :n].tolist() == [0] * len(first.sampled) + [1] * (n - len(first.sampled))
        trained = [1] * len(first.sampled) + [0] * len(second.prompt) + [1] * len(second.sampled)
        assert batch.trained_mask[r, :n].tolist() == trained
        mask = batch.trained_mask[r].bool()
        torch.testing.assert_close(logps[r][mask], alone(model, t), atol=1e-12, rtol=0)
        torch.testing.assert_close(logps[r][mask], batch.sampling_logps[r][mask].double(), atol=1e-5, rtol=0)
    trained = batch.trained_mask.bool()
    model.train()  # each row whole (activation checkpointing's path)
    with torch.no_grad():
        whole = LogProbs(model, None, 1.0, None, True, False, 2, torch.device("cpu")).of(model, batch, torch.arange(2))
    model.eval()
    torch.testing.assert_close(whole[trained], logps[trained], atol=1e-12, rtol=0)
    model.set_attn_implementation("eager")  # its additive mask
    eager = LogProbs(model, None, 1.0, None, False, False, 2, torch.device("cpu")).of(model, batch, torch.arange(2))
    torch.testing.assert_close(eager[trained], torch.cat([alone(model, t) for t in transcripts]), atol=1e-12, rtol=0)


@torch.no_grad()
def alone(model, transcript) -> torch.Tensor:
    """The log-probs of a transcript's sampled tokens, each request alone: its prompt, then its tokens."""
    from grpokit.models.logprobs import completion_logprobs

    return torch.cat([completion_logprobs(model, torch.tensor([e.prompt]), torch.ones(1, len(e.prompt), dtype=torch.long),
                                          torch.tensor([e.sampled]))[0] for e in transcript.exchanges])


def test_agents_that_fail_are_counted_and_the_run_goes_on(scripted, monkeypatch):
    """An agent that raises, asks for another model, returns no reward, makes no request, or never
    returns: each rollout fails (no reward, counted, its error recorded); the others train."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", ["3"])
    run = scripted / "run"
    assert main(["train", "--no-progress", *T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl",
                 "train.prompts_per_step=6", "train.max_steps=1", "rollout.agent_timeout=3",
                 "monitor.log_completions=1", f"rollout.agent={scripted}/agents.py:misbehaving",
                 f"train.output_dir={run}"]) == 0
    row = training_rows(run)[0]
    assert row["agents/failed"] == 10 and row["agents/refused_requests"] == 2
    errors = {r["prompt"][0]["content"]: r.get("agent_error") for r in completions_log(run)}
    assert errors["What is 0 + 1?"] is None
    assert errors["What is 1 + 1?"] == "raised RuntimeError: the agent broke"
    assert "this endpoint serves the model being trained, named 'grpokit'" in errors["What is 2 + 1?"]
    assert errors["What is 3 + 1?"].startswith("returned 'great': an agent returns its reward")
    assert errors["What is 4 + 1?"] == NO_REQUEST
    assert errors["What is 5 + 1?"] == ("did not return within rollout.agent_timeout=3 s of its own time (its requests' "
                                        "wait for generation not counted)")
    assert row["agent/tidy"] == 1.0 and row["agent/short"] == pytest.approx(-0.01)


def test_the_endpoint_keeps_an_idle_connection_longer_than_the_agents_client_pool_does(tiny):
    """uvicorn and httpx both keep an idle connection 5 s by default: a request sent on a pooled
    connection just as the server closes it fails, and in runs whose steps took about 5 s agents
    saw APIConnectionError (ReadError, BrokenResourceError). The client must always close first."""
    import openai

    from grpokit.rollouts.agents import _shared_http, _Waits
    from grpokit.rollouts.endpoint import Endpoint

    endpoint = Endpoint(tiny[1], [tiny[1].eos_token_id])
    try:
        client = _shared_http(openai, _Waits())
        pool_expiry = client._transport._pool._keepalive_expiry  # httpx's, 5 s under openai's defaults
        assert 0 < pool_expiry * 10 < endpoint.server.config.timeout_keep_alive
    finally:
        endpoint.close()


def test_a_request_whose_agent_gave_up_leaves_its_round_and_nothing_of_it_is_trained(tiny):
    """An agent whose client times out while its request waits for the round (the other rollout's
    agent is still working): the request leaves the waiting list, so the round that gathers after
    GATHER_S does not generate it for nobody, nothing of it is recorded, and the rollout's next
    request is taken (not refused as a second one pending)."""
    import threading
    import time

    import httpx

    from grpokit.models.loading import eos_token_ids
    from grpokit.rollouts.endpoint import GATHER_S, Endpoint

    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer))
    endpoint = Endpoint(tokenizer, [tokenizer.eos_token_id])
    params, running = SamplingParams(16, temperature=1.0), {0, 1}
    rounds = threading.Thread(target=endpoint.generate_rounds, args=(engine, params, [1, 2], lambda: set(running)))
    try:
        endpoint.open(2, params)
        rounds.start()
        body = {"model": "grpokit", "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(endpoint.base_url(0) + "/chat/completions", json=body, timeout=0.5)
        time.sleep(GATHER_S + 1)  # a request still waiting would have been generated by now
        assert endpoint.waiting == [] and endpoint.transcripts[0].exchanges == []
        assert not endpoint.transcripts[0].pending
        running.discard(1)  # rollout 1's agent returned: rollout 0's next request is generated at once
        answer = httpx.post(endpoint.base_url(0) + "/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200 and len(endpoint.transcripts[0].exchanges) == 1
    finally:
        running.clear()
        endpoint.notify()
        rounds.join(timeout=10)
        endpoint.close()


def test_agents_answered_from_a_cache_make_no_request_and_train_nothing_of_it(scripted, monkeypatch):
    """A framework's cache that leaves the base URL out of its key (DSPy's, by default) answers a
    second run's agents from the first run (its answers written here): each rollout fails, naming
    the fix, and nothing of the cached answers is trained."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", ["3"])
    (scripted / "cache.json").write_text(json.dumps({
        json.dumps([{"role": "user", "content": f"What is {i} + 1?"}]): "3" for i in range(6)}))
    assert main(["train", "--no-progress", *T, "train.max_steps=1", "rollout.engine=scripted",
                 f"data.path={scripted}/data.jsonl", "monitor.log_completions=1",
                 f"rollout.agent={scripted}/agents.py:cached", f"train.output_dir={scripted}/run"]) == 0
    row = training_rows(scripted / "run")[0]
    assert row["agents/failed"] == 4
    # No reward at all, though exact_answer would score their empty replies 0: NaN, not 0.0.
    assert row["reward"] == row["rewards/exact_answer/mean"] == "nan"
    assert {r["agent_error"] for r in completions_log(scripted / "run")} == {NO_REQUEST}
    assert "dspy.LM(..., cache=False)" in NO_REQUEST


@pytest.mark.parametrize("setting, message", [
    (["rollout.tools=[grpokit.tasks.calculator:calculator]"], "runs its own tools and loop"),
])
def test_agents_refuse_what_does_not_go_with_them(scripted, capsys, setting, message):
    assert main(["train", "--no-progress", *T, f"data.path={scripted}/data.jsonl",
                 f"rollout.agent={scripted}/agents.py:with_tools", *setting,
                 f"train.output_dir={scripted}/run"]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_openai_is_a_start_up_error_naming_the_extra(scripted, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "openai", None)
    assert main(["train", "--no-progress", *T, f"data.path={scripted}/data.jsonl",
                 f"rollout.agent={scripted}/agents.py:with_tools", f"train.output_dir={scripted}/run"]) == 2
    assert "pip install 'grpokit[agents]'" in capsys.readouterr().err


def test_micro_batches_never_change_an_agent_update(scripted, monkeypatch):
    """The recorded conversations train as any batch does: whole or one completion at a time, the same update."""
    monkeypatch.setattr(scripted_engine, "SCRIPT", [tool_call("add", a=1, b=2), "3"])
    common = [*T, "rollout.engine=scripted", f"data.path={scripted}/data.jsonl", "model.dtype=float64",
              f"rollout.agent={scripted}/agents.py:with_tools", "reward.functions=[length]", "train.learning_rate=1e-3"]
    for name, size in (("whole", 4), ("one", 1)):
        assert main(["train", "--no-progress", *common, f"train.micro_batch_size={size}",
                     f"train.output_dir={scripted}/{name}"]) == 0
    assert_close_metrics(untimed_metrics(scripted / "whole"), untimed_metrics(scripted / "one"))


def test_micro_batches_never_change_an_update_of_several_sequences_a_row(scripted):
    """Requests trained as sequences of their own (a template that rewrites history) train as any
    batch does: whole or one completion at a time, the same update (float64)."""
    (scripted / "rewriting.jinja").write_text(REWRITING_TEMPLATE)
    common = ["model.name=tiny-random", "model.dtype=float64", f"model.chat_template={scripted}/rewriting.jinja",
              f"rollout.agent={scripted}/agents.py:follow_up", "train.max_steps=1", "rollout.num_generations=2",
              "train.prompts_per_step=2", "rollout.max_completion_length=16", "data.eval_size=0",
              "train.learning_rate=1e-3"]
    for name, size in (("whole", 4), ("one", 1)):
        assert main(["train", "--no-progress", *common, f"train.micro_batch_size={size}",
                     f"train.output_dir={scripted}/{name}"]) == 0
    whole, one = untimed_metrics(scripted / "whole"), untimed_metrics(scripted / "one")
    assert [r["agents/new_sequences"] for r in whole] == [4] and whole[0]["grad_norm"] > 0
    assert_close_metrics(whole, one)



@pytest.mark.process
def test_a_killed_agent_run_resumes_as_the_uninterrupted_run(scripted):
    """SIGKILL mid-run, then the same command: the same metrics and weights as a run never interrupted."""
    from grpokit.rundir.folder import read_metrics

    args = ["model.name=tiny-random", f"rollout.agent={scripted}/agents.py:follow_up", "train.max_steps=6",
            "train.save_every=2", "train.prompts_per_step=2", "rollout.num_generations=3", "data.eval_size=0",
            "rollout.max_completion_length=40", "train.learning_rate=1e-3"]

    def launch(out):
        return grpokit("train", "--no-progress", *args, f"train.output_dir={out}",
                       env={**os.environ, "OMP_NUM_THREADS": "1"})

    reference = launch(scripted / "reference")
    assert reference.communicate(timeout=300) and reference.returncode == 0
    process = launch(scripted / "run")
    deadline = time.monotonic() + 300
    while len(training_rows(scripted / "run")) < 3 if (scripted / "run" / "metrics.jsonl").exists() else True:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert process.poll() is None
    process.kill()
    process.wait()
    resumed = launch(scripted / "run")
    said = "".join(resumed.communicate(timeout=300))
    assert resumed.returncode == 0 and "resuming from" in said, said[-2000:]

    def untimed(run):
        return [{k: v for k, v in r.items() if not measured(k)} for r in read_metrics(scripted / run / "metrics.jsonl")]

    assert untimed("run") == untimed("reference") and len(untimed("run")) == 6
    wa, wb = (load_file(scripted / run / "final" / "model.safetensors") for run in ("run", "reference"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.process
def test_two_processes_compute_the_one_process_agent_update(scripted):
    """Each process runs the agents of its own rows on its own endpoint: float64, the same update and metrics."""
    overrides = [f"rollout.agent={scripted}/agents.py:follow_up", "train.prompts_per_step=2",
                 "rollout.num_generations=2", "train.max_steps=2", "rollout.max_completion_length=30"]
    one, two = run_worker(scripted, "train", overrides)
    assert update_difference(one["start"], one["params"], two[0]["params"]) < 1e-9
    rows = [metric_rows(scripted / f"p{n}" / "run") for n in (1, 2)]
    assert len(rows[0]) == 2 and rows[0][0]["turns/mean"] == 2
    assert_close_metrics(*rows)


def test_a_textarena_game_is_played_by_its_own_agent(scripted, monkeypatch):
    """data.task=textarena:<env id>: the observation is the user turn, the reply the action, the
    game's new text the next user turn, its outcome the reward; 2 steps."""
    pytest.importorskip("textarena")
    from grpokit.tasks.textarena import TextArenaTask, _start

    monkeypatch.setattr(scripted_engine, "SCRIPT", ["My guess: [10]"])  # the same guess twice: an invalid move ends it
    run = scripted / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "rollout.engine=scripted",
                 "data.task=textarena:GuessTheNumber-v0", "data.task_args={max_turns: 5}", "train.max_steps=2",
                 "train.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=200",
                 "data.eval_size=0", "monitor.log_completions=1", f"train.output_dir={run}"]) == 0
    rows = training_rows(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["agents/failed"] == 0 for r in rows)
    task = TextArenaTask("GuessTheNumber-v0", {"max_turns": 5}, seed=0, eval_size=0)
    expected = []
    for i in range(4):  # the first 4 games (their prompts are alike: the number is hidden), played as the script plays
        env, _ = _start("GuessTheNumber-v0", {"max_turns": 5}, task.train_example(i).columns["game_seed"])
        done = False
        while not done:
            done, _ = env.step(action="My guess: [10]")
        expected.append(float(env.close()[0][0]))
    records = completions_log(run)
    assert [r["reward"] for r in records] == pytest.approx([r for r in expected for _ in range(2)])
    assert len(set(expected)) > 1  # the games differ
    for record in records:
        turns = record["completion"]
        assert turns[0] == {"role": "assistant", "content": "My guess: [10]"}
        if len(turns) > 1:  # a wrong first guess: the game's hint, then the same guess again
            assert turns[1]["role"] == "user" and "[GAME] The target number is" in turns[1]["content"]
            assert not turns[1]["content"].startswith("\n[GAME] You are Player 0")
    assert "rollout:\n" in (run / "config.yaml").read_text() and "agent: grpokit.tasks.textarena:play" in \
        (run / "config.yaml").read_text()


VERIFIERS_ENVS = '''
import verifiers as vf
from datasets import Dataset
''' + ADD_TOOL + '''

def correct(completion, answer, **kwargs) -> float:
    return 1.0 if answer in (completion[-1]["content"] or "") else 0.0


def brevity(completion, **kwargs) -> float:
    return -len(completion[-1]["content"] or "") / 100


def load_environment(n: int = 6, tools: bool = False):
    rows = Dataset.from_list([{"question": f"What is {i} + 1?", "answer": "3"} for i in range(n)])
    rubric = vf.Rubric(funcs=[correct, brevity], weights=[1.0, 0.5])
    if tools:
        return vf.ToolEnv(dataset=rows, tools=[add], max_turns=3, rubric=rubric, system_prompt="Use the tool.")
    return vf.SingleTurnEnv(dataset=rows, system_prompt="Answer with the number.", rubric=rubric)
'''


@pytest.mark.parametrize("tools", [False, True])
def test_a_verifiers_environment_runs_unchanged(scripted, monkeypatch, tools):
    """A SingleTurnEnv and a ToolEnv, built in the test: their dataset, system prompt, tools and
    rubric (its functions weighted as it weighs them, each logged) through the endpoint; 2 steps."""
    pytest.importorskip("verifiers")
    (scripted / "vf_envs.py").write_text(VERIFIERS_ENVS)
    monkeypatch.setattr(scripted_engine, "SCRIPT", [tool_call("add", a=2, b=1), "It is 3."] if tools else ["It is 3."])
    run = scripted / "run"
    assert main(["train", "--no-progress", "model.name=tiny-random", "rollout.engine=scripted",
                 f"rollout.environment=verifiers:{scripted}/vf_envs.py:load_environment",
                 f"data.task_args={{n: 8, tools: {str(tools).lower()}}}", "train.max_steps=2", "train.prompts_per_step=2",
                 "rollout.num_generations=2", "rollout.max_completion_length=300", "data.eval_size=2",
                 "monitor.log_completions=1", f"train.output_dir={run}"]) == 0
    rows = training_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agents/failed"] == 0 and r["agent/correct"] == 1.0 and r["agent/brevity"] == -0.08
        assert r["reward"] == pytest.approx(1.0 - 0.04) and r["turns/mean"] == (2 if tools else 1)
    record = completions_log(run)[0]
    assert record["prompt"][0] == {"role": "system", "content": "Use the tool." if tools else "Answer with the number."}
    if tools:
        assert rows[0]["agent/total_tool_calls"] == 1.0
        assert [m["role"] for m in record["completion"]] == ["assistant", "tool", "assistant"]
        assert record["completion"][1]["content"] == "3"
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/reward" in line]
    assert evals and all(e["eval/reward"] == pytest.approx(0.96) for e in evals)


def test_a_verifiers_environment_object_is_taken_by_grpokit_train(scripted, monkeypatch):
    pytest.importorskip("verifiers")
    import importlib.util

    import grpokit

    (scripted / "vf_envs.py").write_text(VERIFIERS_ENVS)
    spec = importlib.util.spec_from_file_location("vf_envs_object", scripted / "vf_envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(scripted_engine, "SCRIPT", ["3"])
    result = grpokit.train(environment=module.load_environment(n=6), progress=False,
                           **{"model.name": "tiny-random", "rollout.engine": "scripted", "train.max_steps": 1,
                              "train.prompts_per_step": 2, "rollout.num_generations": 2, "data.eval_size": 0,
                              "rollout.max_completion_length": 20, "train.output_dir": str(scripted / "api")})
    assert training_rows(scripted / "api")[0]["agent/correct"] == 1.0
    assert result is not None


def test_a_verifiers_environment_of_the_built_in_task_trains_as_the_built_in_task(tmp_path, monkeypatch):
    """examples/verifiers_arithmetic.py given the built-in task's prompts in the built-in task's
    order: the same engine calls, rewards and updates as the built-in arithmetic task, bit for bit.
    The model answers the step's questions right or wrong at even odds (support/trained_replies.py)."""
    pytest.importorskip("verifiers")
    from grpokit.tasks import verifiers as through_verifiers
    from grpokit.tasks.arithmetic import ArithmeticTask

    stream = ArithmeticTask(seed=0, eval_size=0)
    model = answerer(tmp_path / "model", [stream.train_example(i) for i in range(2)])
    common = ["train.max_steps=1", "data.eval_size=0", f"model.name={model}", "train.prompts_per_step=2",
              "rollout.num_generations=4"]
    assert main(["train", "--no-progress", *common, f"train.output_dir={tmp_path / 'built-in'}"]) == 0

    def in_stream_order(self, index):
        e = stream.train_example(index)
        return through_verifiers.Example(e.prompt, {"answer": str(e.columns["answer"]), "example_id": index,
                                                    "verifiers_task": self.name})

    monkeypatch.setattr(through_verifiers.VerifiersTask, "train_example", in_stream_order)
    example = Path(__file__).parents[2] / "examples" / "verifiers_arithmetic.py"
    assert main(["train", "--no-progress", *common, f"rollout.environment=verifiers:{example}:load_environment",
                 "data.task_args={train_size: 10}", f"train.output_dir={tmp_path / 'verifiers'}"]) == 0
    built_in, verifiers = untimed_metrics(tmp_path / "built-in"), untimed_metrics(tmp_path / "verifiers")
    for a, b in zip(built_in, verifiers):
        assert {k: a[k] for k in ("reward", "loss", "grad_norm", "entropy", "reward_std")} == \
            {k: b[k] for k in ("reward", "loss", "grad_norm", "entropy", "reward_std")}
    assert built_in[0]["reward_std"] > 0
    assert built_in[0]["grad_norm"] > 0  # an update, from rewards the two compute alike


def test_a_request_after_the_budget_is_spent_keeps_the_step_s_entropy(scripted):
    """follow_up's second request comes after rollout.max_completion_length is spent: it samples
    nothing (no entropies), and the step's entropy is still that of every token trained."""
    assert main(["train", "--no-progress", "model.name=tiny-random", f"rollout.agent={scripted}/agents.py:follow_up",
                 "train.max_steps=1", "rollout.num_generations=2", "train.prompts_per_step=2",
                 "rollout.max_completion_length=8", "data.eval_size=0", "reward.functions=[]",
                 f"data.path={scripted}/data.jsonl", f"train.output_dir={scripted}/run"]) == 0
    row = training_rows(scripted / "run")[0]
    assert row["completions/clipped_ratio"] == 1.0 and row["entropy"] > 0


def test_an_agent_s_record_holds_every_sequence_trained_from_it(scripted):
    """A template that rewrites history trains each request as a sequence of its own; the record's
    completion shows the last, and its `sequences` column every one, as trained."""
    (scripted / "rewriting.jinja").write_text(REWRITING_TEMPLATE)
    assert main(["train", "--no-progress", "model.name=tiny-random", f"model.chat_template={scripted}/rewriting.jinja",
                 f"rollout.agent={scripted}/agents.py:follow_up", "train.max_steps=1", "rollout.num_generations=2",
                 "train.prompts_per_step=2", "rollout.max_completion_length=16", "data.eval_size=0",
                 "reward.functions=[]", "monitor.log_completions=1", f"train.output_dir={scripted}/run"]) == 0
    records = completions_log(scripted / "run")
    assert len(records) == 4 and all(len(r["sequences"]) == 2 for r in records)
    assert all("Shorter?" not in r["sequences"][0] and "Shorter?" in r["sequences"][1] for r in records)
