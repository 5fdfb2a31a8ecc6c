"""Interpreter start-up hook: every Python process whose path holds this folder gets the recipe and its wiring.

Ray workers are separate processes, so patching verl in the driver is not enough. Python imports the first
``sitecustomize`` on ``sys.path`` at start-up; with this folder on ``PYTHONPATH`` that is this file, which (1) loads
this folder as the ``nemo_gym_browser`` package by file path, so ``pkg://nemo_gym_browser.dataset`` and the agent
loop's ``_target_`` resolve in every process whatever ``NEMO_GYM_BROWSER_PATCHES`` says; (2) unless
``NEMO_GYM_BROWSER_PATCHES=0``, installs ``patches.install_on_import()`` (no torch, verl or numpy imported here);
(3) runs the ``sitecustomize`` it shadows, if any, still reachable as ``sitecustomize.chained``.

Errors: a failure to install is reported on stderr and does not stop the interpreter; a verl whose trainer functions
moved fails loudly later, when those modules are imported. A pip install gets the same through the ``verl.plugins``
entry point (``docs/estimator-and-wiring.md#getting-it-into-every-process``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from types import ModuleType

PACKAGE = "nemo_gym_browser"
_HERE = os.path.dirname(os.path.abspath(__file__))

chained: ModuleType | None = None


def _import_package() -> ModuleType:
    """This folder as the ``nemo_gym_browser`` package (unless something already imported that package).

    Loading by file path, rather than ``import nemo_gym_browser``, makes the folder on the path the code that runs,
    whether or not (and wherever) the package is also pip-installed.
    """
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(
        PACKAGE, os.path.join(_HERE, "__init__.py"), submodule_search_locations=[_HERE]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {PACKAGE} from {_HERE}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[PACKAGE]
        raise
    return package


def _install() -> None:
    try:
        _import_package()
    except Exception:
        sys.stderr.write(f"{PACKAGE} sitecustomize: could not load the package:\n{traceback.format_exc()}")
        return
    try:
        importlib.import_module(f"{PACKAGE}.patches").install_on_import()  # does nothing when the switch is off
    except Exception:
        sys.stderr.write(f"{PACKAGE} sitecustomize: could not install the trainer wiring:\n{traceback.format_exc()}")


def _same_dir(entry: str) -> bool:
    return os.path.normcase(os.path.realpath(entry or os.getcwd())) == os.path.normcase(os.path.realpath(_HERE))


def _run_shadowed() -> ModuleType | None:
    """Execute the next ``sitecustomize`` on ``sys.path`` after this folder's entry (never this file again)."""
    positions = [index for index, entry in enumerate(sys.path) if isinstance(entry, str) and _same_dir(entry)]
    rest = sys.path[positions[0] + 1 :] if positions else list(sys.path)
    rest = [entry for entry in rest if isinstance(entry, str) and not _same_dir(entry)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "sitecustomize":
    _install()
    chained = _run_shadowed()
