"""A non-editable install carries what the package reads at run time, and the license it declares."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_every_shipped_policy_folder_is_package_data() -> None:
    shipped = sorted(path.parent.name for path in (ROOT / "local").glob("*/SHA256SUMS"))
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["nemo_gym_browser.local"]
    assert shipped, "no policy folder found: the check would pass vacuously"
    assert [name for name in shipped if f"{name}/*" not in patterns] == []


def test_the_license_file_is_the_license_pyproject_declares() -> None:
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_every_folder_of_the_package_is_a_listed_package() -> None:
    tops = [path.parent for path in ROOT.glob("*/__init__.py") if path.parent.name not in {"tests", "build"}]
    folders = sorted(
        ".".join(("nemo_gym_browser", *path.parent.relative_to(ROOT).parts))
        for top in tops
        for path in top.rglob("__init__.py")
    )
    assert "nemo_gym_browser.gym_contract" in folders and "nemo_gym_browser.local.miniwob" in folders
    assert [name for name in folders if name not in PYPROJECT["tool"]["setuptools"]["packages"]] == []
