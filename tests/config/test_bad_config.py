"""A bad config gets a clear answer: one `grpokit:` line naming the culprit (the setting, the
section, the file) and what to do, exit status 2, and nothing started. Each case here was once
answered with a traceback, a wrong hint, or silence."""

from support.bad_input import T, run

from grpokit.cli import main


def test_a_server_url_without_its_scheme_is_refused_at_start(capsys, tmp_path):
    code, err = run(capsys, "train", *T, "rollout.engine=server", "rollout.server_url=localhost:8391",
                    f"train.output_dir={tmp_path / 'run'}")
    assert code == 2
    assert "rollout.server_url=localhost:8391: must be a URL with its scheme and host, e.g. http://" in err
    assert not (tmp_path / "run").exists()


def test_a_type_error_does_not_hide_the_other_problems(capsys):
    code, err = run(capsys, "train", "train.max_steps=abc", "train.learning_rate=-1", "rollout.num_generations=1")
    assert code == 2
    for problem in ("train.max_steps must be an int, got 'abc'", "train.learning_rate=-1.0: must be > 0",
                    "rollout.num_generations=1: must be >= 2"):
        assert problem in err


def test_a_section_given_a_value_is_named_as_a_section(capsys, tmp_path):
    (tmp_path / "my.yaml").write_text("train: 5\n")
    code, err = run(capsys, "train", "--config", str(tmp_path / "my.yaml"))
    assert code == 2 and "train is a section: give its fields (e.g. train.prompts_per_step=...), not 5" in err
    assert "did you mean" not in err


def test_a_folder_given_as_config_file_is_named_a_folder(capsys, finished_run):
    code, err = run(capsys, "train", "--config", str(finished_run))
    assert code == 2
    assert f"config file {finished_run} is a folder, not a YAML file (this run's is {finished_run / 'config.yaml'})" in err


def test_a_server_url_whose_port_cannot_be_is_refused_at_start(capsys, tmp_path):
    """It waited rollout.server_timeout (300 s) in silence, then crashed with `Port out of range`."""
    for port in ("99999", "0", "eighty"):
        code, err = run(capsys, "train", *T, "rollout.engine=server", f"rollout.server_url=http://127.0.0.1:{port}",
                        f"train.output_dir={tmp_path / 'run'}")
        assert code == 2 and "Traceback" not in err
        assert f"rollout.server_url=http://127.0.0.1:{port}: the port must be a number from 1 to 65535" in err


CHECKED_AT_START_UP = {  # what `grpokit train` finds before it loads a weight: the setting, and what is said
    "agent": (["rollout.agent={d}/agents.py:agent", "reward.functions=[]"],
              "rollout.agent '{d}/agents.py:agent' must take (client, model, row)"),
    "teacher": (["distill.teacher={d}/no-teacher"], "distill.teacher='{d}/no-teacher': no such folder"),
    "model folder": (["model.name={d}/no-model"], "model.name='{d}/no-model': no such folder"),
    "reward file": (["reward.functions=[{d}/rewards.py:score]"],
                    "{d}/rewards.py cannot import what it needs: No module named 'no_such_module_here'"),
    "data row": (["data.path={d}/data.jsonl", "reward.functions=[exact_answer]"],
                 "{d}/data.jsonl:line 2: no column 'prompt' (data.prompt_column)"),
}


def test_config_check_finds_what_start_up_finds_and_exits_as_train_does(capsys, tmp_path):
    """`grpokit config --check` said "no problems" for a config whose agent had the wrong signature
    or whose teacher folder did not exist, and exited 1 where `grpokit train` exits 2. A URL where
    nothing answers is a warning there (a run waits for it at start-up)."""
    from support.processes import free_port

    (tmp_path / "agents.py").write_text("def agent(client):\n    return 1.0\n")
    (tmp_path / "rewards.py").write_text("import no_such_module_here\n\ndef score(completions, **kw):\n    return []\n")
    (tmp_path / "data.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"question": "2 + 2?"}\n')
    (tmp_path / "my.yaml").write_text("model:\n  name: tiny-random\n")
    for name, (settings, said) in CHECKED_AT_START_UP.items():
        settings = [s.format(d=tmp_path) for s in settings]
        assert main(["config", "--check", str(tmp_path / "my.yaml"), *settings]) == 2, name
        assert said.format(d=tmp_path) in capsys.readouterr().out, name
        code, err = run(capsys, "train", *T, *settings, f"train.output_dir={tmp_path / 'run'}")
        assert code == 2 and said.format(d=tmp_path) in err, (name, err)
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["config", "--check", str(tmp_path / "my.yaml"), "reward.functions=[judge]",
                 f"reward.judge_url={url}"]) == 0
    assert f"warning: reward.judge_url={url}: nothing answers there now" in capsys.readouterr().out
