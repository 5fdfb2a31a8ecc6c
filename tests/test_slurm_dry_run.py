"""``sbatch submit_webvoyager.sh --dry-run`` end to end on a real single-node Slurm started on this machine.

The test starts MUNGE and Slurm 22.05 (Debian's ``munge``, ``slurmctld``, ``slurmd``; ``scripts/setup_slurm.sh``
installs them) with a ``slurm.conf`` it writes to a temporary folder: one node ``localhost`` at 127.0.0.1, every
daemon bound to loopback (``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``), MUNGE on a private socket. It
submits the dry run as a user would, then stops the three daemons it started, by PID.

``ProctrackType=proctrack/pgid``: Slurm then cleans up only the job's own process group at the end of a job, so a
process the script started in a session of its own and failed to stop (a Chromium, a Ray daemon) stays visible to
the leak check below instead of being swept away by Slurm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemo_gym_browser.prepare_webvoyager_data import main as prepare_data
from nemo_gym_browser.testing.tokenizer import save_test_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "submit_webvoyager.sh"
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")
# Daemons start in a second or two; a loaded 2-core machine can take several times that.
DAEMON_START_TIMEOUT_S = 60
# The dry run composes the config (~15 s), runs preflight (~15 s), starts a server (~10 s) and Ray (~15 s).
DRY_RUN_TIMEOUT_S = 600
STOP_TIMEOUT_S = 20
# Ray's own port ranges are 10000-20000: the test's ports stay above them.
PORT_SEARCH_START = 30000


def free_ports(count: int, start: int = PORT_SEARCH_START) -> list[int]:
    """``count`` consecutive loopback ports that are free right now."""
    port = start
    while port < 60000:
        block = list(range(port, port + count))
        try:
            for candidate in block:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            port += count
            continue
        return block
    raise RuntimeError("no free port block")


def processes_with_environ(entry: str) -> list[int]:
    """PIDs whose environment holds ``entry`` (``KEY=value``)."""
    found = []
    needle = entry.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@dataclass(frozen=True)
class LocalSlurm:
    root: Path
    env: dict[str, str]
    setup_s: float


def _wait_for(predicate, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:] if log.exists() else '(none)'}" for log in logs)
            raise AssertionError(f"{what} not ready within {timeout_s} s\n{tails}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def local_slurm() -> Iterator[LocalSlurm]:
    missing = [name for name in SLURM_BINARIES if shutil.which(name) is None]
    assert not missing, f"{missing} not installed: run `bash scripts/setup_slurm.sh` (CI does, via scripts/test.sh)"
    started = time.monotonic()
    # Short path: the MUNGE socket and Slurm's spool paths must stay well below the 108-byte socket path limit.
    root = Path(tempfile.mkdtemp(prefix="ngb-slurm-", dir="/tmp"))
    root.chmod(0o755)  # munged refuses a socket folder that others cannot traverse
    for name in ("state", "spool", "log"):
        (root / name).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    ctld_port, slurmd_port = free_ports(2)
    srun_ports = free_ports(100, start=ctld_port + 10)
    (root / "slurm.conf").write_text(
        f"""\
ClusterName=ngbtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SrunPortRange={srun_ports[0]}-{srun_ports[-1]}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
InactiveLimit=0
KillWait=30
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={os.cpu_count()} RealMemory=2000 State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=UNLIMITED State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        daemons.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    f"--key-file={key}",
                    f"--socket={root}/munge.socket",
                    f"--pid-file={root}/munged.pid",
                    f"--log-file={root}/log/munged.log",
                    f"--seed-file={root}/munged.seed",
                ],
                stdout=subprocess.DEVNULL,
                stderr=(root / "log" / "munged.out").open("wb"),
            )
        )
        munge_logs = [root / "log" / "munged.log", root / "log" / "munged.out"]
        _wait_for((root / "munge.socket").exists, DAEMON_START_TIMEOUT_S, "munged", munge_logs)
        for command in (["slurmctld", "-D"], ["slurmd", "-D", "-N", "localhost"]):
            out = (root / "log" / f"{command[0]}.out").open("wb")
            daemons.append(subprocess.Popen([*command, "-f", env["SLURM_CONF"]], env=env, stdout=out, stderr=out))

        def node_idle() -> bool:
            state = subprocess.run(
                ["sinfo", "-h", "-n", "localhost", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
            )
            return state.stdout.strip() == "idle"

        logs = [root / "log" / name for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out")]
        _wait_for(node_idle, DAEMON_START_TIMEOUT_S, "the Slurm node", logs)
        yield LocalSlurm(root=root, env=env, setup_s=time.monotonic() - started)
    finally:
        # A test that failed half-way may leave a job running: cancel it while the daemons can still end it.
        if len(daemons) == 3:
            subprocess.run(["scancel", "--partition=local"], env=env, capture_output=True, timeout=30)
            deadline = time.monotonic() + STOP_TIMEOUT_S * 3
            while time.monotonic() < deadline:
                queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(1)
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=STOP_TIMEOUT_S)
        # Anything this private cluster started (a step daemon, a job's process) carries its SLURM_CONF.
        for pid in processes_with_environ(f"SLURM_CONF={root / 'slurm.conf'}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def recipe_inputs(tmp_path: Path) -> Path:
    save_test_model(tmp_path / "model")
    tasks = tmp_path / "tasks.jsonl"
    questions = ["What is the heading of the page?", "Report the page title.", "Summarise the page."]
    # JUDGE_ENABLE=0 below: every task carries verifier_metadata, or the checks stop the run (nothing could score it).
    task = {"web_name": "Example", "web": "https://example.org/", "verifier_metadata": {"url_contains": "example.org"}}
    tasks.write_text(
        "".join(json.dumps({**task, "id": f"Example--{i}", "ques": q}) + "\n" for i, q in enumerate(questions * 2))
    )
    assert prepare_data(["--input", str(tasks), "--output-dir", str(tmp_path / "data"), "--val-fraction", "0.34"]) == 0
    return tmp_path


def write_test_config(recipe_inputs: Path, tmp_path: Path) -> tuple[int, int, Path]:
    """A config.env for one small dry run: one environment server, test model and data, free loopback ports."""
    env_port = free_ports(1, start=PORT_SEARCH_START + 2000)[0]
    ray_port = free_ports(1, start=PORT_SEARCH_START + 3000)[0]
    config_env = tmp_path / "config.env"
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
    config_env.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
    return env_port, ray_port, config_env


def leftover_processes(job_id: str, log: str) -> list[int]:
    """Processes that carry the job's id or the run's process mark, after a bounded wait for them to go."""
    mark = re.search(r"carries (NEMO_GYM_BROWSER_PROCESS_MARK=\S+)", log)
    assert mark, "the script did not log its process mark"
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while True:
        left = processes_with_environ(f"SLURM_JOB_ID={job_id}") + processes_with_environ(mark.group(1))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def test_sbatch_dry_run_brings_everything_up_on_loopback_checks_it_and_leaves_nothing_running(
    local_slurm: LocalSlurm, recipe_inputs: Path, tmp_path: Path
) -> None:
    env_port, ray_port, config_env = write_test_config(recipe_inputs, tmp_path)
    run_id = f"slurm-test-{os.getpid()}-{int(time.time())}"
    job_log = tmp_path / "job.out"
    started = time.monotonic()
    submitted = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--nodes=1",
            "--gpus-per-node=0",  # the header asks for 8; a dry run needs none
            "--time=15",
            f"--output={job_log}",
            str(SCRIPT),
            "--dry-run",
        ],
        env={**local_slurm.env, "CONFIG_ENV": str(config_env), "NEMO_GYM_BROWSER_RUN_ID": run_id},
        cwd=tmp_path,  # not the recipe folder: the script must find it by itself
        capture_output=True,
        text=True,
        timeout=DRY_RUN_TIMEOUT_S,
    )
    dry_run_s = time.monotonic() - started
    log = job_log.read_text() if job_log.exists() else ""
    assert submitted.returncode == 0, (
        f"sbatch exit {submitted.returncode}\nstdout: {submitted.stdout}\nstderr: {submitted.stderr}\n"
        f"job log:\n{log[-6000:]}"
    )
    job_id = submitted.stdout.strip().split(";")[0]
    print(f"local Slurm up in {local_slurm.setup_s:.1f} s; sbatch --wait --dry-run took {dry_run_s:.1f} s")

    state = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], env=local_slurm.env, capture_output=True, text=True, timeout=30
    ).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state

    expected = [
        f"run {run_id}: mode dry-run, 1 node(s) (localhost), recipe {REPO}",
        "config composed by verl.trainer.main_ppo --cfg job",
        "preflight: all 9 checks passed",
        f"environment servers up: 1 per node on 1 node(s), 127.0.0.1 ports {env_port}-{env_port}",
        "smoke episodes walked and verified on 1 server(s) x 1 node(s)",
        f"Ray head up at 127.0.0.1:{ray_port} (loopback)",
        "on loopback, 0 elsewhere",  # every socket this run listens on (Ray, the server, Chromium) is on loopback
        "Ray cluster: 1 of 1 node(s) joined",
        # a Ray worker sees the drop switch exported before `ray start`, the recipe and its estimator
        "preflight: ok   ray-workers: 1 node(s)",
        "NEMO_GYM_BROWSER_DROP_INVALID=1, recipe and grpo_env_aware in place",
        "settings checked inside Ray workers on every node",
        "dry run passed",
        f"cleanup: done; no process of run {run_id} is left on localhost",
    ]
    assert "cleanup: also stopping" not in log and "cleanup: killing" not in log  # each process stopped in order
    positions = [log.find(line) for line in expected]
    assert all(position >= 0 for position in positions), [e for e, p in zip(expected, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "the steps ran out of order"
    smoke_log = next((tmp_path / "logs").glob(f"{run_id}/smoke-localhost.log")).read_text()
    assert f"== smoke http://127.0.0.1:{env_port}" in smoke_log

    # Nothing the job started outlives it: no process carries the job's id or the run's process mark.
    left = leftover_processes(job_id, log)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
    for port in (env_port, ray_port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"


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
    _wait_for(lambda: "smoke episodes walked" in read_log(), DRY_RUN_TIMEOUT_S, "the smoke step", [job_log])
    time.sleep(3)
    subprocess.run(["scancel", job_id], env=local_slurm.env, check=True, timeout=30)

    def job_gone() -> bool:
        queue = subprocess.run(
            ["squeue", "-h", "-j", job_id], env=local_slurm.env, capture_output=True, text=True, timeout=30
        )
        return queue.stdout.strip() == ""

    _wait_for(job_gone, 120, "the cancelled job to leave the queue", [job_log])
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
