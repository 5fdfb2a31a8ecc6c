"""The package's modules import each other without a circle, lazy imports inside functions and imports under
``if TYPE_CHECKING:`` included.

A circle means two modules that each need the other to be read: one job split in two places, or a function in the
wrong module. A circle through type-only imports is the same split, only hidden from the interpreter.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "nemo_gym_browser"
ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGE = {"tests", "bench", "build", "docs", "scripts", "examples"}


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (the folder is the package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0].startswith(".") or parts[0] in NOT_PACKAGE or parts[0].endswith(".egg-info"):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def _imports(tree: ast.AST, *, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth; those under ``if TYPE_CHECKING:`` only when ``type_checking``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            continue  # a module run as a script is ``__main__``: what it imports then is no import of the module
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _imports(ast.Module([child], []), type_checking=False))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node, type_checking=type_checking)


def imported_modules(name: str, path: Path, modules: dict[str, Path], *, type_checking: bool = False) -> set[str]:
    """The package modules ``name`` imports (``from . import x`` counts as importing ``x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8")), type_checking=type_checking):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        targets.update(candidate for candidate in candidates if candidate in modules and candidate != name)
    return targets


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_the_package_takes_part_in_an_import_circle() -> None:
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}

    assert f"{PACKAGE}.browser_agent_loop" in graph and f"{PACKAGE}.local.training_run" in graph
    assert f"{PACKAGE}.environment" in graph[f"{PACKAGE}.browser_agent_loop"]
    assert circles(graph) == []


def test_no_circle_runs_through_type_checking_imports_either() -> None:
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules, type_checking=True) for name, path in modules.items()}

    assert f"{PACKAGE}.episode" in graph[f"{PACKAGE}.browser_tool"]  # the type of the episode a tool call finds
    assert circles(graph) == []


def test_the_circle_finder_finds_a_lazy_circle_and_ignores_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def late():\n    from .a import thing\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    (tmp_path / "d.py").write_text("from .c import y\n")
    modules = package_modules(tmp_path)
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}

    assert circles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]
    assert graph[f"{PACKAGE}.c"] == set() and graph[f"{PACKAGE}.d"] == {f"{PACKAGE}.c"}
    with_types = {name: imported_modules(name, path, modules, type_checking=True) for name, path in modules.items()}
    assert with_types[f"{PACKAGE}.c"] == {f"{PACKAGE}.a"}
