"""broker/service/ has no import cycle: every module imports alone, and the
graph of its imports (those inside functions included) has no loop.

A cycle hidden behind a function-level import works until someone moves the
import to the top of the file, and then the service fails to start; the
handlers and the OpenAPI document once imported each other that way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from servicefixtures import REPO_ROOT

SERVICE = Path(REPO_ROOT) / "broker" / "service"


def module_name(path: Path) -> str:
    """The dotted name of a source file under the repository root."""
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


SERVICE_MODULES = sorted(module_name(path) for path in SERVICE.rglob("*.py"))


def runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth: not those under
    ``if TYPE_CHECKING:`` (annotations only) or ``if __name__ == "__main__":``
    (the file run as a script is a module of its own, ``__main__``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def skipped(node: ast.If) -> bool:
        text = ast.unparse(node.test)
        return text in ("TYPE_CHECKING", "typing.TYPE_CHECKING", "__name__ == '__main__'")

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and skipped(node):
            for child in node.orelse:
                walk(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return found


def imported_modules(name: str, path: Path) -> set[str]:
    """The modules importing ``name`` runs, as dotted names: each imported module
    and the packages above it that are not already above ``name`` (Python runs
    a package's ``__init__`` before any module in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        targets.add(base)
        # ``from pkg import name`` imports the submodule when ``name`` is one.
        targets.update(f"{base}.{alias.name}" for alias in node.names)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    ran: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            if module in SERVICE_MODULES and module not in ancestors and module != name:
                ran.add(module)
    return ran


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in SERVICE.rglob("*.py"):
        name = module_name(path)
        graph[name] = imported_modules(name, path)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_imports_inside_functions_and_package_inits():
    # The checker itself: a function-level import is an edge, and importing a
    # module of a package runs the package first.
    graph = import_graph()
    assert "broker.service.openapi" in graph["broker.service.apihandlers.root"]
    assert "broker.service.apihandlers" in graph["broker.service.pages.handlers"]
    assert "broker.service.app" in graph["broker.service.openapi.__main__"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_broker_service_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or ())


@pytest.mark.parametrize("module", [m for m in SERVICE_MODULES if not m.endswith("__main__")])
def test_each_module_imports_alone(module):
    # A fresh interpreter, so that no earlier import hides an order dependency.
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


CORE = Path(REPO_ROOT) / "broker" / "core"
#: What the pure core may import besides the standard library: itself and the
#: error classes (design.md §5: no database, network or clock).
CORE_MAY_IMPORT = ("broker.core", "broker.errors")


def test_the_core_imports_only_itself_and_the_standard_library():
    outside = {}
    for path in CORE.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                modules = [".".join([*anchor, node.module] if node.module else anchor)]
            else:
                modules = [node.module or ""]
            for module in modules:
                top = module.split(".")[0]
                inward = module.startswith(CORE_MAY_IMPORT)
                if not inward and (top == "broker" or top not in sys.stdlib_module_names):
                    outside.setdefault(name, []).append(module)
    assert outside == {}, f"the core imports outside itself: {outside}"
