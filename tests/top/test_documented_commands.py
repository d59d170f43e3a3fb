"""Every `grpokit` command README.md, docs/ and the examples write runs as written, from the
repository root: each `grpokit train` and `grpokit config --check` through what `grpokit train`
checks before it loads a weight (training/preflight.py, which `grpokit config --check` runs), and
every command through the CLI's parser.

A command is a line of a fenced code block, of an example's docstring or of a YAML example's
comments that starts with `grpokit `, or an inline `grpokit train`/`grpokit config --check` span in
the prose that carries a config or a setting. One that names what its reader makes first (their
own file, a run folder an earlier command writes) goes through the parser only: MADE_FIRST lists
those names, each with what makes it, and the test fails when one of them is no longer used."""

import re
import shlex
from pathlib import Path

import pytest

from grpokit.cli import _parse, _parser
from grpokit.config.loading import load_config
from grpokit.runtime.errors import StartupError
from grpokit.training.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]

# What a command may name that its reader makes first: such a command is parsed, not checked.
MADE_FIRST = {
    "my.yaml": "the reader's own config",
    "q17.yaml": "the reader's own config (docs/speed-and-memory.md)",
    "problems.jsonl": "the reader's own data",
    "games.jsonl": "the reader's own data",
    "my_agent.py": "the reader's own agent",
    "my_tools.py": "the reader's own tools",
    "my_envs": "the reader's own environment",
    "my_package": "the reader's own environment",
    "rubric.txt": "the reader's own rubric",
    "runs/": "a run folder an earlier command writes",
    "<": "a placeholder the prose names",
    "...": "an elision: the rest as in a command above",
}


def _joined(lines: list[str]) -> list[str]:
    """Lines with their backslash continuations joined."""
    out, held = [], ""
    for line in lines:
        held += line.strip()
        if held.endswith("\\"):
            held = held[:-1] + " "
            continue
        out.append(held)
        held = ""
    return out


def _commands_of(lines: list[str]) -> list[tuple[str, list[str]]]:
    """The commands among joined `lines` (one a line; `a & b`: two), each with the output a
    `$ `-prompted one shows below it (the lines up to the next command)."""
    out = []
    for line in _joined(lines):
        shown = line.startswith("$ ")
        line = line.removeprefix("$ ").lstrip("# ")
        if line.startswith("grpokit "):
            for part in re.split(r"\s+&&?\s+|;\s+", re.split(r"\s+#\s", line)[0]):
                out.append((part.strip().rstrip("&").strip(), [] if shown else None))
        elif out and out[-1][1] is not None and line:
            out[-1][1].append(line)
    return out


def documented_commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, command, the output the docs show for it) for every grpokit command of the docs and
    examples (module docstring)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        pieces = path.read_text().split("```")
        for block in pieces[1::2]:  # fenced blocks
            found += [(path.name, c, o) for c, o in _commands_of(block.splitlines()[1:])]
        prose = "\n".join(pieces[::2])
        spans = [" ".join(c.split()) for c in re.findall(r"`(grpokit (?:train|config --check)[^`]*)`", prose)]
        found += [(path.name, c, o) for span in spans if "=" in span or "--config" in span or "--check" in span
                  for c, o in _commands_of([span])]
    for path in sorted((ROOT / "examples").rglob("*")):
        if path.suffix in (".py", ".yaml"):
            found += [(str(path.relative_to(ROOT)), c, o) for c, o in _commands_of(path.read_text().splitlines())]
    commands = {}
    for where, command, output in found:
        commands.setdefault(command, (where, tuple(output or ())))
    return sorted((where, command, output) for command, (where, output) in commands.items())


COMMANDS = documented_commands()


def test_the_commands_are_found_and_every_made_first_name_is_used():
    assert len(COMMANDS) > 40
    used = {name for _, command, _ in COMMANDS for name in MADE_FIRST if name in command}
    assert used == set(MADE_FIRST)


@pytest.fixture(scope="module")
def built_in_models():
    """The bundled models converted (cached), so that the commands naming them are checked against
    their data, not passed over as models not on this machine yet."""
    from grpokit.models.bundled import bundled_model_path, bundled_vlm_path

    bundled_model_path(), bundled_vlm_path()


@pytest.mark.parametrize("where, command, output", COMMANDS, ids=[c for _, c, _ in COMMANDS])
def test_a_documented_command_runs_as_written(where, command, output, monkeypatch, built_in_models):
    """It parses; a train or config --check command passes the start-up checks (its data checked
    too, but for a Hub model not on this machine), or fails with the error the docs show below it."""
    monkeypatch.chdir(ROOT)
    argv = shlex.split(re.sub(r"<[^>]*>", "X", command))[1:]  # a placeholder is one argument
    try:
        args = _parse(_parser(), argv)
    except SystemExit:
        pytest.fail(f"{where}: `{command}`: the CLI does not take these arguments")
    if any(name in command for name in MADE_FIRST) or not (args.command == "train" or getattr(args, "check", None)):
        return
    error = [line.removeprefix("grpokit: ") for line in output if line.startswith("grpokit: ")]
    try:
        config = load_config(args.config if args.command == "train" else args.check, args.overrides)
        checked = preflight(config)
    except StartupError as e:
        missing = re.search(r"No module named '([\w.]+)'", str(e))
        if missing and "examples/agents/" in command:  # a framework the docs install first (pip install ...)
            pytest.skip(f"{missing.group(1)} is not installed here")
        assert error, f"{where}: `{command}` fails: {e}"
        said = [line.strip() for line in str(e).splitlines()]
        assert [line.strip() for line in output] == ["grpokit: " + said[0], *said[1:]], f"{where}: `{command}`"
        return
    assert not error, f"{where}: `{command}` passes, but the docs show it failing: {output}"
    hub = "/" in config.model.name and not Path(config.model.name).exists()
    assert checked.model_known or hub, f"{where}: `{command}`: {config.model.name} was not checked"
