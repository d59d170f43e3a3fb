"""distill.teacher, on-policy distillation, end to end: a teacher equal to the student gives a zero
signal (the weights do not move), a teacher of another vocabulary and the settings it contradicts
are refused by name. The formula and its sign: tests/algorithm/test_loss_variants.py; micro-batches
and processes: tests/training/test_distributed.py."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.teachers import another_teacher

from grpokit.cli import main
from grpokit.config.loading import load_config
from grpokit.models.loading import load_model
from grpokit.runtime.errors import ConfigError, StartupError
from grpokit.training.trainer import Trainer

RUN = ["model.name=tiny-random", "reward.functions=[]", "data.eval_size=0", "train.prompts_per_step=2",
       "rollout.num_generations=4", "rollout.max_completion_length=8", "train.learning_rate=1e-2"]


def test_a_teacher_equal_to_the_student_gives_no_signal_and_leaves_the_weights_as_they_were(tmp_path):
    """reward.functions=[] and the student itself as the teacher, weight decay 0: every token's
    advantage is exactly 0 (the teacher's log-probs and the student's come from the same pass), so
    two steps leave every weight bit for bit as it was, and the reverse KL logged is 0."""
    assert main(["train", "--no-progress", *RUN, "distill.teacher=tiny-random", "train.max_steps=2",
                 "train.weight_decay=0", f"train.output_dir={tmp_path}/run"]) == 0
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    start = dict(load_model("tiny-random").named_parameters())
    assert all(torch.equal(final[name], start[name].detach()) for name in final)
    from support.runs import metric_rows

    rows = [r for r in metric_rows(tmp_path / "run") if "loss" in r]
    assert [(r["distill/reverse_kl"], r["loss"], r["grad_norm"]) for r in rows] == [(0.0, 0.0, 0.0)] * 2


def test_another_teacher_gives_each_token_its_signal(tmp_path):
    """A teacher whose weights differ: the reverse KL is measured, the update moves the weights, and
    completions.jsonl holds each sampled token's teacher log-prob and reverse KL, whose mean over
    the step's tokens is the step's distill/reverse_kl."""
    teacher = another_teacher(tmp_path / "teacher", scale=5.0)
    trainer = Trainer(load_config(None, [*RUN, f"distill.teacher={teacher}", f"train.output_dir={tmp_path}/run",
                                         "monitor.log_completions=1"]), progress=False)
    start = [p.detach().clone() for p in trainer.policy.parameters()]
    row = trainer.train_step(1)
    assert row["distill/reverse_kl"] != 0 and row["grad_norm"] > 0 and row["reward"] == 0
    assert not all(torch.equal(a, b) for a, b in zip(start, trainer.policy.parameters()))
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 8  # 2 prompts x 4, each with its tokens' values (at most max_completion_length=8)
    assert all(8 >= len(r["teacher_logprobs"]) == len(r["reverse_kl"]) > 0 for r in records)
    assert all(t <= 0 for r in records for t in r["teacher_logprobs"])
    every = [v for r in records for v in r["reverse_kl"]]
    assert sum(every) / len(every) == pytest.approx(row["distill/reverse_kl"], abs=1e-3)


def test_a_teacher_of_another_vocabulary_is_refused_with_both_names(tmp_path):
    teacher = another_teacher(tmp_path / "teacher", extra_token="<not-the-policy-s>")
    with pytest.raises(StartupError, match=f"distill.teacher={teacher} has another vocabulary than the policy "
                                           r"model.name=tiny-random \(\d+ tokens against \d+"):
        Trainer(load_config(None, [*RUN, f"distill.teacher={teacher}", f"train.output_dir={tmp_path}/run"]),
                progress=False)
    assert not (tmp_path / "run").exists()  # refused before a run folder is left behind


def test_a_missing_teacher_folder_is_named_as_the_teacher(tmp_path):
    """Not as `model.name='...': no such folder`: the policy's folder is there. Nor one that is
    there but cannot be read."""
    missing = tmp_path / "no-teacher"
    with pytest.raises(StartupError, match=f"^distill.teacher='{missing}': no such folder$"):
        Trainer(load_config(None, [*RUN, f"distill.teacher={missing}", f"train.output_dir={tmp_path}/run"]),
                progress=False)
    broken = tmp_path / "broken-teacher"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(StartupError, match=f"^distill.teacher='{broken}' could not be loaded: .*\n  distill.teacher is"):
        Trainer(load_config(None, [*RUN, f"distill.teacher={broken}", f"train.output_dir={tmp_path}/run"]),
                progress=False)


def test_a_served_teacher_of_another_vocabulary_is_refused_with_both_names(monkeypatch):
    """/health says the served tokenizer's vocabulary (a digest): another one is refused at start-up."""
    from grpokit.models.loading import load_tokenizer
    from grpokit.models.teacher import ServedTeacher, vocabulary_digest

    tokenizer = load_tokenizer("tiny-random")
    health = {"model": "someone-else", "vocabulary": "0" * 32, "engine": "transformers"}
    monkeypatch.setattr(ServedTeacher, "_request", lambda self, path, body=None: health)
    with pytest.raises(StartupError, match="distill.teacher=http://127.0.0.1:1 serves someone-else, whose vocabulary "
                                           "is not the policy model.name=tiny-random's"):
        ServedTeacher("http://127.0.0.1:1", "tiny-random", tokenizer, 1.0)
    health["vocabulary"] = vocabulary_digest(tokenizer)
    ServedTeacher("http://127.0.0.1:1", "tiny-random", tokenizer, 1.0)


@pytest.mark.parametrize("overrides, message", [
    (["distill.teacher=tiny-random", "distill.coef=0"], "distill.coef=0.0: must be a finite number > 0"),
    (["distill.teacher=tiny-random", "rollout.dynamic_sampling=true"], "rollout.dynamic_sampling drops groups of "
                                                                        "equal rewards, but with distill.teacher"),
    ([], "reward.functions is empty: name at least one function"),  # neither a teacher nor an agent
])
def test_what_a_teacher_contradicts_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [*RUN, *overrides])


@pytest.mark.process
def test_a_teacher_on_a_server_scores_as_the_one_in_process_and_its_death_stops_the_run_by_name(server, tmp_path):
    """distill.teacher=<grpokit serve --model tiny-random>: its log-probs of a step's completions
    are those the same teacher gives in the trainer's process (to float32 rounding: another pass
    layout); killed, the next step stops with the teacher's URL named."""
    s = server()
    remote = Trainer(load_config(None, [*RUN, f"distill.teacher={s.url}", "distill.timeout=3",
                                        f"train.output_dir={tmp_path}/remote"]), progress=False)
    local = Trainer(load_config(None, [*RUN, "distill.teacher=tiny-random", f"train.output_dir={tmp_path}/local"]),
                    progress=False)
    batch = local.sampler.sample(local.sampler.next_prompts())
    active = torch.ones(len(batch.finish_reasons), dtype=torch.bool)
    mask = batch.completion_mask.bool()
    theirs = remote.teacher.logprobs(batch, active, remote.logprobs)
    ours = local.teacher.logprobs(batch, active, local.logprobs)
    torch.testing.assert_close(theirs[mask], ours[mask], rtol=0, atol=1e-5)
    assert remote.train_step(1)["distill/reverse_kl"] == pytest.approx(0, abs=1e-5)
    s.kill()
    with pytest.raises(RuntimeError, match=f"the teacher at {s.url} \\(distill.teacher\\) cannot be reached"):
        remote.train_step(2)


def test_a_run_with_a_teacher_resumes_bit_for_bit(tmp_path):
    """The teacher holds no state: it is loaded again from the config, and a run stopped after step 1
    then resumed is the uninterrupted 2-step run (metrics, checkpoints, final weights)."""
    import runpy

    differences = runpy.run_path(str(Path(__file__).parents[2] / "tools" / "compare_runs.py"))["differences"]
    teacher = another_teacher(tmp_path / "teacher", scale=5.0)
    run = [*RUN, f"distill.teacher={teacher}", "train.save_every=1"]
    assert main(["train", "--no-progress", *run, "train.max_steps=2", f"train.output_dir={tmp_path}/whole"]) == 0
    for steps in (1, 2):
        assert main(["train", "--no-progress", *run, f"train.max_steps={steps}", f"train.output_dir={tmp_path}/cut"]) == 0
    assert differences(tmp_path / "whole", tmp_path / "cut") == []


def test_a_vision_teacher_scores_with_the_prompts_images(tmp_path):
    """The student as its own teacher on the picture task: the teacher's passes see each prompt's
    images (without them its log-probs would differ from the student's), so the signal is 0."""
    from support.runs import metric_rows

    vision = Path(__file__).parents[2] / "examples" / "vision.yaml"
    assert main(["train", "--no-progress", "--config", str(vision), "model.name=tiny-random-vlm",
                 "distill.teacher=tiny-random-vlm", "train.max_steps=1", "data.eval_size=0", "train.prompts_per_step=1",
                 "rollout.num_generations=2", f"train.output_dir={tmp_path}/run"]) == 0
    assert [r["distill/reverse_kl"] for r in metric_rows(tmp_path / "run") if "loss" in r] == [0.0]
