"""Bad training data gets a clear answer: one `grpokit:` line naming the culprit (the file, its
line, the column or message) and what to do, the right exit status, and nothing trained on rows
misread. Each case here was once answered with a traceback, a wrong hint, or silence."""

import json

import pytest
from support.bad_input import T, run

from grpokit.cli import main
from grpokit.tasks.dataset import read_rows
from grpokit.tasks.task import DataError


def test_a_chat_role_no_template_knows_is_refused_with_its_line(capsys, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
            {"prompt": [{"role": "wizard", "content": "What is 3 + 3?"}], "answer": "6"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = run(capsys, "train", *T, f"data.path={path}", "reward.functions=[exact_answer]",
                    f"train.output_dir={tmp_path / 'run'}")
    assert code == 2
    assert f"{path}:line 2: message 0 of the prompt (column 'prompt') has role 'wizard'" in err
    assert "system, user, assistant, tool" in err


@pytest.mark.parametrize("line,problem", [
    # json counts the line break: a row cut short was reported "at column 1" of the line.
    ('{"prompt": "What is 2 + 2?", "answer": "4"', "Expecting ',' delimiter at the end of the line)"),
    ('{"prompt": "What is 2 + 2?" "answer": "4"}', "Expecting ',' delimiter at column 29)"),
    ("{", "Expecting property name enclosed in double quotes at the end of the line); JSONL holds one object per line"),
])
def test_a_broken_jsonl_row_is_placed_where_it_breaks(tmp_path, line, problem):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        read_rows(str(path))
    assert str(e.value) == f"{path}:line 2: not valid JSON (" + problem


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('\ufeff{"prompt": "What is 1 + 1?", "answer": "2"}\n', encoding="utf-8")
    assert read_rows(str(path)) == [(f"{path}:line 1", {"prompt": "What is 1 + 1?", "answer": "2"})]


def test_prompts_longer_than_the_models_positions_are_refused_unless_handled(capsys, tmp_path):
    long = "What is 2 + 2? " + "Think hard. " * 1000  # ~3,000 tokens, tiny-random has 1,024 positions
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"prompt": "What is 1 + 1?", "answer": "2"},
                                                          {"prompt": long, "answer": "4"})))
    base = ["train", "--no-progress", *T, f"data.path={path}", "reward.functions=[exact_answer]"]
    code, err = run(capsys, *base, f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and not (tmp_path / "run").exists()
    assert "1 of the 2 prompts are longer than the 1016 tokens that the model's 1024 positions leave beside " \
           "rollout.max_completion_length=8" in err and "set data.max_prompt_length=1016" in err
    code, err = run(capsys, *base, "data.max_prompt_length=1020", f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and "data.max_prompt_length=1020 + rollout.max_completion_length=8 exceeds the model's 1024" in err
    assert main([*base, "data.max_prompt_length=1016", "data.long_prompts=truncate",
                 f"train.output_dir={tmp_path / 'run'}"]) == 0
