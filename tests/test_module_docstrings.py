"""Module docstrings state a contract, not a manual: at most 20 lines, and no path outside the repository.

The manuals live in ``docs/``. A docstring may show ``/tmp/...`` in a command example (a scratch folder every machine
has); a machine's own folders (``/home/...``, ``/work/...``) and paths that climb out of the repository
(``../shared/...``) are refused.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("gym_contract", "task_lists", "agent_attempt", "trainer_side", "local", "testing", "bench")
MAX_LINES = 20
# A machine's own folders at the start of an absolute path, or a climb out of the folder the docstring lives in.
OUTSIDE = re.compile(r"(?<![\w.:/~-])/(?:home|root|work|Users|mnt|scratch|srv|data|opt)/|(?<!\.)\.\./")


def modules(root: Path = ROOT) -> list[Path]:
    """The package's modules at the root and in its folders, with ``bench/``."""
    found = sorted(root.glob("*.py"))
    for folder in FOLDERS:
        found += sorted(path for path in (root / folder).rglob("*.py") if "__pycache__" not in path.parts)
    return found


def docstring(path: Path) -> str:
    return inspect.cleandoc(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or "")


def outside_paths(text: str) -> list[str]:
    """The lines of ``text`` that name a path outside the repository."""
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_module_docstring_is_longer_than_twenty_lines() -> None:
    too_long = {
        relative(path): len(docstring(path).splitlines())
        for path in modules()
        if len(docstring(path).splitlines()) > MAX_LINES
    }
    assert too_long == {}, f"move the manual to docs/ and keep the contract (at most {MAX_LINES} lines)"


def test_no_module_docstring_names_a_path_outside_the_repository() -> None:
    named = {relative(path): outside_paths(docstring(path)) for path in modules()}
    assert {name: lines for name, lines in named.items() if lines} == {}


@pytest.mark.parametrize(
    ("line", "outside"),
    [
        ("DEFAULT = /home/alice/data/webvoyager", True),
        ("the folder /work/shared/notes", True),
        ("see ../shared/notes/failure-handling.md", True),
        ("``<recipe>/../shared/data``", True),
        ("python bench/engines.py --json /tmp/engines.json", False),
        ("https://example.org/home/page and docs/data.md", False),
        ("vLLM's queues in /dev/shm/psm_*", False),
        ("from ..placement import Grant", False),
    ],
)
def test_the_path_check_tells_a_machines_folders_from_scratch_files_and_links(line: str, outside: bool) -> None:
    assert bool(outside_paths(line)) is outside
