"""``sbatch submit_webvoyager.sh`` trains for real (not ``--dry-run``) on a single-node Slurm started on this machine.

The job does what it does on a GPU cluster: checks, composes and preflights the config, starts the real nemo-gym
server with Chromium, walks a smoke episode, forms the Ray cluster, checks the settings inside a Ray worker, and then
runs ``python -m verl.trainer.main_ppo`` with the recipe's config. The only differences: ``config.env`` exports the
CPU backend's environment (``local/cpu_backend``: ``VERL_PLATFORM=cpu`` and the ``hfcpu`` rollout in place of
vLLM), the model is the warm-started tiny policy, the tasks are the Corner Shop's, and the run is two steps long.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from slurm_fixtures import (
    PORT_SEARCH_START,
    LocalSlurm,
    assert_in_order,
    assert_nothing_left,
    cpu_training_settings,
    free_ports,
    sbatch_wait,
    write_config_env,
)

from nemo_gym_browser.local import cpu_backend
from nemo_gym_browser.local.training_run import read_step_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "submit_webvoyager.sh"
STEPS = 2
# The dry run's ~1-2 minutes of checks and start-up, then main_ppo's Ray start, model load and two CPU steps.
JOB_TIMEOUT_S = 1800


def training_config(tmp_path: Path, policy: Path, rows: tuple[Path, Path]) -> tuple[Path, int, int]:
    """A config.env for a two-step CPU training job on one node, on free loopback ports."""
    env_port = free_ports(1, start=PORT_SEARCH_START + 4000)[0]
    ray_port = free_ports(1, start=PORT_SEARCH_START + 5000)[0]
    settings = {
        **cpu_training_settings(tmp_path, policy, rows, STEPS),
        "ENV_BASE_PORT": env_port,
        "RAY_PORT": ray_port,
        "EXPERIMENT_NAME": "slurm_cpu",
    }
    exports = {**cpu_backend.cpu_env(), "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl")}
    return write_config_env(tmp_path / "config.env", settings, exports), env_port, ray_port


def cpu_job_overrides() -> list[str]:
    """The CPU backend's overrides for a job whose Ray cluster the script starts (`ray start` has the resources)."""
    return [o for o in cpu_backend.cpu_overrides() if "ray_kwargs" not in o] + [
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=False",
    ]


def test_sbatch_trains_two_real_steps_with_the_recipe_and_leaves_nothing_running(
    local_slurm: LocalSlurm, shop_site, tiny_policy: Path, shop_rows: tuple[Path, Path], tmp_path: Path
) -> None:
    config_env, env_port, ray_port = training_config(tmp_path, tiny_policy, shop_rows)
    run_id = f"slurm-train-{os.getpid()}-{int(time.time())}"
    job = sbatch_wait(
        local_slurm,
        SCRIPT,
        cpu_job_overrides(),
        config_env=config_env,
        run_id=run_id,
        workdir=tmp_path,
        timeout_s=JOB_TIMEOUT_S,
    )
    print(f"sbatch --wait submit_webvoyager.sh (2 CPU training steps) took {job.seconds:.0f} s")
    assert_in_order(
        job.log,
        [
            f"run {run_id}: mode train, 1 node(s) (localhost)",
            "smoke episodes walked and verified on 1 server(s) x 1 node(s)",
            f"Ray head up at 127.0.0.1:{ray_port} (loopback)",
            "settings checked inside Ray workers on every node",
            "WARNING: VERL_PLATFORM=cpu: training on the CPU test backend",
            "training: ",
            f"cleanup: done; no process of run {run_id} is left on localhost",
        ],
    )
    assert "dry run passed" not in job.log

    # verl's own metrics: two real steps, rollouts scored by the environment's verify, the recipe's flags counted
    steps = read_step_metrics(tmp_path / "metrics.jsonl")
    assert sorted(steps) == [1, 2], job.log[-4000:]
    for metrics in steps.values():
        assert metrics["env/samples"] == 4  # TRAIN_BATCH_SIZE x ROLLOUT_N
        assert metrics["env/reward_source/verify"] == 1.0
        assert "actor/pg_loss" in metrics and "grpo_env_aware/invalid_fraction" in metrics
    checkpoints = tmp_path / "checkpoints" / "nemo_gym_browser" / "slurm_cpu"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)

    assert_nothing_left(job, [env_port, ray_port])
