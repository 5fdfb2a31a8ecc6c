"""submit_webvoyager.sh's override-building part, run as the script runs it, and the recipe composed from its output.

``script_overrides`` runs the script with ``--print-overrides`` (it reads a ``config.env``, builds the hydra overrides
and exits before starting anything); ``compose_recipe`` composes ``configs/webvoyager_grpo.yaml`` with them, as
``main_ppo`` does on the cluster. ``CPU_RUN_SETTINGS`` and ``CPU_RUN_EXPORTS`` are what a test job's ``config.env``
says to run on this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from nemo_gym_browser.local import cpu_backend

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "submit_webvoyager.sh"
EXAMPLE = REPO / "config.env.example"
CONFIG_DIR = REPO / "configs"

# A test job runs this test process's Python (.venv: verl on CPU torch), named as PYTHON: the script never picks a
# venv by itself. It exports the CPU backend's environment, VERL_PLATFORM=cpu among it, the one switch that makes the
# node check take a CPU torch.
CPU_RUN_SETTINGS = {"PYTHON": sys.executable}
CPU_RUN_EXPORTS = cpu_backend.cpu_env()


def script_overrides(config_env: Path, *extra: str, env: dict[str, str] | None = None) -> list[str]:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(config_env), "--print-overrides", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def compose_recipe(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("webvoyager_grpo", overrides=overrides)
