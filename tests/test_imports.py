"""No import circle among grpokit's modules at module level: the imports a module runs when it is
imported (not those inside functions, which run when called, nor those under `if TYPE_CHECKING:`,
which never run) form no cycle. Read from the source with ast: nothing is imported."""

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in (SRC / "grpokit").rglob("*.py")}


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
    return {name for name in ran if name in MODULES and name != module}


def module_level_imports(module: str) -> set[str]:
    """The grpokit modules `module` imports when it is imported."""
    path = MODULES[module]
    found = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_imported(node, module, path.name == "__init__.py"))
            elif isinstance(node, ast.If):
                visit(node.orelse)
                if not _type_checking(node.test):
                    visit(node.body)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, (ast.With, ast.For, ast.While, ast.ClassDef)):  # run at import, unlike a def's body
                visit(node.body)
                visit(getattr(node, "orelse", []))

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


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


def test_the_reader_sees_the_imports_that_run_and_only_those(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nimport grpokit.rollout.tools\nfrom grpokit import api\n"
                     "if TYPE_CHECKING:\n    from grpokit.config import Config\n"
                     "def f():\n    from grpokit import trainer\n")
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _imported(node, "grpokit.report", package=False)
    assert found == {"grpokit", "grpokit.rollout", "grpokit.rollout.tools", "grpokit.api"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert "grpokit.config" in module_level_imports("grpokit.api")
    assert "grpokit.trainer" not in module_level_imports("grpokit.api")  # imported inside run()


def test_no_import_circle_at_module_level():
    graph = {module: module_level_imports(module) for module in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle at module level: " + " -> ".join(cycle)
