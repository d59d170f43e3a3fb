"""A bad config gets a clear answer: one `grpokit:` line naming the culprit (the setting, the
section, the file) and what to do, exit status 2, and nothing started. Each case here was once
answered with a traceback, a wrong hint, or silence."""

from support.bad_input import T, run


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
