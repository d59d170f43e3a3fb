"""The test suite's own rules: its folders are the source's layers (and top/, and support/ for what
test modules share); test modules share code through support/ and conftest.py, never by importing
one another; a test that starts a `grpokit serve` process is marked `process`, so that
`pytest -m "not process"` (make test-quick) starts none."""

import ast
from pathlib import Path

from support.layers import LAYERS

TESTS = Path(__file__).parents[1]


def test_the_test_folders_are_the_layers():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders == {f for layer in LAYERS for f in layer} | {"top", "support"}
    assert not list(TESTS.glob("test_*.py")), "a test module belongs in its layer's folder"
    assert not list((TESTS / "support").glob("test_*.py"))


def test_no_test_module_imports_another():
    imports = {}
    for path in sorted(TESTS.glob("*/test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            imports.update({(path.name, name): node.lineno for name in names if name.split(".")[0].startswith("test_")})
    assert not imports, f"import from support/ (or a conftest.py fixture) instead: {imports}"


def test_tests_that_start_a_server_are_marked_process(request):
    unmarked = [item.nodeid for item in request.session.items
                if "server" in getattr(item, "fixturenames", ()) and item.get_closest_marker("process") is None]
    assert not unmarked, f"mark these @pytest.mark.process: {unmarked}"
