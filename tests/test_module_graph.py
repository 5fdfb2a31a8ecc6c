"""The package's modules import each other without a circle, and its folders in one order, lazy imports inside
functions and imports under ``if TYPE_CHECKING:`` included.

A circle means two modules that each need the other to be read: one job split in two places, or a function in the
wrong module. A circle through type-only imports is the same split, only hidden from the interpreter. The folders are
layers, lowest first: ``gym_contract``, ``task_lists``, ``agent_attempt``, ``trainer_side``, then the root's modules,
then ``local`` and ``testing``; a module imports only from its own layer and the layers before it.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "nemo_gym_browser"
ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGE = {"tests", "bench", "build", "docs", "scripts", "examples"}


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (the folder is the package)."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        if here == root:  # never walk into the virtual environments or what is not the package
            subfolders[:] = [
                name
                for name in subfolders
                if not (name.startswith(".") or name in NOT_PACKAGE or name.endswith(".egg-info"))
            ]
        for file in (name for name in files if name.endswith(".py")):
            parts = (here / file).relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((PACKAGE, *parts))] = here / file
    return dict(sorted(found.items()))


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


def imported_modules(
    name: str, path: Path, modules: dict[str, Path], *, type_checking: bool = False, precise: bool = False
) -> set[str]:
    """The package modules ``name`` imports (``from . import x`` counts as importing ``x``).

    ``from p import x`` also counts as importing the package ``p`` itself, unless ``precise`` and ``x`` is a module.
    """
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
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            if precise:
                candidates = [sub if sub in modules else module for sub in submodules]
            else:
                candidates = [module, *submodules]
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
    assert f"{PACKAGE}.gym_contract.environment" in graph[f"{PACKAGE}.browser_agent_loop"]
    assert circles(graph) == []


def test_no_circle_runs_through_type_checking_imports_either() -> None:
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules, type_checking=True) for name, path in modules.items()}

    # the type of the episode a tool call finds
    assert f"{PACKAGE}.agent_attempt.episode" in graph[f"{PACKAGE}.agent_attempt.browser_tool"]
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


FOLDERS = ("gym_contract", "task_lists", "agent_attempt", "trainer_side")
LAYERS = (*FOLDERS, "", "local", "testing")  # lowest first; "" is the root's modules
SETTINGS = f"{PACKAGE}.settings"  # the configuration every layer reads: the one module any layer may import
MAX_ROOT_MODULES = 25
# Arrows against the order that stand, each with why: (importer, imported module or package prefix).
EXCUSED = {
    # The legacy trainer's wrapper calls the estimator, an upstream-layout file at the root (lazily: it loads torch).
    (f"{PACKAGE}.trainer_side.trainer_wrappers", f"{PACKAGE}.group_stats"),
    # The node check compares VERL_PLATFORM with the name the CPU backend registers its platform under.
    (f"{PACKAGE}.node_check", f"{PACKAGE}.local.cpu_backend"),
    # The rehearsal (``python rehearsal.py``) drives the scripted policy through the fault proxy on this machine.
    (f"{PACKAGE}.rehearsal", f"{PACKAGE}.local"),
}


def layer(name: str) -> str:
    """The folder a module belongs to, "" for the root's modules and the package itself."""
    parts = name.split(".")[1:]
    return parts[0] if parts and parts[0] in LAYERS else ""


def arrows_against_the_order(graph: dict[str, set[str]], excused: set[tuple[str, str]] = EXCUSED) -> list[str]:
    """``importer -> imported`` for each import of a later layer than the importer's own (``settings`` aside)."""
    found = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets - {SETTINGS}):
            if LAYERS.index(layer(target)) <= LAYERS.index(layer(importer)):
                continue
            if not any(importer == who and (target == what or target.startswith(what + ".")) for who, what in excused):
                found.append(f"{importer} -> {target}")
    return found


def layered_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every import, lazy and type-only ones included; ``from p import m`` imports the module ``m``, not ``p``."""
    modules = package_modules(root)
    return {
        name: imported_modules(name, path, modules, type_checking=True, precise=True) for name, path in modules.items()
    }


def test_a_module_imports_only_its_own_layer_and_the_layers_before_it() -> None:
    graph = layered_graph()

    assert {layer(name) for name in graph} == set(LAYERS)
    assert f"{PACKAGE}.gym_contract.url_safety" in graph[f"{PACKAGE}.agent_attempt.episode"]
    assert arrows_against_the_order(graph) == []
    assert {folder: graph[f"{PACKAGE}.{folder}"] for folder in FOLDERS} == {folder: set() for folder in FOLDERS}


def test_settings_which_every_layer_reads_imports_only_the_url_rules() -> None:
    assert layered_graph()[SETTINGS] == {f"{PACKAGE}.gym_contract.url_safety"}


def test_the_order_check_finds_arrows_up_through_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    for folder in ("gym_contract", "agent_attempt", "local"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "settings.py").write_text("")
    (tmp_path / "loop.py").write_text("from .gym_contract import calls\nfrom .local import site\n")
    (tmp_path / "gym_contract" / "calls.py").write_text("from .. import settings\ndef f():\n    from .. import loop\n")
    (tmp_path / "agent_attempt" / "step.py").write_text(
        "from typing import TYPE_CHECKING\nfrom ..gym_contract import calls\n"
        "if TYPE_CHECKING:\n    from ..local.site import S\n"
    )
    (tmp_path / "local" / "site.py").write_text("from ..agent_attempt import step\nfrom ..loop import x\n")

    graph = layered_graph(tmp_path)

    assert arrows_against_the_order(graph) == [
        f"{PACKAGE}.agent_attempt.step -> {PACKAGE}.local.site",
        f"{PACKAGE}.gym_contract.calls -> {PACKAGE}.loop",
        f"{PACKAGE}.loop -> {PACKAGE}.local.site",
    ]
    assert arrows_against_the_order(graph, {(f"{PACKAGE}.loop", f"{PACKAGE}.local")}) == [
        f"{PACKAGE}.agent_attempt.step -> {PACKAGE}.local.site",
        f"{PACKAGE}.gym_contract.calls -> {PACKAGE}.loop",
    ]


def test_the_root_holds_at_most_25_modules_and_each_folder_is_a_package() -> None:
    root_modules = sorted(path.name for path in ROOT.glob("*.py"))

    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules
    assert [folder for folder in FOLDERS if not (ROOT / folder / "__init__.py").is_file()] == []
