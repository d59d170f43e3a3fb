"""The architecture as the tree shows it: folders are layers, and a module imports only from its
own layer and the layers below (docs/architecture.md). Read from the source with ast, nothing
imported:

- every import a module makes, at module level or inside a function (those under `if
  TYPE_CHECKING:` aside, which never run), and every plug-in a registry names by its import path
  ("grpokit.x.y:Name"), stays in its layer or goes down;
- no import circle, among the imports that run when a module is imported or counting those inside
  functions too;
- a package's __init__ re-exports and registers: no logic;
- no module over 600 lines.
"""

import ast
import re
from pathlib import Path

from support.layers import LAYERS

SRC = Path(__file__).parents[2] / "src"

TOP = len(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in (SRC / "grpokit").rglob("*.py")}


def layer(module: str) -> int:
    """The layer of a grpokit module (or package): its folder's, the top for the package's own modules."""
    parts = module.split(".")
    if len(parts) >= 2:
        for i, folders in enumerate(LAYERS):
            if parts[1] in folders:
                return i
    return TOP


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(node: ast.Import | ast.ImportFrom, module: str, package: bool) -> set[str]:
    """The grpokit modules an import statement of `module` runs: each named module and the packages
    above it (importing a.b.c runs a and a.b first)."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            here = module.split(".") if package else module.split(".")[:-1]
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
        names = {base, *(f"{base}.{alias.name}" for alias in node.names)}  # `from a import b`: b may be a module
    ran = {".".join(name.split(".")[:i + 1]) for name in names for i in range(name.count(".") + 1)}
    # The packages above `module` are being imported already when it runs (and grpokit's own
    # __init__ imports nothing until asked: its __getattr__).
    above = {".".join(module.split(".")[:i + 1]) for i in range(module.count("."))}
    return {name for name in ran if name in MODULES and name != module and name not in above and name != "grpokit"}


def imports(module: str, module_level_only: bool) -> dict[str, int]:
    """The grpokit modules `module` imports -> the line of the first import, at module level only
    or in functions too; never those under `if TYPE_CHECKING:`."""
    path = MODULES[module]
    found: dict[str, int] = {}

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, path.name == "__init__.py"):
                    found.setdefault(name, node.lineno)
            elif isinstance(node, ast.If):
                visit(node.orelse)
                if not _type_checking(node.test):
                    visit(node.body)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, (ast.With, ast.For, ast.While, ast.ClassDef, ast.AsyncWith, ast.AsyncFor)):
                visit(node.body)  # run at import, unlike a def's body
                visit(getattr(node, "orelse", []))
            elif not module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def registered(module: str) -> dict[str, int]:
    """The grpokit modules a module's strings name as "grpokit.x.y:Name" (a registry's plug-ins) -> line."""
    found = {}
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for name in re.findall(r"\b(grpokit(?:\.\w+)+):\w+", node.value):
                if name in MODULES:
                    found.setdefault(name, node.lineno)
    return found


def upward(module: str) -> list[str]:
    """Each import or plug-in of `module` that goes up a layer, as 'module:line -> target (layer)'."""
    mine = layer(module)
    targets = {**registered(module), **imports(module, module_level_only=False)}
    return [f"{module}:{line} -> {target} ({'/'.join(LAYERS[layer(target)]) if layer(target) < TOP else 'top'})"
            for target, line in sorted(targets.items()) if layer(target) > mine]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every path from it is searched
    path: list[str] = []

    def search(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := search(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := search(node)):
            return cycle
    return None


def test_the_reader_sees_the_imports_that_run_and_only_those():
    tree = ast.parse("from typing import TYPE_CHECKING\nimport grpokit.rollouts.tools\nfrom grpokit import api\n"
                     "if TYPE_CHECKING:\n    from grpokit.config import Config\n"
                     "def f():\n    from grpokit.training import trainer\n")
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _imported(node, "grpokit.rundir.report", package=False)
    assert found == {"grpokit.rollouts", "grpokit.rollouts.tools", "grpokit.api"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert "grpokit.config.loading" in imports("grpokit.api", module_level_only=True)
    assert "grpokit.training.trainer" not in imports("grpokit.api", module_level_only=True)  # inside run()
    assert "grpokit.training.trainer" in imports("grpokit.api", module_level_only=False)
    assert "grpokit.engines.transformers_engine" in registered("grpokit.engines.protocols")  # ENGINES
    assert layer("grpokit.runtime.errors") == 0 and layer("grpokit.rewards.length") == layer("grpokit.tasks.shapes") + 1
    assert layer("grpokit.api") == layer("grpokit") == TOP


def test_every_folder_is_a_layer():
    folders = {p.name for p in (SRC / "grpokit").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {f for folders in LAYERS for f in folders}


def test_imports_go_down_the_layers_never_up():
    found = [line for module in sorted(MODULES) for line in upward(module)]
    assert found == [], "imports that go up a layer:\n" + "\n".join(found)


def test_the_check_finds_an_import_that_goes_up(tmp_path, monkeypatch):
    fake = tmp_path / "grpokit" / "models" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from grpokit.sampling import scoring\n\nPLUGINS = {'x': 'grpokit.training.trainer:T'}\n")
    monkeypatch.setitem(MODULES, "grpokit.models.fake", fake)
    assert upward("grpokit.models.fake") == ["grpokit.models.fake:2 -> grpokit.sampling (sampling)",
                                             "grpokit.models.fake:2 -> grpokit.sampling.scoring (sampling)",
                                             "grpokit.models.fake:4 -> grpokit.training.trainer (training)"]


def test_no_import_circle_at_any_level():
    """Neither among the imports that run when a module is imported, nor counting those inside
    functions: a module that needs another's function at call time only is still tied to it."""
    for module_level_only in (True, False):
        graph = {module: set(imports(module, module_level_only)) for module in MODULES}
        cycle = find_cycle(graph)
        assert cycle is None, "import circle: " + " -> ".join(cycle) + ("" if module_level_only else " (inside functions)")


def holds_logic(path: Path) -> list[str]:
    """What a package __init__ holds besides its docstring, imports, `__all__` / `__version__`, and
    (the top package) a module `__getattr__` that imports on first use."""
    found = []
    for i, node in enumerate(ast.parse(path.read_text()).body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in ("__all__", "__version__")
                                                for t in node.targets):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue
        found.append(f"{path.relative_to(SRC)}:{node.lineno} {type(node).__name__}")
    return found


def test_a_package_init_re_exports_and_holds_no_logic():
    found = [line for path in sorted((SRC / "grpokit").rglob("__init__.py")) for line in holds_logic(path)]
    assert found == []


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}
