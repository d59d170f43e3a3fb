from pathlib import Path

from grpokit.rewards import get_reward_function
from grpokit.rewards.exact_answer import exact_answer, final_number, parse_integer_reply


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


def test_final_number_gives_credit_for_a_right_answer_in_words():
    completions = [msg("7 + 5 = 12"), msg("The answer is 12."), msg("12 or 13"), msg("no idea")]
    assert final_number(completions, [12] * 4) == [1, 1, 0, 0]


def test_registry_names_unknown_functions():
    import pytest

    with pytest.raises(ValueError, match="exact_answer"):
        get_reward_function("accuracy")


def test_reward_functions_from_a_module_or_a_file(tmp_path, monkeypatch):
    import pytest

    from grpokit.config import ConfigError

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
