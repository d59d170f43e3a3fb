"""What the bad-input tests share (tests/*/test_bad_*.py): a tiny run's settings as a new user
would give them, and `grpokit` called as the console calls it with what it said on stderr. The
finished run they point commands at is tests/conftest.py's `finished_run` (made once a worker)."""

from grpokit.cli import main

# A tiny run, as a new user would start one.
T = ["model.name=tiny-random", "train.max_steps=2", "rollout.num_generations=4", "train.prompts_per_step=2",
     "rollout.max_completion_length=8", "data.eval_size=0"]


def run(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err

