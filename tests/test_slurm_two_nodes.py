"""``sbatch --nodes=2 submit_webvoyager.sh`` on two hosts: the dry run, two training steps, and the faults a second
host brings (its Ray worker never joins, one of its environment servers dies mid-run, the job is cancelled).

The cluster is ``two_node_slurm`` (tests/slurm_fixtures.py): hosts ``h1`` and ``h2`` are network namespaces on this
machine, each with its own loopback, host name and address (10.211.0.1, 10.211.0.2), one ``slurmd`` each and
``slurmctld`` on ``h1``, shared by every test of this module. Each host serves the Corner Shop and a judge on its own
loopback. The script runs unchanged: environment servers on every host's 127.0.0.1, the Ray head on ``h1``'s node
address and a Ray worker on ``h2`` joined to it. Every test ends with nothing of the job left on either host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_fixtures import (
    DRY_RUN_TIMEOUT_S,
    HOST_INTERFACE,
    HOST_JUDGE_MODEL,
    HOST_JUDGE_PORT,
    TWO_HOSTS,
    LocalSlurm,
    assert_hosts_quiet,
    assert_in_order,
    cpu_training_settings,
    firewall,
    job_state,
    leftover_processes,
    listening_pid,
    sbatch,
    sbatch_wait,
    wait_for,
    wait_until_gone,
    write_config_env,
    write_recipe_inputs,
)

from nemo_gym_browser import preflight
from nemo_gym_browser.local import cpu_backend
from nemo_gym_browser.local.training_run import read_step_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "submit_webvoyager.sh"
# Inside the hosts' namespaces nothing else listens: the script's own default ports are free on both.
ENV_PORT = 8100
RAY_PORT = 6379
# The second server on each host, the one killed on h2.
DOOMED_PORT = ENV_PORT + 1


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_recipe_inputs(tmp_path_factory.mktemp("inputs"))


def dry_run_config(recipe_inputs: Path, tmp_path: Path, **extra: object) -> Path:
    """A config.env for a two-host dry run: one server per host, a judge on every host's loopback, probed."""
    settings: dict[str, object] = {
        "MODEL_PATH": recipe_inputs / "model",
        "DATA_DIR": recipe_inputs / "data",
        "LOG_DIR": tmp_path / "logs",
        "TRAIN_BATCH_SIZE": 2,
        "PPO_MINI_BATCH_SIZE": 2,
        "ENV_SERVERS_PER_NODE": 1,
        "JUDGE_ENABLE": 1,
        "JUDGE_BASE_URL": f"http://127.0.0.1:{HOST_JUDGE_PORT}/v1",
        "JUDGE_MODEL": HOST_JUDGE_MODEL,
        "JUDGE_ON_EVERY_NODE": 1,
        "JUDGE_PROBE": 1,
        **extra,
    }
    return write_config_env(tmp_path / "config.env", settings)


def strip_colours(text: str) -> str:
    """``text`` without terminal colour codes (Ray's log colours its values)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def judge_probes(slurm: LocalSlurm) -> dict[str, int]:
    """How many model-list probes each host's own judge answered so far."""
    return {
        node: (slurm.root / "log" / f"judge-{node}.out").read_text().count(f"models {node}\n") for node in slurm.nodes
    }


def assert_nothing_left_on_either_host(slurm: LocalSlurm, job_id: str, log: str) -> None:
    """No process carries the job's id or the run's mark (both hosts share this /proc), nothing of it listens."""
    left = leftover_processes(job_id, log)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
    assert_hosts_quiet(slurm)


def test_two_node_dry_run_serves_and_smokes_on_both_hosts_joins_h2_to_the_head_and_leaves_nothing(
    two_node_slurm: LocalSlurm, recipe_inputs: Path, tmp_path: Path
) -> None:
    config_env = dry_run_config(recipe_inputs, tmp_path)
    run_id = f"two-node-dry-{os.getpid()}-{int(time.time())}"
    probes_before = judge_probes(two_node_slurm)
    job = sbatch_wait(
        two_node_slurm,
        SCRIPT,
        ["--dry-run"],
        config_env=config_env,
        run_id=run_id,
        workdir=tmp_path,
        timeout_s=DRY_RUN_TIMEOUT_S,
    )
    print(f"two-host Slurm up in {two_node_slurm.setup_s:.1f} s; sbatch --wait --dry-run took {job.seconds:.1f} s")
    assert_in_order(
        job.log,
        [
            f"run {run_id}: mode dry-run, 2 node(s) (h1 h2), recipe {REPO}",
            # what training will run, on both hosts: the test venv's CPU torch, accepted because the run says CPU
            "node-check h1: ok   torch: torch ",
            "CPU run (VERL_PLATFORM=cpu): CUDA not checked",
            "node check passed on 2 node(s)",
            f"preflight: all {len(preflight.CHECKS)} checks passed",
            f"environment servers up: 1 per node on 2 node(s), 127.0.0.1 ports {ENV_PORT}-{ENV_PORT}",
            "smoke episodes walked and verified on 1 server(s) x 2 node(s)",
            # the data's start page (the shop each host serves on its own loopback), opened from each host
            "1 of 1 start pages loaded on h1 (100%",
            "1 of 1 start pages loaded on h2 (100%",
            # Slurm's NodeAddr, not the Docker bridge `hostname -I` lists first
            "node addresses: h1=10.211.0.1 h2=10.211.0.2",
            f"Ray head up at 10.211.0.1:{RAY_PORT}",
            "Ray cluster: 2 of 2 node(s) joined",
            "preflight: ok   ray-workers: 2 node(s) (h1, h2): NEMO_GYM_BROWSER_DROP_INVALID=0, recipe and "
            f"grpo_env_aware in place; judge {HOST_JUDGE_MODEL} answers at http://127.0.0.1:{HOST_JUDGE_PORT}/v1 on "
            "every node",
            "dry run passed",
            f"cleanup: done; no process of run {run_id} is left on h1 h2\n",
        ],
    )
    assert "cleanup: also stopping" not in job.log and "cleanup: killing" not in job.log
    logs = tmp_path / "logs" / run_id
    for node in ("h1", "h2"):
        assert f"== smoke http://127.0.0.1:{ENV_PORT}" in (logs / f"smoke-{node}.log").read_text()
        assert "ready in" in (logs / f"env-{node}-{ENV_PORT}.log").read_text()
    # h2's Ray worker registered with h2's own address, at the head on h1
    worker_log = (logs / "ray-worker-h2.log").read_text()
    assert "Local node IP: 10.211.0.2" in strip_colours(worker_log), worker_log[-2000:]
    # each host's own judge answered the probe of the Ray worker on that host
    probes_after = judge_probes(two_node_slurm)
    assert all(probes_after[node] > probes_before[node] for node in ("h1", "h2")), (probes_before, probes_after)
    assert_nothing_left_on_either_host(two_node_slurm, job.job_id, job.log)


# ----- training across both hosts ---------------------------------------------------------------------------------

STEPS = 2
# Checks and start-up (~1-2 min), then main_ppo's Ray start, model load and the CPU steps.
TRAIN_TIMEOUT_S = 1800


def training_config(tmp_path: Path, policy: Path, rows: tuple[Path, Path], **extra: object) -> Path:
    """A config.env for a CPU training job on both hosts (:func:`cpu_training_settings` per host), on the script's
    own ports, with ``extra`` settings on top."""
    settings = {**cpu_training_settings(tmp_path, policy, rows, STEPS), "EXPERIMENT_NAME": "two_node_cpu", **extra}
    exports = {
        **cpu_backend.cpu_env(),
        "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl"),
        # gloo joins the two ranks over this interface (a host name resolves to 127.0.1.1 here), as NCCL_SOCKET_IFNAME
        # does on GPU nodes
        "GLOO_SOCKET_IFNAME": HOST_INTERFACE,
    }
    return write_config_env(tmp_path / "config.env", settings, exports)


def cpu_job_overrides(tmp_path: Path, steps: int = STEPS, *, validate: bool = True) -> list[str]:
    """The CPU backend's overrides for a job whose Ray cluster the script starts: ``steps`` steps, trajectories on,
    and the final validation (the held-back tasks) unless not ``validate``. The backend's one-node
    ``trainer.nnodes=1`` is left out: the script's ``trainer.nnodes=2`` stands, one actor rank per host."""
    kept = [o for o in cpu_backend.cpu_overrides() if "ray_kwargs" not in o and not o.startswith("trainer.nnodes=")]
    return [
        *kept,
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        f"nemo_gym_browser.trajectory_dir={tmp_path / 'trajectories'}",
        *([] if validate else ["trainer.test_freq=-1"]),
    ]


def episodes_by_host(trajectories: Path, step: int) -> dict[str, list[dict]]:
    """The episodes recorded in training step ``step``, by the host whose agent-loop worker ran it
    (``step-<step>/<host>-<pid>.jsonl``); the last step's folder also holds the final validation's."""
    found: dict[str, list[dict]] = {}
    for path in sorted(trajectories.glob(f"step-{step:06d}/*.jsonl")):
        host = path.name.rsplit("-", 1)[0]
        found.setdefault(host, []).extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return found


def test_two_node_sbatch_trains_two_steps_on_both_hosts_each_on_its_own_servers_and_outlives_one_of_h2s_servers(
    two_node_slurm: LocalSlurm, tiny_policy: Path, shop_rows: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two training steps, validated, on two servers a host; once the trainer starts, h2's second server dies
    (SIGKILL, no goodbye): h2's episodes on it are run again on h2's live server and training goes on."""
    config_env = training_config(tmp_path, tiny_policy, shop_rows, ENV_SERVERS_PER_NODE=2)
    run_id = f"two-node-train-{os.getpid()}-{int(time.time())}"
    job_id, job_log = sbatch(
        two_node_slurm, SCRIPT, cpu_job_overrides(tmp_path), config_env=config_env, run_id=run_id, workdir=tmp_path
    )
    started = time.monotonic()
    wait_for(lambda: "training: " in read(job_log), DRY_RUN_TIMEOUT_S, "the training step", [job_log])
    os.kill(listening_pid(two_node_slurm, "h2", DOOMED_PORT), signal.SIGKILL)
    wait_until_gone(two_node_slurm, job_id, TRAIN_TIMEOUT_S, [job_log])
    log = read(job_log)
    print(f"2-step two-host run with h2's second server killed took {time.monotonic() - started:.0f} s")
    state = job_state(two_node_slurm, job_id)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, log[-6000:]
    assert_in_order(
        log,
        [
            f"run {run_id}: mode train, 2 node(s) (h1 h2)",
            "smoke episodes walked and verified on 2 server(s) x 2 node(s)",
            f"Ray head up at 10.211.0.1:{RAY_PORT}",
            "Ray cluster: 2 of 2 node(s) joined",
            "settings checked inside Ray workers on every node",
            "WARNING: VERL_PLATFORM=cpu: training on the CPU test backend",
            "training: ",
            f"cleanup: done; no process of run {run_id} is left on h1 h2\n",
        ],
    )
    # verl's actor workers: one rank on each host, trained together (FSDP over gloo between the hosts)
    actors = set(re.findall(r"\(WorkerDict pid=(\d+)(?:, ip=(10\.211\.0\.2))?\)", log))
    assert sorted({address or "10.211.0.1" for _, address in actors}) == ["10.211.0.1", "10.211.0.2"], actors
    steps = read_step_metrics(tmp_path / "metrics.jsonl")
    assert sorted(steps) == [1, 2], log[-4000:]
    for metrics in steps.values():
        assert metrics["env/samples"] == 4  # TRAIN_BATCH_SIZE x ROLLOUT_N
        assert metrics["env/reward_source/verify"] == 1.0
        assert "actor/pg_loss" in metrics and "grpo_env_aware/invalid_fraction" in metrics
    checkpoints = tmp_path / "checkpoints" / "nemo_gym_browser" / "two_node_cpu"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)

    # An agent-loop worker on each host ran episodes; its 127.0.0.1 servers are that host's own (nothing else is
    # reachable there), and every episode was scored by the environment's verify.
    for step in range(1, STEPS + 1):
        episodes = episodes_by_host(tmp_path / "trajectories", step)
        assert sorted(episodes) == ["h1", "h2"], (step, sorted(episodes))
        for records in episodes.values():
            assert all(record["flags"]["reward_source"] == "verify" for record in records), records[0]["flags"]
            assert all(record["flags"]["env_invalid"] is False for record in records), [r["flags"] for r in records]
        # h1's servers are not h2's: nothing failed there
        assert not any(record["failed_attempt_kinds"] for record in episodes["h1"]), step
    first = episodes_by_host(tmp_path / "trajectories", 1)
    assert sum(len(records) for records in first.values()) == 4
    # h2: an episode on the dead server failed as infrastructure and was resumed, or run again, on h2's live server
    repaired = [record for record in first["h2"] if record["failed_attempt_kinds"] or record["resumed_kinds"]]
    assert repaired, [record["flags"] for record in first["h2"]]
    for record in repaired:
        kinds = {*record["failed_attempt_kinds"], *record["resumed_kinds"]}
        assert kinds <= {"unreachable", "session_lost", "server_error"}, record
        assert record["flags"]["attempts"] == len(record["failed_attempt_kinds"]) + 1
    # h2's own agent-loop worker saw its server go and took it out of rotation
    assert re.search(rf"ip=10\.211\.0\.2\).*environment server http://127\.0\.0\.1:{DOOMED_PORT} out of rotation", log)
    assert_nothing_left_on_either_host(two_node_slurm, job_id, log)


# ----- what a second host brings: faults ----------------------------------------------------------------------------

# Long enough for a healthy worker to join on this loaded machine (~10 s), short enough to keep the test cheap.
WORKER_JOIN_TIMEOUT_S = 40
# Into main_ppo: its workers are up on both hosts by then.
CANCEL_AFTER_S = 30


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_when_h2s_ray_worker_cannot_reach_the_head_the_job_fails_within_the_bounded_wait_and_stops_everything(
    two_node_slurm: LocalSlurm, recipe_inputs: Path, tmp_path: Path
) -> None:
    config_env = dry_run_config(recipe_inputs, tmp_path, RAY_WORKERS_TIMEOUT_S=WORKER_JOIN_TIMEOUT_S)
    run_id = f"two-node-nojoin-{os.getpid()}-{int(time.time())}"
    # h2 can reach h1 (Slurm, srun) but not the Ray head's port: its worker starts and never joins.
    with firewall(two_node_slurm, "h2", TWO_HOSTS["h1"], RAY_PORT):
        job = sbatch_wait(
            two_node_slurm,
            SCRIPT,
            ["--dry-run"],
            config_env=config_env,
            run_id=run_id,
            workdir=tmp_path,
            timeout_s=DRY_RUN_TIMEOUT_S,
            expect_failure=True,
        )
    print(f"sbatch --wait --dry-run with h2 firewalled from the Ray head took {job.seconds:.1f} s")
    assert_in_order(
        job.log,
        [
            "smoke episodes walked and verified on 1 server(s) x 2 node(s)",
            f"Ray head up at 10.211.0.1:{RAY_PORT}",
            f"ERROR: only 1 of 2 Ray nodes joined the head at 10.211.0.1:{RAY_PORT} within {WORKER_JOIN_TIMEOUT_S} s; "
            "workers started on h2",
            "cleanup: stopping",
            f"cleanup: done; no process of run {run_id} is left on h1 h2\n",
        ],
    )
    assert "settings checked inside Ray workers" not in job.log and "dry run passed" not in job.log
    assert "cleanup: killing" not in job.log  # everything stopped when asked, within the grace period
    assert_nothing_left_on_either_host(two_node_slurm, job.job_id, job.log)


def test_scancel_mid_run_stops_every_process_on_both_hosts(
    two_node_slurm: LocalSlurm, tiny_policy: Path, shop_rows: tuple[Path, Path], tmp_path: Path
) -> None:
    config_env = training_config(tmp_path, tiny_policy, shop_rows)
    run_id = f"two-node-cancel-{os.getpid()}-{int(time.time())}"
    overrides = cpu_job_overrides(tmp_path, validate=False)
    job_id, job_log = sbatch(two_node_slurm, SCRIPT, overrides, config_env=config_env, run_id=run_id, workdir=tmp_path)
    started = time.monotonic()
    # Cancel while the trainer runs: servers, Ray and verl's workers on both hosts.
    wait_for(lambda: "training: " in read(job_log), DRY_RUN_TIMEOUT_S, "the training step", [job_log])
    time.sleep(CANCEL_AFTER_S)
    subprocess.run(two_node_slurm.command("scancel", job_id), env=two_node_slurm.env, check=True, timeout=30)
    wait_until_gone(two_node_slurm, job_id, 180, [job_log])
    log = read(job_log)
    print(f"two-host training cancelled {CANCEL_AFTER_S} s into main_ppo; {time.monotonic() - started:.0f} s in all")
    assert "terminated (job cancelled or out of time)" in log, log[-3000:]
    assert "cleanup: killing" not in log  # everything stopped within the grace period, nothing was forced
    assert re.search(rf"cleanup: done; no process of run {run_id} is left on h1", log), log[-3000:]
    assert_nothing_left_on_either_host(two_node_slurm, job_id, log)


# ----- the web from the hosts ---------------------------------------------------------------------------------------

# Three of WebVoyager's sites. The hosts' namespaces route nothing beyond their own /24: like nodes without web access,
# they cannot resolve or reach these (and no packet leaves this machine).
TASK_SITES = ("https://www.allrecipes.com/", "https://www.amazon.com/", "https://github.com/")


def test_when_the_hosts_have_no_route_to_the_task_sites_the_dry_run_reports_0_of_n_start_pages_and_stops_before_ray(
    two_node_slurm: LocalSlurm, tmp_path: Path
) -> None:
    (tmp_path / "inputs").mkdir()
    inputs = write_recipe_inputs(tmp_path / "inputs", start_urls=TASK_SITES)
    config_env = dry_run_config(inputs, tmp_path)
    run_id = f"two-node-noweb-{os.getpid()}-{int(time.time())}"
    job = sbatch_wait(
        two_node_slurm,
        SCRIPT,
        ["--dry-run"],
        config_env=config_env,
        run_id=run_id,
        workdir=tmp_path,
        timeout_s=DRY_RUN_TIMEOUT_S,
        expect_failure=True,
    )
    print(f"sbatch --wait --dry-run with no route to the task sites took {job.seconds:.1f} s")
    assert_in_order(
        job.log,
        [
            "smoke episodes walked and verified on 1 server(s) x 2 node(s)",
            "proxy for the environment server and its Chromium on h1: none",
            "0 of 3 start pages loaded on h1 (0%; at least 50% required): too few",
            "proxy for the environment server and its Chromium on h2: none",
            "0 of 3 start pages loaded on h2 (0%; at least 50% required): too few",
            "ERROR: too few of the data's start pages loaded on h1 h2 (START_PAGE_MIN_SHARE=0.5): the node(s) may have "
            "no route to the task sites, or need a proxy that is not set",
            f"cleanup: done; no process of run {run_id} is left on h1 h2\n",
        ],
    )
    # training would have stopped at the same step: it comes before Ray and the trainer, in every mode
    assert "Ray head up" not in job.log and "dry run passed" not in job.log
    for node in ("h1", "h2"):
        pages = read(tmp_path / "logs" / run_id / f"start-pages-{node}.log")
        for site in TASK_SITES:  # each page, with the server's own message
            assert re.search(
                rf"^  FAIL  {re.escape(site)} .*/seed_session answered HTTP 500: .*net::ERR_", pages, re.M
            ), pages
        assert "likely cause: this node may have no route to the task sites" in pages
    assert_nothing_left_on_either_host(two_node_slurm, job.job_id, job.log)


# ----- what training will run, checked on every host -----------------------------------------------------------------


def test_a_dry_run_whose_default_python_has_cpu_torch_fails_on_both_hosts_before_anything_starts_naming_the_fix(
    two_node_slurm: LocalSlurm, recipe_inputs: Path, tmp_path: Path
) -> None:
    # No PYTHON and no VERL_PLATFORM=cpu: the job runs python3 from PATH, where this test venv (verl 0.9.1 on a CPU
    # torch, what rehearse.sh and test.sh build in the recipe folder) comes first.
    venv_bin = Path(sys.executable).parent
    settings = {
        "MODEL_PATH": recipe_inputs / "model",
        "DATA_DIR": recipe_inputs / "data",
        "LOG_DIR": tmp_path / "logs",
        "TRAIN_BATCH_SIZE": 2,
        "PPO_MINI_BATCH_SIZE": 2,
        "ENV_SERVERS_PER_NODE": 1,
        "JUDGE_ENABLE": 0,
    }
    exports = {"PATH": f"{venv_bin}:$PATH"}
    config_env = write_config_env(tmp_path / "config.env", settings, exports, cpu_run=False)
    run_id = f"two-node-cpu-torch-{os.getpid()}-{int(time.time())}"
    job = sbatch_wait(
        two_node_slurm,
        SCRIPT,
        ["--dry-run"],
        config_env=config_env,
        run_id=run_id,
        workdir=tmp_path,
        timeout_s=DRY_RUN_TIMEOUT_S,
        expect_failure=True,
    )
    print(f"sbatch --wait --dry-run with a CPU torch as the default Python took {job.seconds:.1f} s")
    fix = "fix: set PYTHON in config.env to a Python whose torch is a CUDA build (the same path on every node)"
    for node in ("h1", "h2"):
        (line,) = [line for line in job.log.splitlines() if line.startswith(f"node-check {node}: FAIL torch: ")]
        assert f"in {venv_bin}/python3 is not a CUDA build (torch.version.cuda is None); {fix}" in line, line
        assert f"node-check {node}: ok   chromium: /usr/bin/chromium: Chromium " in job.log
        assert f"node-check {node}: ok   gym-venv: {REPO}/.venv-gym: nemo-gym 0.7.0 imports" in job.log
    assert_in_order(
        job.log,
        [
            f"run {run_id}: mode dry-run, 2 node(s) (h1 h2)",
            "check: config.env, model, data files",
            "ERROR: the node check failed on h1 h2: each FAIL line above names the fix",
            "cleanup: stopping 0 process(es) started by this job (exit status 1)",
            f"cleanup: done; no process of run {run_id} is left on h1 h2\n",
        ],
    )
    # it stopped before the expensive steps: nothing composed, no server, no Ray
    assert "config composed" not in job.log and "environment servers up" not in job.log
    assert "Ray head up" not in job.log
    assert_nothing_left_on_either_host(two_node_slurm, job.job_id, job.log)
