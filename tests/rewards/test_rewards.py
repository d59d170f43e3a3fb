import math

from pathlib import Path

import pytest

from grpokit.rewards.exact_answer import exact_answer, leading_number, parse_integer_reply
from grpokit.rewards.reward_set import get_reward_function


def msg(text):
    return [{"role": "assistant", "content": text}]


def test_parse_integer_reply():
    assert parse_integer_reply(" 12 ") == 12
    assert parse_integer_reply("12.") == 12
    assert parse_integer_reply("-3") == -3
    for bad in ("", "12 apples", "The answer is 12.", "1 2", "12.5", "twelve"):
        assert parse_integer_reply(bad) is None


def test_exact_answer_needs_the_bare_number_and_an_ended_reply():
    completions = [msg("12"), msg("7 + 5 = 12"), msg("13"), "12\n", msg("12\n\n")]
    assert exact_answer(completions, [12] * 5, finish_reasons=["stop"] * 4 + ["length"]) == [1, 0, 0, 1, 0]
    assert exact_answer([msg("12")], [12]) == [1.0]  # no finish reasons: treated as ended


def test_leading_number_credits_a_reply_that_starts_with_the_answer():
    completions = [msg("12\n\nThe sum"), msg(" 12."), msg("Answer: 12."), msg("7 + 5 = 12"), msg("13 or 12"), msg("-3")]
    assert leading_number(completions, [12, 12, 12, 12, 12, -3]) == [1, 1, 0, 0, 0, 1]


def test_registry_names_unknown_functions():
    import pytest

    with pytest.raises(ValueError, match="exact_answer"):
        get_reward_function("accuracy")


def test_reward_functions_from_a_module_or_a_file(tmp_path, monkeypatch):
    import pytest

    from grpokit.runtime.errors import ConfigError

    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kw):\n    return [1.0 for _ in completions]\n")
    # As under the `grpokit` script: the working directory is not on sys.path, yet its modules count.
    import sys

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(Path.cwd()))])
    monkeypatch.chdir(tmp_path)
    assert get_reward_function("my_rewards:brevity")([msg("a")]) == [1.0]
    assert get_reward_function(f"{tmp_path}/my_rewards.py:brevity")([msg("a"), msg("b")]) == [1.0, 1.0]
    for name, problem in (
        (f"{tmp_path}/missing.py:f", "does not exist"),
        (f"{tmp_path}/my_rewards.py:nothing", "no function named 'nothing'"),
        ("no_such_module_xyz:f", "cannot import module"),
        ("accuracy", "built-in ones are"),
    ):
        with pytest.raises(ConfigError, match=problem):
            get_reward_function(name)


# ---------------------------------------------------------------- built-ins

from grpokit.rewards.length import length, overlong  # noqa: E402
from grpokit.rewards.math_answer import format_reward, math_accuracy  # noqa: E402
from grpokit.rewards.reward_set import REWARD_FUNCTIONS, RewardError, RewardSet
from grpokit.runtime.errors import ConfigError as ConfigError_
from grpokit.tasks.task import Example

MATH_CASES = [  # (completion, answer, expected)
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{42}", 42, 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("So we get 42", "42", 1.0),  # no box: the last number
    ("42 apples, then 43", "42", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("The total is 1,000", "1000", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("\\boxed{12,345}", "12345", 1.0),
    ("It drops to -3", "-3", 1.0),
    ("\\boxed{-3}", "3", 0.0),
    ("\\boxed{-\\frac{2}{3}}", "-2/3", 1.0),
    ("I do not know", "4", 0.0),
    ("", "4", 0.0),
    ("<think>2+2</think> \\boxed{4}", "4", 1.0),
    ("\\boxed{4} but wait \\boxed{5}", "5", 1.0),  # the last box counts
    ("\\boxed{(1,2]}", "(1,2]", 1.0),
    ("\\boxed{[1,2)}", "(1,2]", 0.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{\\{1,3\\}}", "\\{1,2\\}", 0.0),
    ("\\boxed{x=2}", "2", 1.0),
    ("\\boxed{2.0}", "2", 1.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{2\\pi}", "\\pi", 0.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("The result is 3.14", "3.14", 1.0),
    ("The result is 3.15", "3.14", 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math_accuracy(completion, answer, expected):
    assert math_accuracy([msg(completion)], [answer]) == [expected]
    assert math_accuracy([completion], [answer]) == [expected]  # plain (non-chat) completions too


def test_math_accuracy_without_a_usable_answer_is_not_applicable():
    assert math_accuracy([msg("\\boxed{3}")] * 3, [None, "", "$$"]) == [None, None, None]


def test_format_and_length():
    good = "<think>2 and 2 make 4</think>\nThe answer is \\boxed{4}."
    assert format_reward([msg(good), msg("\\boxed{4}"), msg("<think>x</think> 4")]) == [1.0, 0.0, 0.0]
    assert format_reward([msg("ANSWER: 4")], pattern=r"ANSWER: \d+") == [1.0]
    assert length([msg("x" * 20), msg("x" * 5), "x" * 31]) == [0.0, -15.0, -11.0]
    assert length([msg("x" * 5)], target=5) == [0.0]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """TRL's trl.rewards.get_soft_overlong_punishment, as TRL publishes it (TRL is not installed here)."""

    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        rewards = []
        for ids in completion_ids:
            completion_length = len(ids)
            if completion_length <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif max_completion_len - soft_punish_cache < completion_length <= max_completion_len:
                rewards.append((max_completion_len - soft_punish_cache - completion_length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment_reward


@pytest.mark.parametrize("max_length,cache", [(20, 4), (6, 2), (5, 5), (7, 1)])
def test_overlong_is_trls_soft_overlong_punishment(max_length, cache):
    lengths = [0, max_length - cache, max_length - cache + 1, max_length - 1, max_length, max_length + 1, 3 * max_length]
    ids = [[7] * n for n in lengths]
    got = overlong(ids, max_length=max_length, cache=cache)
    assert got == get_soft_overlong_punishment(max_length, cache)(ids)
    assert got[:2] == [0.0, 0.0] and got[4:] == [-1.0, -1.0, -1.0]
    assert got[2] == -1 / cache  # the first token over max_length - cache


def test_overlong_refuses_arguments_that_make_no_ramp():
    for max_length, cache, problem in ((8, 0, "cache=0 must be an integer >= 1"), (0, 1, "max_length=0 must be"),
                                       (4, 5, "cache=5 must be <= max_length=4"), (8, 2.5, "cache=2.5 must be an integer")):
        with pytest.raises(ValueError, match=problem):
            overlong([[1]], max_length=max_length, cache=cache)


def test_overlong_through_the_config_and_reward_set():
    """Configured as a run configures it: arguments bound from reward.functions, completion_ids as the
    trainer passes them (padding removed); without max_length or cache, an error before step 1."""
    from grpokit.config.loading import load_config
    from grpokit.settings.schema import reward_specs

    config = load_config(None, ["reward.functions=[{name: overlong, max_length: 6, cache: 2}]"])
    rewards = RewardSet(reward_specs(config, ()))
    rewards.check_arguments(["answer"])
    ids = [[1] * n for n in (4, 5, 6, 7)]
    total, per_function = rewards(examples(4), [msg("x")] * 4, ["stop"] * 3 + ["length"], completion_ids=ids)
    assert per_function["overlong"].tolist() == [0.0, -0.5, -1.0, -1.0] == total.tolist()
    with pytest.raises(ConfigError_, match=r"'overlong' needs 'cache', which .* \{name: overlong, cache: \.\.\.\}"):
        RewardSet((("overlong", 1.0, {"max_length": 6}),)).check_arguments(["answer"])
    with pytest.raises(RewardError, match="'overlong' raised ValueError: overlong: cache=0 must be"):
        RewardSet((("overlong", 1.0, {"max_length": 6, "cache": 0}),))(examples(1), [msg("x")], ["stop"], [[1]])


# ---------------------------------------------------------------- RewardSet

def examples(n, answer=4):
    return [Example(prompt=[{"role": "user", "content": f"q{i}"}], columns={"answer": answer}) for i in range(n)]


TRL_STYLE = '''
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]

def picky(prompts, completions, answer, **kwargs):
    out = []
    for p, c, a in zip(prompts, completions, answer):
        if "skip" in c[0]["content"]:
            out.append(None)
        else:
            out.append(1.0 if str(a) in c[0]["content"] else 0.0)
    return out

def broken(completions, **kwargs):
    return [1.0 / (len(c[0]["content"]) - 3) for c in completions]

def nan(completions, **kwargs):
    return [float("nan") if "x" in c[0]["content"] else 0.0 for c in completions]

def too_few(completions, **kwargs):
    return [0.0]
'''


def test_trl_style_functions_weights_and_none(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_STYLE)
    rewards = RewardSet(((f"{path}:reward_len", 0.5, {}), (f"{path}:picky", 2.0, {}), ("length", 1.0, {"target": 3})))
    assert rewards.names == ["trl_rewards.py:reward_len", "trl_rewards.py:picky", "length"]
    completions = [msg("4"), msg("five"), msg("skip 4")]
    total, per_function = rewards(examples(3), completions, ["stop"] * 3)
    assert per_function["trl_rewards.py:reward_len"].tolist() == [-19.0, -16.0, -14.0]
    assert per_function["trl_rewards.py:picky"][:2].tolist() == [1.0, 0.0]
    assert math.isnan(per_function["trl_rewards.py:picky"][2])  # None: not applicable
    assert per_function["length"].tolist() == [-2.0, -1.0, -3.0]
    # The weighted sum of the functions that applied.
    assert total.tolist() == [0.5 * -19 + 2 * 1 - 2, 0.5 * -16 + 2 * 0 - 1, 0.5 * -14 - 3]


def test_all_none_gives_a_nan_total(tmp_path):
    (tmp_path / "r.py").write_text(TRL_STYLE)
    total, _ = RewardSet(((f"{tmp_path}/r.py:picky", 1.0, {}),))(examples(2), [msg("skip"), msg("4")], ["stop"] * 2)
    assert math.isnan(total[0]) and total[1] == 1.0


@pytest.mark.parametrize("function,message", [
    ("broken", r"'r.py:broken' raised ZeroDivisionError.*\n  on completion 1: 'abc'\n  of prompt: .*q1"),
    ("nan", r"'r.py:nan' returned nan for completion 2: 'xyz'"),
    ("too_few", r"'r.py:too_few' returned 1 values for 3 completions"),
])
def test_failing_functions_are_named_with_the_completion(tmp_path, function, message):
    (tmp_path / "r.py").write_text(TRL_STYLE)
    rewards = RewardSet(((f"{tmp_path}/r.py:{function}", 1.0, {}),))
    with pytest.raises(RewardError, match=message):
        rewards(examples(3), [msg("four"), msg("abc"), msg("xyz")], ["stop"] * 3)


def test_async_functions_run_concurrently(tmp_path):
    (tmp_path / "slow.py").write_text(
        "import asyncio\n"
        "async def slow_a(completions, **kw):\n    await asyncio.sleep(0.5)\n    return [1.0] * len(completions)\n"
        "async def slow_b(completions, **kw):\n    await asyncio.sleep(0.5)\n    return [2.0] * len(completions)\n"
    )
    import time

    rewards = RewardSet(((f"{tmp_path}/slow.py:slow_a", 1.0, {}), (f"{tmp_path}/slow.py:slow_b", 1.0, {})))
    start = time.perf_counter()
    total, _ = rewards(examples(2), [msg("a"), msg("b")], ["stop"] * 2)
    assert time.perf_counter() - start < 0.9  # together, not one after the other
    assert total.tolist() == [3.0, 3.0]


def test_builtins_are_registered():
    for name in ("math_accuracy", "format", "length", "overlong", "reward_model", "exact_answer", "leading_number"):
        assert callable(get_reward_function(name)), name
    assert get_reward_function("format").__name__ == "format_reward"


def test_a_registered_function_is_named_like_a_builtin(monkeypatch):
    mine = lambda completions, **columns: [1.0] * len(completions)  # noqa: E731
    monkeypatch.setitem(REWARD_FUNCTIONS, "mine", mine)
    assert get_reward_function("mine") is mine
    with pytest.raises(ConfigError_, match="built-in ones are .*leading_number.*mine"):
        get_reward_function("yours")


def test_reward_model_scores_prompt_and_completion(tmp_path, tiny):
    """A local sequence-classification folder: its first logit, conversation through its chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    _, tokenizer = tiny
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = [[{"role": "user", "content": "Say hi"}]] * 2
    completions = [msg("hi"), msg("a much longer answer than that")]
    got = get_reward_function("reward_model")(prompts, completions, path=str(tmp_path / "rm"))
    for p, c, score in zip(prompts, completions, got):  # one at a time, no padding: the same scores
        text = tokenizer.apply_chat_template(p + c, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        assert abs(model(**ids).logits[0, 0].item() - score) < 1e-4
    assert got[0] != got[1]
    rewards = RewardSet((("reward_model", 1.0, {"path": str(tmp_path / "nowhere")}),))
    with pytest.raises(RewardError, match="'reward_model' raised FileNotFoundError.*nowhere"):
        rewards(examples(1), [msg("hi")], ["stop"])


def test_async_state_survives_between_calls_and_trl_return_types(tmp_path):
    """One event loop for the whole run: a semaphore made at import still works on the next step."""
    (tmp_path / "a.py").write_text(
        "import asyncio\nimport numpy as np\nlimit = asyncio.Semaphore(2)\n"
        "async def guarded(completions, **kw):\n"
        "    async with limit:\n        await asyncio.sleep(0.01)\n    return np.array([1.0] * len(completions))\n"
        "def numpyish(completions, completion_ids, **kw):\n"
        "    return [np.float32(len(ids)) for ids in completion_ids]\n"
    )
    rewards = RewardSet(((f"{tmp_path}/a.py:guarded", 1.0, {}), (f"{tmp_path}/a.py:numpyish", 1.0, {})))
    for _ in range(2):
        total, _ = rewards(examples(2), [msg("a"), msg("b")], ["stop"] * 2, completion_ids=[[1, 2], [3]])
        assert total.tolist() == [3.0, 2.0]


def test_configured_arguments_are_checked_and_win_over_columns():
    with pytest.raises(ConfigError_, match="'length' has no argument 'traget'"):
        RewardSet((("length", 1.0, {"traget": 5}),))
    rewards = RewardSet((("length", 1.0, {"target": 1}),))
    batch = [Example(prompt="q", columns={"target": 99})]
    total, _ = rewards(batch, ["abc"], ["stop"])
    assert total.tolist() == [-2.0]  # the configured target, not the column
