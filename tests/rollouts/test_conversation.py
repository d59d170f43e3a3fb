"""Multi-turn rollouts: tools and environments (rollouts/conversation.py, rollouts/tools.py).

The loss over a conversation is checked in float64 against a naive loop; the rollouts themselves
run on tiny-random with a scripted engine (tests/support/scripted_engine.py), since random weights never
write a tool call."""

import json
import math

import pytest
import torch
from support.exact import rmsnorm_in_input_dtype
from support.conversations import ADD_TOOL, tool_call
from support.runs import training_rows
from transformers.models.llama import modeling_llama

from support import scripted_engine
from grpokit.algorithm.loss import LossInputs, LossSettings, compute_loss
from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.engines.batch import SamplingParams
from grpokit.engines.prompts import PromptEncoder
from grpokit.engines.protocols import ENGINES
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.models.logprobs import completion_logprobs
from grpokit.models.templates import TOOLS_TEMPLATE, speaks_tools, use_chat_template
from grpokit.rollouts.conversation import MultiTurn
from grpokit.rollouts.tool_formats import hermes
from grpokit.rollouts.tools import Tools
from grpokit.rundir.report import report
from grpokit.runtime.errors import ConfigError
from grpokit.tasks.calculator import calculator
from grpokit.tasks.task import Example

TOOLS_PY = '''
import time
''' + ADD_TOOL + '''
def boom(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the boom tool broke")

def hang(x: str) -> str:
    """Never returns in time.

    Args:
        x: Anything.
    """
    time.sleep(30)
    return "late"

async def double(n: int) -> int:
    """Double a number.

    Args:
        n: The number.
    """
    return 2 * n

def undocumented(x):
    return x

def starred(*args: int) -> int:
    """Sum numbers.

    Args:
        args: The numbers.
    """
    return sum(args)

def leave(code: int) -> str:
    """Exit the process.

    Args:
        code: The exit status.
    """
    import sys
    sys.exit(code)

def interrupt(x: str) -> str:
    """Raise KeyboardInterrupt.

    Args:
        x: Anything.
    """
    raise KeyboardInterrupt

async def leave_later(code: int) -> str:
    """Exit the process, from a coroutine.

    Args:
        code: The exit status.
    """
    import sys
    sys.exit(code)

async def leave_inside(code: int) -> str:
    """Exit the process, from a task the tool starts itself.

    Args:
        code: The exit status.
    """
    import asyncio
    return (await asyncio.gather(leave_later(code)))[0]

def verbose(x: str) -> str:
    """A result longer than any budget.

    Args:
        x: Anything.
    """
    return "word " * 1000

class Counter:
    """A TRL-shaped environment: reset(**row), tools as methods, get_reward()."""

    def reset(self, prompt, answer, **row):
        self.presses, self.answer = 0, answer
        return " (you may press the button)"

    def press(self, times: int) -> str:
        """Press the button.

        Args:
            times: How many times.
        """
        self.presses += times
        return f"pressed {self.presses} times"

    def get_reward(self) -> float:
        return float(self.presses)

    def _private(self):
        pass

class BrokenReset(Counter):
    def reset(self, **row):
        raise KeyError("no such level")

class BrokenInit(Counter):
    def __init__(self):
        raise OSError("no display")
'''

# A tiny run on the scripted engine.
T = ["model.name=tiny-random", "rollout.engine=scripted", "train.max_steps=2", "rollout.num_generations=2",
     "train.prompts_per_step=2", "rollout.max_completion_length=400", "data.eval_size=0",
     "reward.functions=[exact_answer]", "rollout.tool_timeout=0.5"]


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """Register the scripted engine, write the tools file and a dataset; return the tools file."""
    monkeypatch.setitem(ENGINES, "scripted", "support.scripted_engine:ScriptedEngine")
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": "3"}) + "\n"
        for i in range(4)))
    return tmp_path


def script(monkeypatch, *replies):
    monkeypatch.setattr(scripted_engine, "SCRIPT", list(replies))


# ---------------------------------------------------------------- the loss over model tokens only


def two_turn_rollout(tokenizer):
    """Two completions of one prompt: model turn, tool result (untrained), model turn."""
    prompt = tokenizer("<|im_start|>user\nWhat is 2 + 1?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    pieces = [('<tool_call>{"name": "add"}</tool_call><|im_end|>', 1),
              ("\n<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
              ("3<|im_end|>", 1)]
    ids, trained = [], []
    for text, is_model in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        trained += [is_model] * len(piece)
    other = ids[:3] + [ids[4], ids[3]] + ids[5:]  # a second completion: two model tokens swapped
    completions = torch.tensor([ids, other])  # (2, T)
    return torch.tensor(prompt), completions, torch.tensor([trained, trained])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_tool_tokens_get_no_gradient_and_the_loss_is_the_model_tokens_loss(monkeypatch, loss_type):
    """GRPO's loss (on-policy ratio, k3 KL) over a two-turn rollout, against a naive float64 loop
    that runs every model token's prefix separately and counts model tokens only. (The other
    objectives share the masking; tests/algorithm/test_loss_variants.py checks them token by token.)"""
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)
    tokenizer = load_tokenizer("tiny-random")
    policy, reference = load_model("tiny-random", "float64"), load_model("tiny-random", "float64")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prompt, completions, trained = two_turn_rollout(tokenizer)
    B, T = completions.shape
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    beta, length = 0.04, 40

    def logprobs(model):
        return completion_logprobs(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long), completions,
                                   torch.zeros(B, dtype=torch.long), 1.0)

    logps = logprobs(policy)  # (B, T)
    logps.retain_grad()
    with torch.no_grad():
        ref = logprobs(reference)
    out = compute_loss(loss_type, LossInputs(logps=logps, mask=trained, advantages=advantages, old_logps=None,
                                             ref_logps=ref, sampling_logps=None, num_sequences=B,
                                             num_tokens=float(trained.sum()), max_completion_length=length),
                       LossSettings(beta=beta, epsilon=0.2, epsilon_high=None, kl_estimator="k3", is_cap=2.0))
    out.loss.backward()
    assert (logps.grad[trained == 0] == 0).all() and (logps.grad[trained == 1] != 0).all()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}

    policy.zero_grad()
    terms = []  # (sequence, per-token term) for every model token
    for b in range(B):
        for t in range(T):
            if not trained[b, t]:
                continue
            context = torch.cat([prompt, completions[b, :t]])[None]
            lp = torch.log_softmax(policy(context, logits_to_keep=1).logits[0, -1], -1)[completions[b, t]]
            with torch.no_grad():
                ref_lp = torch.log_softmax(reference(context, logits_to_keep=1).logits[0, -1], -1)[completions[b, t]]
            ratio = torch.exp(lp - lp.detach())
            kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
            terms.append((b, -advantages[b] * ratio + beta * kl))
    per_seq = [[term for s, term in terms if s == b] for b in range(B)]
    if loss_type == "grpo":
        naive = sum(sum(ts) / len(ts) for ts in per_seq) / B
    elif loss_type == "dapo":
        naive = sum(term for _, term in terms) / len(terms)
    else:  # dr_grpo
        naive = sum(term for _, term in terms) / (B * length)
    naive.backward()
    assert out.loss.item() == pytest.approx(naive.item(), rel=1e-10, abs=1e-12)
    for name, p in policy.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=1e-8, atol=1e-12), name


# ---------------------------------------------------------------- rollouts


def multi_turn(tmp_path, *extra):
    config = load_config(None, [f"rollout.tools=[{tmp_path}/tools.py:add]", *extra])
    tokenizer = load_tokenizer("tiny-random")
    tools = Tools.from_config(config.rollout, config.data, config.model, tokenizer)
    engine = scripted_engine.ScriptedEngine(tokenizer, tokenizer.eos_token_id)
    encoder = PromptEncoder(tokenizer, tools.schemas, config.data.max_prompt_length)
    return MultiTurn(tokenizer, tools, config.rollout.max_turns, [tokenizer.eos_token_id], encoder), engine, tokenizer


EXAMPLE = Example([{"role": "user", "content": "What is 1 + 2?"}], {"answer": "3"})


def test_model_tokens_are_kept_exactly_as_sampled(scripted, monkeypatch):
    """A model turn of ids that decode-then-encode would change (one character per token) is
    trained on those very ids; the tool result between the turns is context, not trained."""
    sampler, engine, tokenizer = multi_turn(scripted)
    text = tool_call("add", a=1, b=2)
    odd = [tokenizer(ch, add_special_tokens=False)["input_ids"][0] for ch in text]  # one token per character
    assert tokenizer.decode(odd) == text and tokenizer(text, add_special_tokens=False)["input_ids"] != odd
    script(monkeypatch, odd, "3")
    batch = sampler.generate(engine, [EXAMPLE], [2], SamplingParams(200, 1.0), [5, 6])
    eos = tokenizer.eos_token_id
    for i in range(2):
        trained = batch.completion_ids[i][batch.trained_mask[i].bool()].tolist()
        assert trained == odd + [eos] + tokenizer("3", add_special_tokens=False)["input_ids"] + [eos]
        context = batch.completion_ids[i][batch.completion_mask[i].bool()]
        tool = context[(batch.trained_mask[i] == 0)[: len(context)]]
        assert tokenizer.decode(tool) == "\n<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # The second turn saw the first turn's ids as sampled, then the tool result.
    assert engine.calls[1][0][-len(odd) - 1 - len(tool):][: len(odd)] == odd
    c = batch.conversations[0]
    assert (c.turns, c.calls, c.failures, c.stop) == (2, 1, 0, "answer")
    assert c.messages == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    assert batch.finish_reasons == ["stop", "stop"]


def test_max_turns_and_the_token_budget_end_a_conversation(scripted, monkeypatch):
    script(monkeypatch, tool_call("add", a=1, b=2))  # calls the tool every turn
    sampler, engine, _ = multi_turn(scripted, "rollout.max_turns=3")
    batch = sampler.generate(engine, [EXAMPLE], [1], SamplingParams(1000, 1.0), [1])
    c = batch.conversations[0]
    assert (c.turns, c.calls, c.stop, batch.finish_reasons[0]) == (3, 2, "max_turns", "stop")  # the last turn's call is not run
    # A budget that the first tool result does not fit into: the rollout ends there, "length".
    first_turn = int(batch.trained_mask[0].tolist().index(0))
    batch = sampler.generate(engine, [EXAMPLE], [1], SamplingParams(first_turn + 5, 1.0), [1])
    c = batch.conversations[0]
    assert (c.turns, c.calls, c.stop, batch.finish_reasons[0]) == (1, 1, "length", "length")
    assert batch.completion_mask.sum() == batch.trained_mask.sum() == first_turn
    # A model turn cut by the budget.
    batch = sampler.generate(engine, [EXAMPLE], [1], SamplingParams(4, 1.0), [1])
    assert (batch.conversations[0].stop, batch.finish_reasons[0], batch.trained_mask.sum().item()) == ("length", "length", 4)


def test_calls_are_parsed_in_the_hermes_format():
    content, calls, problems = hermes("Let me add. " + tool_call("add", a=1, b=2) + '<tool_call>{"name": 3}</tool_call>'
                                      + "<tool_call>{nope}</tool_call><tool_call>")
    assert content == "Let me add. <tool_call>"  # an unclosed call stays text
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert len(problems) == 3
    assert problems[0].startswith('error: a tool call is {"name": <tool name>, "arguments": {<argument>')
    assert problems[1].startswith("error: the tool call is not valid JSON (Expecting")
    assert problems[2] == "error: a <tool_call> without its </tool_call>"
    assert hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][0].arguments == {"x": 1}


def test_a_run_with_tools_counts_every_failure_and_finishes(scripted, monkeypatch, capsys):
    """A raising tool, a hanging one, an unknown one, wrong arguments and a malformed call each
    answer the model with their error, are counted, and the run goes on to the end."""
    script(monkeypatch, " ".join([tool_call("add", a=1, b=2), tool_call("boom", x="1"), tool_call("hang", x="1"),
                                  tool_call("nope"), tool_call("add", c=1), tool_call("double", n=4),
                                  "<tool_call>{bad json</tool_call>"]), "3")
    tools = ",".join(f"{scripted}/tools.py:{n}" for n in ("add", "boom", "hang", "double"))
    run = scripted / "run"
    assert main(["train", "--no-progress", *T, f"data.path={scripted}/data.jsonl", f"rollout.tools=[{tools}]",
                 "monitor.log_completions=1", f"train.output_dir={run}"]) == 0
    rows = training_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tools/calls_per_rollout"] == 7 and r["tools/failures_per_rollout"] == 5
        assert r["tools/failures"] == 5 * 4 and r["turns/mean"] == 2 and r["reward"] == 1.0
    sample = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    results = [m["content"] for m in sample["completion"] if m["role"] == "tool"]
    assert results[0] == "3" and results[5] == "8"
    assert results[1] == "error: RuntimeError: the boom tool broke"
    assert results[2] == "error: tool 'hang' did not return within 0.5 s"
    assert results[3].startswith("error: there is no tool named 'nope'; the tools are: add, boom, hang, double")
    assert results[4].startswith("error: TypeError:") and "'c'" in results[4]
    assert results[6].startswith("error: the tool call is not valid JSON")
    assert sample["completion"][-1] == {"role": "assistant", "content": "3"}
    # The report shows whole conversations, calls and results set apart from the model's text.
    page = report(run).read_text()
    assert '<div class="call">&rarr; add({&quot;a&quot;: 1, &quot;b&quot;: 2})</div>' in page
    assert '<div class="tool">&larr; add: 3</div>' in page
    # grpokit eval scores the conversations the same way, and writes them out.
    (scripted / "run" / "config.yaml").write_text((run / "config.yaml").read_text().replace("eval_size: 0", "eval_size: 2"))
    out = scripted / "eval.jsonl"
    assert main(["eval", "--model", str(run / "final"), "--config", str(run / "config.yaml"), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward"] for r in records] == [1.0, 1.0]
    assert records[0]["completion"][-1] == {"role": "assistant", "content": "3"}


def test_a_trl_environment_runs_unchanged(scripted, monkeypatch):
    """reset(**row)'s text goes on the prompt, the public methods are the tools, get_reward() is a
    reward named after the class, and reward functions receive the instances."""
    seen = []

    def sees_environments(completions, environments, **kwargs):
        seen.append([e.presses for e in environments])
        return [0.0] * len(completions)

    monkeypatch.setitem(__import__("grpokit.rewards", fromlist=["x"]).REWARD_FUNCTIONS, "sees", sees_environments)
    script(monkeypatch, tool_call("press", times=2), tool_call("press", times=1), "3")
    run = scripted / "run"
    assert main(["train", "--no-progress", *T, f"data.path={scripted}/data.jsonl", "reward.functions=[exact_answer,sees]",
                 f"rollout.environment={scripted}/tools.py:Counter", "monitor.log_completions=1",
                 f"train.output_dir={run}"]) == 0
    rows = training_rows(run)
    assert rows[0]["rewards/Counter/mean"] == 3.0 and rows[0]["reward"] == 4.0  # 3 presses + the right answer
    assert seen == [[3] * 4, [3] * 4]
    sample = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    # The prompt as the model saw it (and reward functions get it, as TRL passes it): reset's text appended.
    assert sample["prompt"][-1]["content"].endswith("? (you may press the button)")
    assert [m["content"] for m in sample["completion"] if m["role"] == "tool"] == ["pressed 2 times", "pressed 3 times"]
    # The model saw reset's text and the tool's schema.
    config = load_config(run / "config.yaml", [])
    tokenizer = load_tokenizer(str(run / "final"))
    assert speaks_tools(tokenizer)  # saved with the template that expresses tools
    assert config.rollout.environment.endswith("tools.py:Counter")


@pytest.mark.parametrize("setting,message", [
    ("rollout.environment={d}/tools.py:BrokenInit", "environment 'BrokenInit': its constructor raised OSError: no "
     "display (rollout.environment)"),
    ("rollout.environment={d}/tools.py:BrokenReset", "environment 'BrokenReset': reset() raised KeyError: 'no such level' "
     "(on the first training prompt)"),
    ("rollout.tools=[{d}/tools.py:undocumented]", "tool '{d}/tools.py:undocumented' (rollout.tools): "),
    ("rollout.tools=[{d}/nowhere.py:add]", "tool '{d}/nowhere.py:add' (rollout.tools): file {d}/nowhere.py does not exist"),
    ("rollout.tools=[{d}/tools.py:missing]", "tool '{d}/tools.py:missing' (rollout.tools): {d}/tools.py has no function named 'missing'"),
    # It was advertised as `args: integer`, and every call failed.
    ("rollout.tools=[{d}/tools.py:starred]", "tool '{d}/tools.py:starred' (rollout.tools): takes *args, which a tool "
     "call cannot fill"),
    ("model.chat_template={d}/plain.jinja", "the template in {d}/plain.jinja cannot express tools"),
])
def test_tools_that_cannot_be_used_are_refused_at_start(scripted, capsys, setting, message):
    (scripted / "plain.jinja").write_text(load_tokenizer("tiny-random").chat_template)
    extra = [] if "rollout.tools" in setting or "environment" in setting else [f"rollout.tools=[{scripted}/tools.py:add]"]
    code = main(["train", *T, f"data.path={scripted}/data.jsonl", setting.format(d=scripted), *extra,
                 f"train.output_dir={scripted / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert message.format(d=scripted) in err
    assert not (scripted / "run").exists()


def test_a_model_whose_template_cannot_express_tools_names_model_chat_template():
    tokenizer = load_tokenizer("tiny-random")
    use_chat_template(tokenizer, None, "tiny-random", tools=False)
    assert not speaks_tools(tokenizer)  # SmolLM2's own template
    with pytest.raises(ConfigError, match="some/model's chat template cannot express tools.*set model.chat_template"):
        use_chat_template(tokenizer, None, "some/model", tools=True)
    use_chat_template(tokenizer, str(TOOLS_TEMPLATE), "some/model", tools=True)
    assert speaks_tools(tokenizer)


def test_an_environment_that_fails_mid_run_stops_and_saves_the_step_before(scripted, monkeypatch, capsys):
    (scripted / "env.py").write_text(TOOLS_PY + '''
class FailsLater(Counter):
    resets = 0

    def reset(self, **row):
        FailsLater.resets += 1
        if FailsLater.resets > 5:  # the start-up check, then step 1's four rollouts
            raise ValueError("the level file is gone")
        return super().reset(**row)
''')
    script(monkeypatch, "3")
    run = scripted / "run"
    code = main(["train", "--no-progress", *T, "train.max_steps=3", f"data.path={scripted}/data.jsonl",
                 f"rollout.environment={scripted}/env.py:FailsLater", f"train.output_dir={run}"])
    err = capsys.readouterr().err
    assert code == 1
    assert "grpokit: the run stopped: environment 'FailsLater': reset() raised ValueError: the level file is gone" in err
    assert "from step-1 with: grpokit train --config" in err
    assert (run / "checkpoints" / "step-1").is_dir()


def test_the_calculator_tool():
    assert calculator("347 * 58") == "20126"
    assert calculator("(1 + 2) / 4") == "0.75"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")
    assert math.isclose(float(calculator("2 x 3")), 6)


@pytest.mark.parametrize("tool, reply, said", [
    ("leave", tool_call("leave", code=3),
     "tool 'leave' called sys.exit(3), which would have ended the process with nothing saved"),
    ("interrupt", tool_call("interrupt", x="1"), "KeyboardInterrupt, raised by it, stopped tool 'interrupt'"),
    ("leave_later", tool_call("leave_later", code=0), "tool 'leave_later' called sys.exit(0)"),
    # asyncio lets the exit out of the event loop: the loop's thread goes on, the tool gets it.
    ("leave_inside", tool_call("leave_inside", code=0), "tool 'leave_inside' called sys.exit(0)"),
])
def test_a_tool_that_exits_stops_the_run_named_and_saved(scripted, monkeypatch, capsys, tool, reply, said):
    """A tool calling sys.exit() ended `grpokit train` with that status and nothing saved (an async one
    killed the event loop's thread: the call never returned); KeyboardInterrupt gave a traceback."""
    (scripted / "once.py").write_text(TOOLS_PY + """
calls = []

def gate(x: str) -> str:
    \"\"\"Pass the calls of steps 1 and 2 (four rollouts each), then hand over to the tool under test.

    Args:
        x: Anything.
    \"\"\"
    calls.append(1)
    return "go" if len(calls) <= 8 else "now"
""")
    # Each rollout calls gate, then, when gate answered "now" (step 3), the tool under test.
    monkeypatch.setattr(scripted_engine, "SCRIPT", [tool_call("gate", x="1"), "3"])
    real = scripted_engine.ScriptedEngine.generate

    def generate(self, prompts, n, params, seeds=None):
        if any("now" in self.tokenizer.decode(p) for p in prompts):
            monkeypatch.setattr(scripted_engine, "SCRIPT", [tool_call("gate", x="1"), reply, "3"])
        return real(self, prompts, n, params, seeds)

    monkeypatch.setattr(scripted_engine.ScriptedEngine, "generate", generate)
    run = scripted / "run"
    code = main(["train", "--no-progress", *T, "train.max_steps=3", f"data.path={scripted}/data.jsonl",
                 f"rollout.tools=[{scripted}/once.py:gate,{scripted}/once.py:{tool}]", f"train.output_dir={run}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "grpokit: the run stopped: " in err and said in err
    assert "once the cause is fixed, resume from step-2 with: grpokit train --config" in err
    assert (run / "checkpoints" / "step-2").is_dir()


def test_a_tool_result_over_the_budget_is_counted_and_recorded_cut(scripted, monkeypatch):
    """It ended the rollout with no failure counted and no trace of the result."""
    script(monkeypatch, tool_call("verbose", x="1"), "3")
    run = scripted / "run"
    assert main(["train", "--no-progress", *T, "train.max_steps=1", f"data.path={scripted}/data.jsonl",
                 f"rollout.tools=[{scripted}/tools.py:verbose]", "monitor.log_completions=1",
                 f"train.output_dir={run}"]) == 0
    row = training_rows(run)[0]
    assert row["tools/failures_per_rollout"] == 1 and row["completions/clipped_ratio"] == 1
    sample = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    tool = sample["completion"][-1]
    assert tool["role"] == "tool" and tool["truncated"] is True and sample["finish_reason"] == "length"
    assert tool["content"].startswith("word word") and 100 < len(tool["content"].split()) < 1000


OPENENV_PY = '''
import os

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class PressAction(Action):
    times: int


class CounterObservation(Observation):
    presses: int = 0


class CounterEnvironment(Environment):
    """An OpenEnv environment: served by OpenEnv's own server, reached by its own client."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance: one per rollout

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state, self.presses = State(), 0
        return CounterObservation(presses=0, reward=0.0, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self.presses += action.times
        return CounterObservation(presses=self.presses, reward=float(self.presses), done=False)

    @property
    def state(self):
        return self._state


class Counter:
    """TRL's environment_factory shape on the OpenEnv server at OPENENV_URL, as TRL's OpenEnv examples write it."""

    def reset(self, **row):
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=os.environ["OPENENV_URL"]).sync()
        self.reward = 0.0
        return f" (pressed {self.client.reset().observation['presses']} times so far)"

    def press(self, times: int) -> str:
        """Press the button.

        Args:
            times: How many times.
        """
        result = self.client.step({"times": times})
        self.reward = result.reward
        return f"pressed {result.observation['presses']} times"

    def get_reward(self) -> float:
        return float(self.reward)
'''


def test_an_openenv_environment_on_127_0_0_1_runs_as_an_environment_factory(scripted, monkeypatch):
    """An OpenEnv environment served by OpenEnv's server on 127.0.0.1 (no mock), reached through
    OpenEnv's client from a TRL environment_factory class: its observations are the tool results,
    its reward the get_reward() reward."""
    pytest.importorskip("openenv.core")
    import importlib.util
    import socket
    import threading
    import time

    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    (scripted / "openenv_counter.py").write_text(OPENENV_PY)
    spec = importlib.util.spec_from_file_location("openenv_counter", scripted / "openenv_counter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = create_fastapi_app(module.CounterEnvironment, module.PressAction, module.CounterObservation,
                             max_concurrent_envs=32)  # one session per rollout (and one at start-up)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        monkeypatch.setenv("OPENENV_URL", f"http://127.0.0.1:{sock.getsockname()[1]}")
        script(monkeypatch, tool_call("press", times=3), "3")
        run = scripted / "run"
        assert main(["train", "--no-progress", *T, f"data.path={scripted}/data.jsonl",
                     f"rollout.environment={scripted}/openenv_counter.py:Counter", "monitor.log_completions=1",
                     f"train.output_dir={run}"]) == 0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    rows = training_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rewards/Counter/mean"] == 3.0 and r["tools/failures"] == 0 for r in rows)
    sample = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][-1]["content"].endswith(" (pressed 0 times so far)")
    assert [m["content"] for m in sample["completion"] if m["role"] == "tool"] == ["pressed 3 times"]


def test_a_tool_called_off_the_main_thread_still_times_out(scripted):
    """Generating ahead (rollout.max_staleness), conversations run in the pipeline's worker thread,
    where no signal ends a call: a tool that hangs is given up on after rollout.tool_timeout all the
    same, and a tool's own TimeoutError is its error, not the limit's."""
    import threading
    import time

    from grpokit.rollouts.tools import ToolCall, Tools

    doc = '    """A tool.\n\n    Args:\n        x: Anything.\n    """\n'
    (scripted / "slow.py").write_text(
        "import asyncio, time\n"
        f"def hang(x: str) -> str:\n{doc}    time.sleep(30)\n"
        f"async def ahang(x: str) -> str:\n{doc}    await asyncio.sleep(30)\n"
        f"def late(x: str) -> str:\n{doc}    raise TimeoutError('its own')\n")
    tools = Tools([f"{scripted}/slow.py:{n}" for n in ("hang", "ahang", "late")], None, 0.3)
    results = {}

    def worker():
        for name in ("hang", "ahang", "late"):
            results[name] = tools.call(tools.callables(None), ToolCall(name, {"x": "?"}))

    thread = threading.Thread(target=worker)
    start = time.monotonic()
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert results["hang"].text == "error: tool 'hang' did not return within 0.3 s"
    assert results["ahang"].text == "error: tool 'ahang' did not return within 0.3 s"
    assert results["late"].text == "error: TimeoutError: its own"
