"""Start-up installation in fresh interpreters: sitecustomize.py on PYTHONPATH, and the verl.plugins entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300
DIST_NAME = "verl-nemo-gym-browser"

LAZY_INSTALL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    heavy_at_start = sorted(m for m in ("torch", "verl", "numpy", "pandas", "ray") if m in sys.modules)
    import sitecustomize
    hook = any(getattr(f, "nemo_gym_browser_post_import_hook", False) for f in sys.meta_path)
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.trainer.ppo.v1 import trainer_base
    patches = sys.modules["nemo_gym_browser.patches"]
    print(json.dumps({
        "heavy_at_start": heavy_at_start,
        "sitecustomize": sitecustomize.__file__,
        "package": sys.modules["nemo_gym_browser"].__file__,
        "hook": hook,
        "targets": patches.installed_targets(),
        "legacy_wrapper_file": ray_trainer.compute_advantage.__code__.co_filename,
        "estimator_module": get_adv_estimator_fn("grpo_env_aware").__module__,
        "estimator_file": sys.modules[get_adv_estimator_fn("grpo_env_aware").__module__].__file__,
    }))
    """
)

STARTUP_STATE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import sitecustomize
    chained = sitecustomize.chained
    print(json.dumps({
        "sitecustomize": sitecustomize.__file__,
        "chained": None if chained is None else chained.__file__,
        "chained_mark": getattr(chained, "MARK", None),
        "runs": os.environ.get("OTHER_SITECUSTOMIZE_RUNS"),
        "package_loaded": "nemo_gym_browser" in sys.modules,
        "hook": any(getattr(f, "nemo_gym_browser_post_import_hook", False) for f in sys.meta_path),
        "heavy": sorted(m for m in ("torch", "verl", "numpy") if m in sys.modules),
    }))
    """
)

ENTRY_POINT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import verl  # verl loads every verl.plugins entry point here
    hook = any(getattr(f, "nemo_gym_browser_post_import_hook", False) for f in sys.meta_path)
    targets = None
    if sys.argv[1] == "import-trainers":
        from verl.trainer.ppo.v1 import trainer_base
        targets = sys.modules["nemo_gym_browser.patches"].installed_targets()
    site = sys.modules.get("sitecustomize")
    print(json.dumps({"hook": hook, "targets": targets, "sitecustomize": getattr(site, "__file__", None)}))
    """
)


def recipe_folder(tmp_path: Path) -> Path:
    """A copy of the recipe's top-level modules and their folders in a folder that is not installed anywhere."""
    folder = tmp_path / "browser_recipe"
    folder.mkdir()
    for source in ROOT.glob("*.py"):
        shutil.copy(source, folder / source.name)
    for package in ROOT.glob("*/__init__.py"):
        if package.parent.name not in {"local", "testing"}:
            shutil.copytree(package.parent, folder / package.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def other_sitecustomize(tmp_path: Path) -> Path:
    folder = tmp_path / "site_hooks"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        'import os\nMARK = "site"\n'
        'os.environ["OTHER_SITECUSTOMIZE_RUNS"] = str(int(os.environ.get("OTHER_SITECUSTOMIZE_RUNS", "0")) + 1)\n'
    )
    return folder


def run_python(script: str, *args: str, pythonpath: list[Path], **env: str) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(PYTHONPATH=os.pathsep.join(str(path) for path in pythonpath), **env)
    completed = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=environment,
        cwd=pythonpath[0].parent,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_folder_on_pythonpath_installs_the_wiring_lazily_without_importing_torch_or_verl_at_start_up(tmp_path):
    folder = recipe_folder(tmp_path)
    state = run_python(LAZY_INSTALL_SCRIPT, pythonpath=[folder], VERL_USE_EXTERNAL_PLUGINS="none")
    assert state["heavy_at_start"] == []
    assert state["sitecustomize"] == str(folder / "sitecustomize.py")
    assert state["package"] == str(folder / "__init__.py")  # the folder itself, not an installed copy
    assert state["hook"] is True
    assert state["targets"] == [
        "verl.trainer.ppo.core_algos",
        "verl.trainer.ppo.ray_trainer",
        "verl.trainer.ppo.v1.utils",
        "verl.trainer.ppo.v1.trainer_base",
    ]
    assert state["legacy_wrapper_file"] == str(folder / "trainer_side" / "trainer_wrappers.py")
    assert state["estimator_module"] == "nemo_gym_browser.group_stats"
    assert state["estimator_file"] == str(folder / "group_stats.py")


def test_sitecustomize_runs_the_sitecustomize_it_shadows_exactly_once(tmp_path):
    folder, hooks = recipe_folder(tmp_path), other_sitecustomize(tmp_path)
    state = run_python(STARTUP_STATE_SCRIPT, pythonpath=[folder, folder, hooks])
    assert state["sitecustomize"] == str(folder / "sitecustomize.py")
    assert state["chained"] == str(hooks / "sitecustomize.py")
    assert state["chained_mark"] == "site"
    assert state["runs"] == "1"
    assert state["hook"] is True
    assert state["heavy"] == []


def test_switch_turns_the_wiring_off_but_still_loads_the_package_and_runs_the_shadowed_sitecustomize(tmp_path):
    folder, hooks = recipe_folder(tmp_path), other_sitecustomize(tmp_path)
    state = run_python(STARTUP_STATE_SCRIPT, pythonpath=[folder, hooks], NEMO_GYM_BROWSER_PATCHES="0")
    assert state["hook"] is False
    assert state["package_loaded"] is True
    assert state["heavy"] == []
    assert state["chained_mark"] == "site"
    assert state["runs"] == "1"


def interpreters_own_sitecustomize() -> str | None:
    """The sitecustomize this Python loads by itself, if any (Debian's and Ubuntu's system Pythons ship one)."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    script = "import sys; m = sys.modules.get('sitecustomize'); print(getattr(m, '__file__', '') or '')"
    completed = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    return completed.stdout.strip() or None


def test_without_another_sitecustomize_on_the_path_only_the_interpreters_own_is_chained(tmp_path):
    folder = recipe_folder(tmp_path)
    state = run_python(STARTUP_STATE_SCRIPT, pythonpath=[folder])
    assert state["chained"] == interpreters_own_sitecustomize()
    assert state["hook"] is True


def declared_entry_point() -> str:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["entry-points"]["verl.plugins"]["nemo_gym_browser"]


def distribution_with_declared_entry_point(tmp_path: Path) -> Path:
    """The package's metadata as pip writes it from pyproject.toml, placed ahead of the installed metadata."""
    folder = tmp_path / "dist"
    info = folder / f"{DIST_NAME.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[verl.plugins]\nnemo_gym_browser = {declared_entry_point()}\n")
    return folder


@pytest.mark.parametrize("switch", ["on", "off"])
def test_verl_plugins_entry_point_installs_the_wiring_when_verl_is_imported(tmp_path, switch):
    env = {"NEMO_GYM_BROWSER_PATCHES": "0"} if switch == "off" else {}
    mode = "import-trainers" if switch == "on" else "verl-only"
    state = run_python(ENTRY_POINT_SCRIPT, mode, pythonpath=[distribution_with_declared_entry_point(tmp_path)], **env)
    # the entry point alone: the recipe's sitecustomize.py is not on the path (the interpreter's own may load)
    assert state["sitecustomize"] == interpreters_own_sitecustomize()
    if switch == "off":
        assert state["hook"] is False
    else:
        assert state["hook"] is True
        assert state["targets"] == [
            "verl.trainer.ppo.core_algos",
            "verl.trainer.ppo.ray_trainer",
            "verl.trainer.ppo.v1.utils",
            "verl.trainer.ppo.v1.trainer_base",
        ]


# A checkout on PYTHONPATH without a pip install: the editable finder of this machine's install is taken out first,
# so only what sitecustomize set up at start-up can make the package importable.
UNINSTALLED_RESOLVE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    from hydra.utils import get_class
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import get_dataset_class

    entry = OmegaConf.load(sys.argv[1])[0]
    loop_class = get_class(entry["_target_"])
    data = OmegaConf.load(sys.argv[2]).data
    dataset_class = get_dataset_class(data)
    from verl.trainer.ppo import ray_trainer
    print(json.dumps({
        "loop": f"{loop_class.__module__}.{loop_class.__qualname__}",
        "loop_file": sys.modules[loop_class.__module__].__file__,
        "dataset": f"{dataset_class.__module__}.{dataset_class.__qualname__}",
        "dataset_file": sys.modules[dataset_class.__module__].__file__,
        "hook": any(getattr(f, "nemo_gym_browser_post_import_hook", False) for f in sys.meta_path),
        "legacy_wrapper_file": ray_trainer.compute_advantage.__code__.co_filename,
    }))
    """
)


def test_the_patch_switch_off_still_lets_every_process_resolve_the_dataset_and_agent_loop_of_the_recipe(tmp_path):
    folder = recipe_folder(tmp_path)
    configs = ROOT / "configs"
    state = run_python(
        UNINSTALLED_RESOLVE_SCRIPT,
        str(configs / "agent_loop.yaml"),
        str(configs / "webvoyager_grpo.yaml"),
        pythonpath=[folder],
        NEMO_GYM_BROWSER_PATCHES="0",
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert state["loop"] == "nemo_gym_browser.browser_agent_loop.BrowserToolAgentLoop"
    assert state["loop_file"] == str(folder / "browser_agent_loop.py")
    assert state["dataset"] == "nemo_gym_browser.dataset.BrowserJSONLDataset"
    assert state["dataset_file"] == str(folder / "dataset.py")
    # only the trainer wiring is off
    assert state["hook"] is False
    assert state["legacy_wrapper_file"] != str(folder / "trainer_side" / "trainer_wrappers.py")
