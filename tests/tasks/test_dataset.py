"""Datasets from files: every format reads the same rows, bad rows fail early with file and row,
long prompts are dropped or truncated with a count, and the shipped examples run."""

import csv
import json
import re
from pathlib import Path

import pytest

from grpokit.config.loading import load_config
from grpokit.runtime.errors import ConfigError
from grpokit.settings.schema import DataConfig
from grpokit.tasks.dataset import DatasetTask, read_rows, to_example
from grpokit.tasks.task import DataError

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(10)]
REPO = Path(__file__).parents[2]


def write(tmp_path, fmt, rows=ROWS):
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        import datasets

        dataset = datasets.Dataset.from_list(rows)
        if fmt == "parquet":
            path = tmp_path / "d.parquet"
            dataset.to_parquet(str(path))
        else:
            path = tmp_path / "saved"
            dataset.save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "folder"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    rows = [row for _, row in read_rows(write(tmp_path, fmt))]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    assert [str(r["answer"]) for r in rows] == [r["answer"] for r in ROWS]


@pytest.mark.parametrize("content,problem", [
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', r"d.jsonl:line 2: not valid JSON"),
    ('{"prompt": "a", "answer": "1"}\n\n{"question": "b", "answer": "2"}\n', r"d.jsonl:line 3: no column 'prompt'"),
    ('{"prompt": "  ", "answer": "1"}\n', r"d.jsonl:line 1: the prompt \(column 'prompt'\) is empty"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r"d.jsonl:line 2: no value in column 'answer'"),
    ('[1, 2]\n', r"d.jsonl:line 1: expected a JSON object"),
    ('{"prompt": [{"role": "user"}], "answer": 1}\n', r"d.jsonl:line 1: the prompt .* must be a string or"),
])
def test_malformed_rows_fail_naming_file_and_row(tmp_path, content, problem):
    (tmp_path / "d.jsonl").write_text(content)
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), eval_size=0)
    with pytest.raises(DataError, match=problem):
        DatasetTask(cfg, seed=0, prompt_length=lambda e: 1)


def test_missing_file_and_training_refuses_before_writing(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"))
    from grpokit.cli import main

    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"\n')
    out = tmp_path / "run"
    code = main(["train", "model.name=tiny-random", f"data.path={tmp_path / 'd.jsonl'}",
                 "reward.functions=[math_accuracy]", f"train.output_dir={out}", "data.eval_size=0"])
    assert code == 2 and not out.exists()


def test_prompt_shapes_template_system_prompt_and_columns():
    cfg = DataConfig(prompt_template="{prompt} (level {level})", system_prompt="Be brief.", answer_column="solution")
    e = to_example({"prompt": "2+2?", "solution": "4", "level": 1}, "x:1", cfg)
    assert e.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? (level 1)"}]
    assert e.columns == {"solution": "4", "level": 1, "answer": "4"}
    plain = to_example({"prompt": "TL;DR:"}, "x:2", DataConfig(chat_template=False, answer_column=None))
    assert plain.prompt == "TL;DR:"
    chat = to_example({"prompt": [{"role": "user", "content": "hi"}], "answer": 1}, "x:3", DataConfig())
    assert chat.prompt == [{"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match="x:4: data.prompt_template"):
        to_example({"prompt": "a", "answer": 1}, "x:4", DataConfig(prompt_template="{missing}"))


def test_long_prompts_dropped_or_truncated_with_a_count(tmp_path):
    rows = [{"prompt": "x" * k, "answer": "1"} for k in range(1, 11)]
    path = write(tmp_path, "jsonl", rows)
    length = lambda e: len(e.prompt[0]["content"])  # noqa: E731 - characters stand in for tokens
    dropped = DatasetTask(DataConfig(path=path, eval_size=0, max_prompt_length=6), 0, length)
    assert len(dropped.train_examples) == 6
    assert dropped.notes == [f"{path}: dropped 4 of 10 prompts longer than data.max_prompt_length=6 tokens"]
    kept = DatasetTask(DataConfig(path=path, eval_size=0, max_prompt_length=6, long_prompts="truncate"), 0, length)
    assert len(kept.train_examples) == 10 and "truncated 4 of 10" in kept.notes[0]
    with pytest.raises(DataError, match=r"every prompt is longer than data.max_prompt_length=1: the shortest is 3 "
                                        r"tokens \(.*:line 1\)$"):
        DatasetTask(DataConfig(path=path, eval_size=0, max_prompt_length=1), 0, lambda e: len(e.prompt[0]["content"]) + 2)


def test_the_trainer_truncates_from_the_left(tmp_path):
    from grpokit.training.trainer import Trainer

    path = write(tmp_path, "jsonl", [{"prompt": "word " * 40, "answer": "1"}] * 4)
    config = load_config(None, ["model.name=tiny-random", f"data.path={path}", "data.eval_size=0",
                                "reward.functions=[math_accuracy]", "data.max_prompt_length=16",
                                "data.long_prompts=truncate", f"train.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(config, progress=False)
    example = trainer.task.train_examples[0]
    encoder = trainer.sampler.kind.encoder
    full = encoder.ids(example, None)
    assert len(full) > 16 and encoder(example) == full[-16:]  # the end: the generation prompt


def test_split_and_stream(tmp_path):
    task = DatasetTask(DataConfig(path=write(tmp_path, "jsonl"), eval_size=3), seed=5, prompt_length=lambda e: 1)
    assert len(task.eval_examples) == 3 and len(task.train_examples) == 7
    held = {e.prompt[0]["content"] for e in task.eval_examples}
    epoch = [task.train_example(i).prompt[0]["content"] for i in range(7)]
    assert sorted(epoch) == sorted(e.prompt[0]["content"] for e in task.train_examples) and not held & set(epoch)
    assert [task.train_example(i) for i in (3, 12)] == [task.train_example(3), task.train_example(12)]  # pure
    again = DatasetTask(DataConfig(path=write(tmp_path, "jsonl"), eval_size=3), seed=5, prompt_length=lambda e: 1)
    assert [again.train_example(i) for i in range(20)] == [task.train_example(i) for i in range(20)]


def test_a_dataset_needs_reward_functions():
    with pytest.raises(ConfigError, match="reward.functions"):
        load_config(None, ["data.path=x.jsonl"])


QUICK_START_REWARD = """
def reward_len(completions, **kwargs):  # TRL's quick start, verbatim: plain-text completions are strings
    return [-abs(20 - len(completion)) for completion in completions]
"""


@pytest.mark.parametrize("example,overrides", [
    ("math.yaml", []),
    ("tldr.yaml", ["data.path=examples/data/tldr.jsonl", "data.eval_size=2"]),
    ("calculator.yaml", ["data.eval_size=2", "train.prompts_per_step=1"]),
    ("reasoning_gym.yaml", ["data.eval_size=2", "train.prompts_per_step=1"]),
])
def test_shipped_examples_run_two_steps(tmp_path, monkeypatch, example, overrides):
    from grpokit.cli import main

    if example == "tldr.yaml":  # TRL's own reward function next to the built-in: the same values
        (tmp_path / "trl_reward.py").write_text(QUICK_START_REWARD)
        overrides = [*overrides, f"reward.functions=[{{name: length, target: 20}}, {tmp_path}/trl_reward.py:reward_len]"]
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    code = main(["train", "--config", f"examples/{example}", "--no-progress", "model.name=tiny-random",
                 "train.max_steps=2", "rollout.max_completion_length=8", f"train.output_dir={out}", *overrides])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    names = {"math.yaml": ("format", "math_accuracy"), "tldr.yaml": ("length",), "calculator.yaml": ("exact_answer",),
             "reasoning_gym.yaml": ("reasoning_gym",)}[example]
    for name in names:
        assert f"rewards/{name}/mean" in steps[0] and f"eval/rewards/{name}/mean" in rows[0]
    if example == "calculator.yaml":  # conversations with the calculator tool
        assert "tools/calls_per_rollout" in steps[0] and "turns/mean" in steps[0]
    if example == "tldr.yaml":
        assert all(r["rewards/length/mean"] <= 0 for r in steps)  # the length reward is never positive
        for r in steps:
            assert r["rewards/trl_reward.py:reward_len/mean"] == r["rewards/length/mean"]


def test_a_hub_id_that_cannot_load_is_a_clear_error(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time by both libraries: patch their copies too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="cannot load dataset 'nobody/no-such-dataset'"):
        read_rows("nobody/no-such-dataset")


def test_rows_with_different_columns_reach_rewards_as_none(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2, "hint": "two"}\n')
    task = DatasetTask(DataConfig(path=str(path), eval_size=0), 0, lambda e: 1)
    assert [e.columns["hint"] for e in task.train_examples] == [None, "two"]


@pytest.mark.parametrize("content,problem", [
    ('{"prompt": "a", "answer": 1, "completions": 3}\n', "column 'completions' clashes"),
    ('{"prompt": "a", "solution": 1, "answer": 2}\n', "has its own 'answer' column"),
])
def test_columns_that_would_be_overwritten_are_refused(tmp_path, content, problem):
    (tmp_path / "d.jsonl").write_text(content)
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), eval_size=0, answer_column="solution" if "solution" in content else "answer")
    with pytest.raises(DataError, match=problem):
        DatasetTask(cfg, 0, lambda e: 1)


def test_held_out_rows_without_the_answer_the_train_rows_have_are_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"e.jsonl: no column 'answer' \(data.answer_column\), which .*d.jsonl has"):
        DatasetTask(DataConfig(path=write(tmp_path, "jsonl"), eval_path=str(tmp_path / "e.jsonl")), 0, lambda e: 1)


def test_csv_rows_are_numbered_and_checked(tmp_path):
    (tmp_path / "d.csv").write_text('prompt,answer\n"two\nlines",1\nb,2,extra\n')
    with pytest.raises(DataError, match=r"d.csv:row 2: more fields than the header"):
        read_rows(str(tmp_path / "d.csv"))


def test_a_folder_with_several_splits_uses_train(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                          "test": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(str(tmp_path / "dd"))
    assert [r["prompt"] for _, r in read_rows(str(tmp_path / "dd"))] == [r["prompt"] for r in ROWS[:3]]


def test_reasoning_gym_tasks_are_streams_scored_by_the_library(tmp_path):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is in the test extra: pip install -e '.[test]'")
    import reasoning_gym

    from grpokit.config.loading import load_config
    from grpokit.rewards.reasoning_gym import reasoning_gym as score
    from grpokit.tasks.registry import make_task

    data = load_config(overrides=["data.task=reasoning_gym:chain_sum", "data.eval_size=20",
                                  "data.task_args={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"]).data
    task, again = make_task(data, 3, len), make_task(data, 3, len)
    stream = task.train_stream()
    first = [next(stream) for _ in range(40)]
    # A pure function of (seed, position): a stream restarted at 25 goes on identically.
    resumed = again.train_stream(25)
    assert [next(resumed).prompt for _ in range(15)] == [e.prompt for e in first[25:]]
    # The library's own entries: entry i of chain_sum with seed 3, shown after one worked example.
    entry = reasoning_gym.create_dataset("chain_sum", seed=3, size=40, min_terms=2, max_terms=2, min_digits=1,
                                         max_digits=1)[7]
    assert first[7].prompt[-1]["content"] == entry["question"] and first[7].columns["answer"] == entry["answer"]
    assert [m["role"] for m in first[7].prompt] == ["system", "user", "assistant", "user"]
    assert first[7].prompt[2]["content"].startswith("<answer>") and first[7].prompt[1] != first[7].prompt[3]
    # Past the first block of BLOCK entries: still chain_sum's entry of that index (it draws entry i
    # from Random(seed + i)), and a stream resumed there goes on identically.
    from grpokit.tasks.reasoning_gym import BLOCK

    far = reasoning_gym.create_dataset("chain_sum", seed=3, size=BLOCK + 8, min_terms=2, max_terms=2, min_digits=1,
                                       max_digits=1)[BLOCK + 7]
    assert task.train_example(BLOCK + 7).prompt[-1]["content"] == far["question"]
    assert next(again.train_stream(BLOCK + 7)).prompt == task.train_example(BLOCK + 7).prompt
    assert len(task.eval_examples) == 20
    # Scored by score_answer on what the <answer> tags hold; a completion without them has no answer.
    right, wrong = f"<answer>{entry['answer']}</answer>", f"<answer>{int(entry['answer']) + 1}</answer>"
    completions = [[{"role": "assistant", "content": c}] for c in (right, wrong, entry["answer"])]
    assert score(completions, entry=[entry] * 3) == [1.0, 0.0, 0.0]
    # Scored by the dataset made with the task's generator arguments: decimal_arithmetic's
    # score_answer accepts an error up to its max_num_decimal_places (3 by default).
    coarse = load_config(overrides=["data.task=reasoning_gym:decimal_arithmetic", "data.eval_size=1",
                                    "data.task_args={min_num_decimal_places: 1, max_num_decimal_places: 1}"]).data
    example = make_task(coarse, 0, len).train_example(0)
    near = [[{"role": "assistant", "content": f"<answer>{float(example.columns['answer']) + 0.05}</answer>"}]]
    assert score(near, entry=[example.columns["entry"]], task_args=[example.columns["task_args"]]) == [1.0]
    assert score(near, entry=[example.columns["entry"]]) == [0.0]  # the default precision's tolerance


def test_reasoning_gym_missing_is_named_with_its_install_command(monkeypatch):
    import sys

    from grpokit.tasks.reasoning_gym import ReasoningGymTask

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed: importing it fails
    with pytest.raises(ConfigError, match=r"needs reasoning-gym: pip install 'grpokit\[reasoning-gym\]'"):
        ReasoningGymTask("chain_sum", {}, eval_size=1)


@pytest.mark.parametrize("overrides,problem", [
    (["data.task=reasoning_gym:chain_summ"], "reasoning-gym has no dataset 'chain_summ' \\(did you mean chain_sum"),
    (["data.task=reasoning_gym:chain_sum", "data.task_args={min_termz: 2}"], "data.task_args=.*min_termz"),
    (["data.task=calculator", "data.task_args={min_terms: 2}"], "data.task_args=.* is only read by data.task=reasoning_gym"),
    (["data.task=reasoning"], "data.task='reasoning': must be one of arithmetic, calculator, environment, shapes, reasoning_gym:"),
])
def test_reasoning_gym_mistakes_are_named_at_start_up(tmp_path, overrides, problem, capsys):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is in the test extra: pip install -e '.[test]'")
    from grpokit.cli import main

    assert main(["train", "model.name=tiny-random", f"train.output_dir={tmp_path / 'run'}", *overrides]) == 2
    assert re.search(problem, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_images_are_read_as_they_are_meant_or_refused_with_the_file_the_line_and_the_fix(tmp_path):
    """Made here: a 16-bit PNG of the full range (20000 to 65535, which PIL's own conversion turns
    white) scaled to 8 bits by its type's range; a float image in [0, 1]; an I;16 under 256 as it
    is; a 3-frame GIF, a URL, a folder and a list in `image`: each refused with the row's file and
    line, the image, and what to do."""
    import numpy as np
    from PIL import Image

    from grpokit.tasks.dataset import row_images

    where = "data.jsonl:line 3"
    wide = np.linspace(20000, 65535, 64).reshape(8, 8).astype(np.uint16)
    Image.fromarray(wide).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as check:
        assert check.mode.startswith("I") and np.asarray(check).max() == 65535  # a real 16-bit file
    got = np.asarray(row_images({"image": "deep.png"}, where, tmp_path)[0])  # (8, 8, 3)
    assert np.array_equal(got[..., 0], np.rint(wide * (255 / 65535)).astype(np.uint8))
    assert got[..., 0].min() == 78 and got[..., 0].max() == 255 and len(np.unique(got)) > 32
    unit = np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 4)
    got = np.asarray(row_images({"image": Image.fromarray(unit, mode="F")}, where, None)[0])
    assert np.array_equal(got[..., 1], np.rint(unit * 255).astype(np.uint8))
    low = np.arange(16, dtype=np.uint16).reshape(4, 4) * 10
    got = np.asarray(row_images({"image": Image.fromarray(low)}, where, None)[0])
    assert np.array_equal(got[..., 2], low.astype(np.uint8))

    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:])
    (tmp_path / "folder").mkdir()
    for row, message in [
        ({"image": "moving.gif"}, f"{where}: image {tmp_path / 'moving.gif'} is animated (3 frames), and a prompt's "
                                  "image is one picture: save the frame you mean as an image file of its own"),
        ({"image": "http://example.com/cat.png"}, f"{where}: image http://example.com/cat.png is a URL, which grpokit "
                                                  "does not fetch: download it and give the file's path"),
        ({"image": "folder"}, f"{where}: image {tmp_path / 'folder'} is a folder, not an image file"),
        ({"image": ["a.png", "b.png"]}, f"{where}: the 'image' column holds one image, and this row's holds a list of "
                                        "2: name the column 'images' for several"),
    ]:
        with pytest.raises(DataError) as refused:
            row_images(row, where, tmp_path)
        assert message in str(refused.value)
