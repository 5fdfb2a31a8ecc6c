"""The product stands without its test fakes: no module outside ``tests/``, ``bench/`` and ``testing/`` imports
``testing``, and the local training command loads none of it.

Every import counts here, lazy ones inside functions and those under ``if TYPE_CHECKING:`` included, and so does a
string naming a ``testing`` module (an ``importlib`` or hydra ``_target_`` path).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "nemo_gym_browser"
TESTING = f"{PACKAGE}.testing"
ROOT = Path(__file__).resolve().parent.parent
NOT_PRODUCT = {"tests", "bench", "testing", "build", "docs", "scripts", "examples"}


def product_files(root: Path = ROOT) -> list[Path]:
    """Every Python file of the recipe a user's command or config may run."""
    found = []
    for path in sorted(root.rglob("*.py")):
        top = path.relative_to(root).parts[0]
        if not (top.startswith(".") or top.endswith(".egg-info") or top in NOT_PRODUCT):
            found.append(path)
    return found


def references_to_testing(path: Path, root: Path = ROOT) -> Iterator[str]:
    """``file:line what`` for each import of ``testing`` (absolute or relative) and each string naming it."""
    parts = path.relative_to(root).with_suffix("").parts
    package = [PACKAGE, *parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and TESTING in node.value:
            yield f"{path.relative_to(root)}:{node.lineno} a string naming {TESTING}"
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        found = next((name for name in names if name == TESTING or name.startswith(TESTING + ".")), None)
        if found:
            yield f"{path.relative_to(root)}:{node.lineno} {found}"


def test_no_module_outside_tests_bench_and_testing_imports_testing() -> None:
    files = product_files()
    assert ROOT / "local" / "training_run.py" in files and ROOT / "rehearsal.py" in files
    assert not any(path.is_relative_to(ROOT / "testing") for path in files)

    assert [ref for path in files for ref in references_to_testing(path)] == []


def test_the_checker_sees_relative_lazy_type_checking_and_string_references(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "deep.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..testing.fake_judge import FakeJudgeServer\n"
        "def late():\n    from ..testing import chaos_plan\n"
        "from .. import testing\n"
        "TARGET = 'nemo_gym_browser.testing.private_ray.private_ray'\n"
        "from ..local import scripted_policy\n"
    )
    (tmp_path / "top.py").write_text("import nemo_gym_browser.testing.benchmarking\nfrom .testing import x\n")

    found = [ref.split()[0] for path in product_files(tmp_path) for ref in references_to_testing(path, tmp_path)]

    assert sorted(found, key=lambda ref: (ref.split(":")[0], int(ref.split(":")[1]))) == [
        "local/deep.py:3",
        "local/deep.py:5",
        "local/deep.py:6",
        "local/deep.py:7",
        "top.py:1",
        "top.py:2",
    ]


def test_importing_the_local_training_command_loads_no_testing_module() -> None:
    probe = (
        "import sys, nemo_gym_browser.local.training_run, nemo_gym_browser.rehearsal\n"
        f"print(sorted(m for m in sys.modules if m == {TESTING!r} or m.startswith({TESTING + '.'!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)

    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
