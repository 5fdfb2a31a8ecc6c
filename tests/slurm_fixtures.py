"""A real single-node Slurm on this machine for the integration tier, shared by the ``sbatch`` tests.

``local_slurm`` starts MUNGE and Slurm 22.05 (Debian's ``munge``, ``slurmctld``, ``slurmd``; ``scripts/setup_slurm.sh``
installs them) with a ``slurm.conf`` it writes to a temporary folder: one node ``localhost`` at 127.0.0.1, every
daemon bound to loopback (``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``), MUNGE on a private socket. At the
end of the module it cancels what is still queued and stops the three daemons it started, by PID.

``ProctrackType=proctrack/pgid``: Slurm then cleans up only the job's own process group at the end of a job, so a
process the script started in a session of its own and failed to stop (a Chromium, a Ray daemon) stays visible to
the leak check (:func:`leftover_processes`) instead of being swept away by Slurm.

Registered as a pytest plugin from ``tests/conftest.py``; the helpers are imported by the test modules.
"""

from __future__ import annotations

import contextlib
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


def wait_for(predicate, timeout_s: float, what: str, logs: list[Path]) -> None:
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
        wait_for((root / "munge.socket").exists, DAEMON_START_TIMEOUT_S, "munged", munge_logs)
        for command in (["slurmctld", "-D"], ["slurmd", "-D", "-N", "localhost"]):
            out = (root / "log" / f"{command[0]}.out").open("wb")
            daemons.append(subprocess.Popen([*command, "-f", env["SLURM_CONF"]], env=env, stdout=out, stderr=out))

        def node_idle() -> bool:
            state = subprocess.run(
                ["sinfo", "-h", "-n", "localhost", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
            )
            return state.stdout.strip() == "idle"

        logs = [root / "log" / name for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out")]
        wait_for(node_idle, DAEMON_START_TIMEOUT_S, "the Slurm node", logs)
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


@dataclass(frozen=True)
class FinishedJob:
    job_id: str
    log: str
    seconds: float


def sbatch_wait(
    slurm: LocalSlurm, script: Path, args: list[str], *, config_env: Path, run_id: str, workdir: Path, timeout_s: float
) -> FinishedJob:
    """``sbatch --wait`` the script on one node without GPUs, from ``workdir``; fails unless it COMPLETED with 0."""
    job_log = workdir / "job.out"
    started = time.monotonic()
    submitted = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--nodes=1",
            "--gpus-per-node=0",
            "--time=30",
            f"--output={job_log}",
            str(script),
            *args,
        ],
        env={**slurm.env, "CONFIG_ENV": str(config_env), "NEMO_GYM_BROWSER_RUN_ID": run_id},
        cwd=workdir,  # not the recipe folder: the script must find it by itself
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    seconds = time.monotonic() - started
    log = job_log.read_text() if job_log.exists() else ""
    assert submitted.returncode == 0, (
        f"sbatch exit {submitted.returncode}\nstdout: {submitted.stdout}\nstderr: {submitted.stderr}\n"
        f"job log:\n{log[-8000:]}"
    )
    job_id = submitted.stdout.strip().split(";")[0]
    state = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], env=slurm.env, capture_output=True, text=True, timeout=30
    ).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
    return FinishedJob(job_id, log, seconds)


def assert_in_order(log: str, expected: list[str]) -> None:
    """Every expected line is in the job's log, in this order."""
    positions = [log.find(line) for line in expected]
    assert all(position >= 0 for position in positions), [e for e, p in zip(expected, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "the steps ran out of order"


def assert_nothing_left(job: FinishedJob, ports: list[int]) -> None:
    """No process carries the job's id or the run's mark, and nothing listens on the run's ports any more."""
    left = leftover_processes(job.job_id, job.log)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"
