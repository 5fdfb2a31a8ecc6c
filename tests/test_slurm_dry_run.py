"""``sbatch submit_webvoyager.sh --dry-run`` end to end on a real single-node Slurm started on this machine.

The Slurm cluster is ``local_slurm`` (tests/slurm_fixtures.py): one node at 127.0.0.1, daemons on loopback. The
tests submit the dry run as a user would and check every step, the order of steps, and that nothing the job
started outlives it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from slurm_fixtures import (
    DRY_RUN_TIMEOUT_S,
    PORT_SEARCH_START,
    LocalSlurm,
    assert_in_order,
    assert_nothing_left,
    free_ports,
    leftover_processes,
    sbatch_wait,
    wait_for,
    write_config_env,
    write_recipe_inputs,
)

from nemo_gym_browser import preflight

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "submit_webvoyager.sh"


@pytest.fixture
def recipe_inputs(tmp_path: Path, shop_site) -> Path:
    """The test model and rows, whose start page (the Corner Shop's) the shop on this machine's loopback serves."""
    return write_recipe_inputs(tmp_path)


def write_test_config(recipe_inputs: Path, tmp_path: Path) -> tuple[int, int, Path]:
    """A config.env for one small dry run: one environment server, test model and data, free loopback ports."""
    env_port = free_ports(1, start=PORT_SEARCH_START + 2000)[0]
    ray_port = free_ports(1, start=PORT_SEARCH_START + 3000)[0]
    settings = {
        "MODEL_PATH": recipe_inputs / "model",
        "DATA_DIR": recipe_inputs / "data",
        "LOG_DIR": tmp_path / "logs",
        "TRAIN_BATCH_SIZE": 2,
        "PPO_MINI_BATCH_SIZE": 2,
        "ENV_SERVERS_PER_NODE": 1,
        "ENV_BASE_PORT": env_port,
        "RAY_PORT": ray_port,
        "JUDGE_ENABLE": 0,
    }
    return env_port, ray_port, write_config_env(tmp_path / "config.env", settings)


def test_sbatch_dry_run_brings_everything_up_on_loopback_checks_it_and_leaves_nothing_running(
    local_slurm: LocalSlurm, recipe_inputs: Path, tmp_path: Path
) -> None:
    env_port, ray_port, config_env = write_test_config(recipe_inputs, tmp_path)
    run_id = f"slurm-test-{os.getpid()}-{int(time.time())}"
    job = sbatch_wait(
        local_slurm,
        SCRIPT,
        ["--dry-run"],
        config_env=config_env,
        run_id=run_id,
        workdir=tmp_path,
        timeout_s=DRY_RUN_TIMEOUT_S,
    )
    log = job.log
    print(f"local Slurm up in {local_slurm.setup_s:.1f} s; sbatch --wait --dry-run took {job.seconds:.1f} s")

    expected = [
        f"run {run_id}: mode dry-run, 1 node(s) (localhost), recipe {REPO}",
        "config composed by verl.trainer.main_ppo --cfg job",
        f"preflight: all {len(preflight.CHECKS)} checks passed",
        f"environment servers up: 1 per node on 1 node(s), 127.0.0.1 ports {env_port}-{env_port}",
        "smoke episodes walked and verified on 1 server(s) x 1 node(s)",
        "1 of 1 start pages loaded on localhost (100%",  # the data's start page, opened from the node
        f"Ray head up at 127.0.0.1:{ray_port} (loopback)",
        "on loopback, 0 elsewhere",  # every socket this run listens on (Ray, the server, Chromium) is on loopback
        "Ray cluster: 1 of 1 node(s) joined",
        # a Ray worker sees the drop switch exported before `ray start`, the recipe and its estimator
        "preflight: ok   ray-workers: 1 node(s)",
        "NEMO_GYM_BROWSER_DROP_INVALID=0, recipe and grpo_env_aware in place",
        "settings checked inside Ray workers on every node",
        "dry run passed",
        f"cleanup: done; no process of run {run_id} is left on localhost",
    ]
    assert "cleanup: also stopping" not in log and "cleanup: killing" not in log  # each process stopped in order
    assert_in_order(log, expected)
    smoke_log = next((tmp_path / "logs").glob(f"{run_id}/smoke-localhost.log")).read_text()
    assert f"== smoke http://127.0.0.1:{env_port}" in smoke_log

    # Nothing the job started outlives it: no process carries the job's id or the run's process mark.
    assert_nothing_left(job, [env_port, ray_port])


def test_scancel_during_the_dry_run_stops_every_process_the_job_started(
    local_slurm: LocalSlurm, recipe_inputs: Path, tmp_path: Path
) -> None:
    env_port, ray_port, config_env = write_test_config(recipe_inputs, tmp_path)
    job_log = tmp_path / "job.out"
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--gpus-per-node=0",
            "--time=15",
            f"--output={job_log}",
            str(SCRIPT),
            "--dry-run",
        ],
        env={**local_slurm.env, "CONFIG_ENV": str(config_env)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]

    def read_log() -> str:
        return job_log.read_text() if job_log.exists() else ""

    # Cancel once the environment server runs and the Ray head is starting: the most processes at once.
    wait_for(lambda: "smoke episodes walked" in read_log(), DRY_RUN_TIMEOUT_S, "the smoke step", [job_log])
    time.sleep(3)
    subprocess.run(["scancel", job_id], env=local_slurm.env, check=True, timeout=30)

    def job_gone() -> bool:
        queue = subprocess.run(
            ["squeue", "-h", "-j", job_id], env=local_slurm.env, capture_output=True, text=True, timeout=30
        )
        return queue.stdout.strip() == ""

    wait_for(job_gone, 120, "the cancelled job to leave the queue", [job_log])
    log = read_log()
    assert "terminated (job cancelled or out of time)" in log
    assert "dry run passed" not in log
    assert "cleanup: killing" not in log  # everything stopped within the grace period, nothing was forced
    assert re.search(r"cleanup: done; no process of run \S+ is left on localhost", log), log[-3000:]
    left = leftover_processes(job_id, log)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
    for port in (env_port, ray_port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"
