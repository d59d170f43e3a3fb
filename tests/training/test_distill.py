"""distill.teacher, on-policy distillation, end to end: a teacher equal to the student gives a zero
signal (the weights do not move), a teacher of another vocabulary and the settings it contradicts
are refused by name. The formula and its sign: tests/algorithm/test_loss_variants.py; micro-batches
and processes: tests/training/test_distributed.py."""

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
    """A teacher whose weights differ: the reverse KL is measured, and the update moves the weights."""
    teacher = another_teacher(tmp_path / "teacher", scale=5.0)
    trainer = Trainer(load_config(None, [*RUN, f"distill.teacher={teacher}", f"train.output_dir={tmp_path}/run"]),
                      progress=False)
    start = [p.detach().clone() for p in trainer.policy.parameters()]
    row = trainer.train_step(1)
    assert row["distill/reverse_kl"] != 0 and row["grad_norm"] > 0 and row["reward"] == 0
    assert not all(torch.equal(a, b) for a, b in zip(start, trainer.policy.parameters()))


def test_a_teacher_of_another_vocabulary_is_refused_with_both_names(tmp_path):
    teacher = another_teacher(tmp_path / "teacher", extra_token="<not-the-policy-s>")
    with pytest.raises(StartupError, match=f"distill.teacher={teacher} has another vocabulary than the policy "
                                           r"model.name=tiny-random \(\d+ tokens against \d+"):
        Trainer(load_config(None, [*RUN, f"distill.teacher={teacher}", f"train.output_dir={tmp_path}/run"]),
                progress=False)
    assert not (tmp_path / "run").exists()  # refused before a run folder is left behind


@pytest.mark.parametrize("overrides, message", [
    (["distill.teacher=http://127.0.0.1:8000"], "distill.teacher=http://127.0.0.1:8000: a teacher on a server is not "
                                                "built yet"),
    (["distill.teacher=tiny-random", "distill.coef=0"], "distill.coef=0.0: must be a finite number > 0"),
    (["distill.teacher=tiny-random", "rollout.dynamic_sampling=true"], "rollout.dynamic_sampling drops groups of "
                                                                        "equal rewards, but with distill.teacher"),
    ([], "reward.functions is empty: name at least one function"),  # neither a teacher nor an agent
])
def test_what_a_teacher_contradicts_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [*RUN, *overrides])
