"""A real single-node Slurm on this machine for the integration tier, shared by the ``sbatch`` tests.

``local_slurm`` starts MUNGE and Slurm 22.05 (Debian's ``munge``, ``slurmctld``, ``slurmd``; ``scripts/setup_slurm.sh``
installs them) with a ``slurm.conf`` it writes to a temporary folder: one node ``localhost`` at 127.0.0.1, every
daemon bound to loopback (``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``), MUNGE on a private socket. At the
end of the module it cancels what is still queued and stops the three daemons it started, by PID.

``ProctrackType=proctrack/pgid``: Slurm then cleans up only the job's own process group at the end of a job, so a
process the script started in a session of its own and failed to stop (a Chromium, a Ray daemon) stays visible to
the leak check (:func:`leftover_processes`) instead of being swept away by Slurm.

``two_node_slurm`` is the same Slurm on two hosts this machine pretends to be: two network namespaces joined by a
veth pair (10.211.0.1/24 and 10.211.0.2/24 exist only inside them), each with its own loopback, its own host name (a
UTS namespace), Debian's hosts file (its own name on 127.0.1.1, no other host) and, as on many real nodes, a Docker
bridge at 172.17.0.1 that ``hostname -I`` lists first: a node's address comes from Slurm's NodeAddr or nowhere.
``slurmctld`` and the ``slurmd`` of ``h1`` run in the first, the ``slurmd`` of ``h2`` in the second;
MUNGE (a path socket) and the file system are shared, as on a cluster with a shared home. A server on 127.0.0.1 in
one namespace is invisible from the other: exactly the per-node loopback the script relies on. Each host also serves
the Corner Shop (the task files name ``127.0.0.1:8765``) and a judge (``tests/host_judge.py``) on its own loopback.
At the end of the module it cancels what is queued, stops every process it started by PID and deletes both
namespaces.

Registered as a pytest plugin from ``tests/conftest.py``; the helpers are imported by the test modules.
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
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from submit_fixtures import CPU_RUN_EXPORTS, CPU_RUN_SETTINGS

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
    """A running private Slurm: its folder, the environment its commands need, and how to reach its hosts.

    ``namespaces`` maps a node name to the network namespace it runs in (empty for the loopback cluster), and
    ``client_prefix`` is what a client command (sbatch, squeue, scancel) needs in front to reach ``slurmctld``.
    """

    root: Path
    env: dict[str, str]
    setup_s: float
    nodes: tuple[str, ...] = ("localhost",)
    namespaces: dict[str, str] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    client_prefix: tuple[str, ...] = ()

    def command(self, *argv: str) -> list[str]:
        """``argv`` run where the cluster's clients run (inside the first host's namespace, if any)."""
        return [*self.client_prefix, *argv]

    def on_host(self, node: str, *argv: str) -> list[str]:
        """``argv`` run inside ``node``'s network namespace (as is, for the loopback cluster)."""
        namespace = self.namespaces.get(node)
        return ["ip", "netns", "exec", namespace, *argv] if namespace else list(argv)


def wait_for(predicate, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:] if log.exists() else '(none)'}" for log in logs)
            raise AssertionError(f"{what} not ready within {timeout_s} s\n{tails}")
        time.sleep(0.5)


def require_slurm() -> None:
    """Fails (never skips) when a Slurm or MUNGE command is missing: CI's set-up installs them."""
    missing = [name for name in SLURM_BINARIES if shutil.which(name) is None]
    assert not missing, f"{missing} not installed: run `bash scripts/setup_slurm.sh` (CI does, via scripts/test.sh)"


def new_cluster_folder() -> Path:
    """A fresh folder for one private cluster: state, spool and log folders and a MUNGE key of its own."""
    # Short path: the MUNGE socket and Slurm's spool paths must stay well below the 108-byte socket path limit.
    root = Path(tempfile.mkdtemp(prefix="ngb-slurm-", dir="/tmp"))
    root.chmod(0o755)  # munged refuses a socket folder that others cannot traverse
    for name in ("state", "spool", "log"):
        (root / name).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    return root


def common_slurm_conf(root: Path) -> str:
    """The slurm.conf lines both private clusters share: MUNGE on the folder's socket, no accounting, pgid tracking."""
    return f"""\
ClusterName=ngbtest
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/log/slurmctld.log
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
"""


def start_munged(root: Path) -> subprocess.Popen[bytes]:
    """MUNGE with the folder's key on a path socket (reachable from every network namespace), once it answers."""
    munged = subprocess.Popen(
        [
            "munged",
            "--foreground",
            f"--key-file={root / 'munge.key'}",
            f"--socket={root}/munge.socket",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/log/munged.log",
            f"--seed-file={root}/munged.seed",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(root / "log" / "munged.out").open("wb"),
    )
    munge_logs = [root / "log" / "munged.log", root / "log" / "munged.out"]
    wait_for((root / "munge.socket").exists, DAEMON_START_TIMEOUT_S, "munged", munge_logs)
    return munged


def wait_until_idle(slurm: LocalSlurm, logs: list[Path]) -> None:
    """Returns once every node of the cluster is registered and idle."""

    def all_idle() -> bool:
        state = subprocess.run(
            slurm.command("sinfo", "-h", "-N", "-o", "%N %T"), env=slurm.env, capture_output=True, text=True, timeout=30
        )
        states = dict(line.split() for line in state.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in slurm.nodes)

    wait_for(all_idle, DAEMON_START_TIMEOUT_S, f"the Slurm node(s) {', '.join(slurm.nodes)}", logs)


def stop_cluster(slurm: LocalSlurm, daemons: list[subprocess.Popen[bytes]], *, running: bool) -> None:
    """Cancels what is queued (while the daemons can still end it), then stops the daemons newest first, by PID."""
    if running:
        subprocess.run(slurm.command("scancel", "--partition=local"), env=slurm.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + STOP_TIMEOUT_S * 3
        while time.monotonic() < deadline:
            queue = subprocess.run(
                slurm.command("squeue", "-h"), env=slurm.env, capture_output=True, text=True, timeout=30
            )
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
    for pid in processes_with_environ(f"SLURM_CONF={slurm.root / 'slurm.conf'}"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def local_slurm() -> Iterator[LocalSlurm]:
    require_slurm()
    started = time.monotonic()
    root = new_cluster_folder()
    ctld_port, slurmd_port = free_ports(2)
    srun_ports = free_ports(100, start=ctld_port + 10)
    (root / "slurm.conf").write_text(
        common_slurm_conf(root)
        + f"""\
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SrunPortRange={srun_ports[0]}-{srun_ports[-1]}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmdSpoolDir={root}/spool
SlurmdPidFile={root}/slurmd.pid
SlurmdLogFile={root}/log/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={os.cpu_count()} RealMemory=2000 State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=UNLIMITED State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    slurm = LocalSlurm(root=root, env=env, setup_s=0.0)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        daemons.append(start_munged(root))
        for command in (["slurmctld", "-D"], ["slurmd", "-D", "-N", "localhost"]):
            out = (root / "log" / f"{command[0]}.out").open("wb")
            daemons.append(subprocess.Popen([*command, "-f", env["SLURM_CONF"]], env=env, stdout=out, stderr=out))
        logs = [root / "log" / name for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out")]
        wait_until_idle(slurm, logs)
        yield LocalSlurm(root=root, env=env, setup_s=time.monotonic() - started)
    finally:
        stop_cluster(slurm, daemons, running=len(daemons) == 3)
        shutil.rmtree(root, ignore_errors=True)


# ----- two hosts: network namespaces on this machine -------------------------------------------------------------

# The two hosts and their addresses; the /24 exists only inside the two namespaces.
TWO_HOSTS = {"h1": "10.211.0.1", "h2": "10.211.0.2"}
HOST_PREFIX_LENGTH = 24
# The same interface name on both hosts, so a setting that names it (GLOO_SOCKET_IFNAME) is right on each.
HOST_INTERFACE = "ngb0"
# Slurm's ports inside the namespaces: nothing else lives there, so its defaults are free.
TWO_HOST_CTLD_PORT = 6817
TWO_HOST_SLURMD_PORT = 6818
# srun listens on ports of this range; it stays below the kernel's ephemeral range (32768-60999 by default), from
# which every outgoing connection takes its local port: a range inside it was once all taken by a training step's
# connections ("sock_bind_listen_range: all ports in range exhausted"). Above Ray's 10000-20000.
TWO_HOST_SRUN_PORTS = (30001, 30200)
# Served by each host on its own loopback, as the shop's task files name it.
SHOP_PORT = 8765
# A judge on every host's loopback, at the same URL (JUDGE_ON_EVERY_NODE=1).
HOST_JUDGE_PORT = 8001
HOST_JUDGE_MODEL = "host-judge"
HOST_JUDGE = Path(__file__).resolve().parent / "host_judge.py"


def namespace_name(node: str) -> str:
    """This session's namespace for ``node`` (unique per test process, so a crashed run never collides)."""
    return f"ngb{os.getpid()}-{node}"


def ip(*argv: str) -> None:
    """One ``ip`` command; raises with its error output when it fails."""
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")


# Debian's default hosts file: the host's own name on 127.0.1.1, no other host. A node's address comes from Slurm
# (NodeAddr), never from resolving a host name (which gives 127.0.1.1 here, as on many real nodes).
HOSTS_FILE = "127.0.0.1 localhost\n127.0.1.1 {node}\n"
# A second interface on every host, as Docker's bridge is on many nodes: an address the other host cannot reach.
BRIDGE_INTERFACE = "docker0"
BRIDGE_ADDRESS = "172.17.0.1/16"


def create_hosts(namespaces: dict[str, str]) -> None:
    """The two namespaces, a veth pair between them, their addresses, loopback up, and on each Debian's hosts file
    and a Docker-like bridge address that `hostname -I` lists first."""
    for node, namespace in namespaces.items():
        ip("netns", "add", namespace)
        etc = Path("/etc/netns") / namespace  # `ip netns exec` mounts these files over /etc/<file>
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(HOSTS_FILE.format(node=node))
    for namespace in namespaces.values():
        # Docker's default bridge, the same on every host, listed before the cluster's address by `hostname -I`.
        ip("-n", namespace, "link", "add", BRIDGE_INTERFACE, "type", "veth", "peer", "name", f"{BRIDGE_INTERFACE}p")
        ip("-n", namespace, "addr", "add", BRIDGE_ADDRESS, "dev", BRIDGE_INTERFACE)
        ip("-n", namespace, "link", "set", BRIDGE_INTERFACE, "up")
    first, second = (f"ngb{os.getpid()}{side}" for side in "ab")  # at most 15 characters
    ip("link", "add", first, "type", "veth", "peer", "name", second)
    for (node, namespace), link in zip(namespaces.items(), (first, second), strict=True):
        ip("link", "set", link, "netns", namespace)
        ip("-n", namespace, "link", "set", link, "name", HOST_INTERFACE)
        ip("-n", namespace, "addr", "add", f"{TWO_HOSTS[node]}/{HOST_PREFIX_LENGTH}", "dev", HOST_INTERFACE)
        ip("-n", namespace, "link", "set", HOST_INTERFACE, "up")
        ip("-n", namespace, "link", "set", "lo", "up")


def delete_hosts(namespaces: dict[str, str]) -> None:
    """Kills whatever still runs in the namespaces (by PID), deletes them (the veth pair goes with them)."""
    for namespace in namespaces.values():
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout
        for pid in pids.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only when empty: another user's namespaces keep theirs


def as_host(namespace: str, node: str, argv: list[str]) -> list[str]:
    """``argv`` run on host ``node``: in ``namespace``, with host name ``node`` and the host's hosts file; exec'd.

    ``ip netns exec`` would also mount a fresh /sys, without the cgroup tree ``slurmd`` needs ("Unable to initialize
    cgroup plugin"); so the network namespace is entered with ``nsenter``, in a mount and UTS namespace of its own.
    """
    become = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
    return [
        *("unshare", "--uts", "--mount", "--propagation", "private", "--"),
        *("nsenter", f"--net=/run/netns/{namespace}", "--"),
        *("sh", "-c", become, node, str(Path("/etc/netns") / namespace / "hosts"), *argv),
    ]


def require_outside_ephemeral_ports(namespace: str, ports: tuple[int, int]) -> None:
    """Fails when ``ports`` overlap the range the kernel of ``namespace`` hands to outgoing connections."""
    shown = subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", "/proc/sys/net/ipv4/ip_local_port_range"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    low, high = int(shown[0]), int(shown[1])
    assert ports[1] < low or ports[0] > high, f"srun's ports {ports} overlap {namespace}'s ephemeral ports {low}-{high}"


def two_host_slurm_conf(root: Path) -> str:
    """slurm.conf for h1 (controller and node) and h2, each addressed by its NodeAddr."""
    controller = next(iter(TWO_HOSTS))
    nodes = "".join(
        f"NodeName={node} NodeAddr={address} NodeHostname={node} CPUs={os.cpu_count()} RealMemory=2000 State=UNKNOWN\n"
        for node, address in TWO_HOSTS.items()
    )
    return (
        common_slurm_conf(root)
        + f"""\
SlurmctldHost={controller}({TWO_HOSTS[controller]})
SlurmctldPort={TWO_HOST_CTLD_PORT}
SlurmdPort={TWO_HOST_SLURMD_PORT}
SrunPortRange={TWO_HOST_SRUN_PORTS[0]}-{TWO_HOST_SRUN_PORTS[1]}
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/log/slurmd-%n.log
"""
        + nodes
        + f"PartitionName=local Nodes={','.join(TWO_HOSTS)} Default=YES MaxTime=UNLIMITED State=UP\n"
    )


@pytest.fixture(scope="module")
def two_node_slurm() -> Iterator[LocalSlurm]:
    """Slurm on two namespaced hosts, h1 (controller) and h2; the Corner Shop and a judge on each host's loopback."""
    require_slurm()
    assert shutil.which("ip") and shutil.which("unshare"), "iproute2/util-linux missing: bash scripts/setup_slurm.sh"
    started = time.monotonic()
    root = new_cluster_folder()
    for node in TWO_HOSTS:
        (root / "spool" / node).mkdir()
    (root / "slurm.conf").write_text(two_host_slurm_conf(root))
    namespaces = {node: namespace_name(node) for node in TWO_HOSTS}
    controller = next(iter(TWO_HOSTS))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    slurm = LocalSlurm(
        root=root,
        env=env,
        setup_s=0.0,
        nodes=tuple(TWO_HOSTS),
        namespaces=namespaces,
        addresses=dict(TWO_HOSTS),
        client_prefix=("ip", "netns", "exec", namespaces[controller]),
    )
    daemons: list[subprocess.Popen[bytes]] = []
    sites: list[subprocess.Popen[bytes]] = []
    slurm_started = False
    try:
        create_hosts(namespaces)
        for namespace in namespaces.values():
            require_outside_ephemeral_ports(namespace, TWO_HOST_SRUN_PORTS)
        daemons.append(start_munged(root))
        commands = [(controller, "slurmctld", ["slurmctld", "-D"])]
        commands += [(node, f"slurmd-{node}", ["slurmd", "-D", "-N", node]) for node in TWO_HOSTS]
        for node, name, command in commands:
            out = (root / "log" / f"{name}.out").open("wb")
            argv = as_host(namespaces[node], node, [*command, "-f", env["SLURM_CONF"]])
            daemons.append(subprocess.Popen(argv, env=env, stdout=out, stderr=out))
        slurm_started = True
        for node in TWO_HOSTS:
            out = (root / "log" / f"shop-{node}.out").open("wb")
            serve = [sys.executable, "-m", "nemo_gym_browser.local.shop_tasks", "--serve"]
            sites.append(subprocess.Popen(as_host(namespaces[node], node, serve), stdout=out, stderr=out))
            out = (root / "log" / f"judge-{node}.out").open("wb")
            judge = [sys.executable, str(HOST_JUDGE), f"--port={HOST_JUDGE_PORT}", f"--model={HOST_JUDGE_MODEL}"]
            sites.append(subprocess.Popen(as_host(namespaces[node], node, judge), stdout=out, stderr=out))
        logs = [root / "log" / name for name in ("slurmctld.log", "slurmctld.out", "slurmd-h1.log", "slurmd-h2.log")]
        wait_until_idle(slurm, logs)
        for node in TWO_HOSTS:
            wait_for(
                lambda node=node: {SHOP_PORT, HOST_JUDGE_PORT} <= listening_ports(slurm, node),
                DAEMON_START_TIMEOUT_S,
                f"the shop and the judge on {node}",
                [root / "log" / f"shop-{node}.out", root / "log" / f"judge-{node}.out"],
            )
        yield replace(slurm, setup_s=time.monotonic() - started)
    finally:
        for site in sites:
            site.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                site.wait(timeout=STOP_TIMEOUT_S)
        stop_cluster(slurm, daemons, running=slurm_started)
        delete_hosts(namespaces)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def firewall(slurm: LocalSlurm, node: str, destination: str, port: int) -> Iterator[None]:
    """While open, ``node`` drops every TCP packet it sends to ``destination:port`` (an iptables rule inside its
    namespace, removed on exit): a firewall between two hosts that leaves every other connection alone."""
    rule = ["OUTPUT", "-p", "tcp", "-d", destination, "--dport", str(port), "-j", "DROP"]
    added = subprocess.run(slurm.on_host(node, "iptables", "-A", *rule), capture_output=True, text=True, timeout=30)
    assert added.returncode == 0, f"iptables on {node}: {added.stderr} (bash scripts/setup_slurm.sh installs it)"
    try:
        yield
    finally:
        subprocess.run(slurm.on_host(node, "iptables", "-D", *rule), capture_output=True, timeout=30)


def listening_pid(slurm: LocalSlurm, node: str, port: int) -> int:
    """The PID listening on ``port`` in ``node``'s network namespace."""
    listing = subprocess.run(
        slurm.on_host(node, "ss", "-ltnpH", f"sport = :{port}"), capture_output=True, text=True, timeout=30
    )
    found = re.search(r"pid=(\d+),", listing.stdout)
    assert found, f"nothing listens on {port} on {node}: {listing.stdout} {listing.stderr}"
    return int(found.group(1))


def listening_ports(slurm: LocalSlurm, node: str) -> set[int]:
    """TCP ports something listens on in ``node``'s network namespace (any address)."""
    listing = subprocess.run(slurm.on_host(node, "ss", "-ltnH"), capture_output=True, text=True, timeout=30)
    assert listing.returncode == 0, listing.stderr
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in listing.stdout.splitlines() if line.strip()}


def assert_hosts_quiet(slurm: LocalSlurm) -> None:
    """On every host only the fixture's own servers listen (slurmctld, slurmd, shop, judge): no leftover of a job."""
    own = {TWO_HOST_CTLD_PORT, TWO_HOST_SLURMD_PORT, SHOP_PORT, HOST_JUDGE_PORT}
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while True:
        extra = {node: sorted(listening_ports(slurm, node) - own) for node in slurm.nodes}
        if not any(extra.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(extra.values()), f"still listening after the job: {extra}"


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


def sbatch(
    slurm: LocalSlurm, script: Path, args: list[str], *, config_env: Path, run_id: str, workdir: Path
) -> tuple[str, Path]:
    """Submits the script on every node of ``slurm``, without GPUs, from ``workdir`` (not the recipe folder: the
    script must find it by itself); returns the job id and the job's log file."""
    job_log = workdir / "job.out"
    submitted = subprocess.run(
        slurm.command(
            "sbatch",
            "--parsable",
            f"--nodes={len(slurm.nodes)}",
            "--gpus-per-node=0",
            "--time=30",
            f"--output={job_log}",
            str(script),
            *args,
        ),
        env={**slurm.env, "CONFIG_ENV": str(config_env), "NEMO_GYM_BROWSER_RUN_ID": run_id},
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, f"sbatch exit {submitted.returncode}: {submitted.stderr}"
    return submitted.stdout.strip().split(";")[0], job_log


def wait_until_gone(slurm: LocalSlurm, job_id: str, timeout_s: float, logs: list[Path]) -> None:
    """Returns once ``job_id`` has left the queue (polled each second: ``sbatch --wait`` polls up to 30 s apart)."""

    def gone() -> bool:
        queue = subprocess.run(
            slurm.command("squeue", "-h", "-j", job_id), env=slurm.env, capture_output=True, text=True, timeout=30
        )
        return queue.returncode == 0 and queue.stdout.strip() == ""

    wait_for(gone, timeout_s, f"job {job_id} to leave the queue", logs)


def job_state(slurm: LocalSlurm, job_id: str) -> str:
    """``scontrol show job`` for ``job_id``, one line (JobState=..., ExitCode=...)."""
    shown = subprocess.run(
        slurm.command("scontrol", "show", "job", "-o", job_id),
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return shown.stdout


def sbatch_wait(
    slurm: LocalSlurm,
    script: Path,
    args: list[str],
    *,
    config_env: Path,
    run_id: str,
    workdir: Path,
    timeout_s: float,
    expect_failure: bool = False,
) -> FinishedJob:
    """Submits the script (:func:`sbatch`) and waits for the job to end; fails unless it COMPLETED with 0 (or,
    with ``expect_failure``, unless it FAILED with exit status 1)."""
    started = time.monotonic()
    job_id, job_log = sbatch(slurm, script, args, config_env=config_env, run_id=run_id, workdir=workdir)
    wait_until_gone(slurm, job_id, timeout_s, [job_log])
    seconds = time.monotonic() - started
    log = job_log.read_text() if job_log.exists() else ""
    state = job_state(slurm, job_id)
    expected = ("JobState=FAILED", "ExitCode=1:0") if expect_failure else ("JobState=COMPLETED", "ExitCode=0:0")
    assert all(part in state for part in expected), f"{state}\njob log:\n{log[-8000:]}"
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


# --- the jobs' inputs, shared by the one-host and two-host tests -----------------------------------------------


def write_recipe_inputs(folder: Path, start_urls: tuple[str, ...] = ()) -> Path:
    """The test model and six rows (two held back for validation) in ``folder``; every task carries
    ``verifier_metadata``, so a job with ``JUDGE_ENABLE=0`` can score them (or its checks stop it). The rows start on
    ``start_urls`` in turn; by default on the Corner Shop's front page, which each two-node host serves on its own
    loopback and the ``shop_site`` fixture on this machine's (the job's start-page check opens it)."""
    from nemo_gym_browser.local.chat_tokenizer import save_tokenizer_and_config
    from nemo_gym_browser.local.shop_tasks import page_url
    from nemo_gym_browser.prepare_webvoyager_data import main as prepare_data

    save_tokenizer_and_config(folder / "model")
    tasks = folder / "tasks.jsonl"
    questions = ["What is the heading of the page?", "Report the page title.", "Summarise the page."]
    urls = start_urls or (page_url("index.html"),)
    task = {"web_name": "Example", "verifier_metadata": {"url_contains": "index.html"}}
    tasks.write_text(
        "".join(
            json.dumps({**task, "id": f"Example--{i}", "ques": q, "web": urls[i % len(urls)]}) + "\n"
            for i, q in enumerate(questions * 2)
        )
    )
    assert prepare_data(["--input", str(tasks), "--output-dir", str(folder / "data"), "--val-fraction", "0.34"]) == 0
    return folder


def cpu_training_settings(tmp_path: Path, policy: Path, rows: tuple[Path, Path], steps: int) -> dict[str, object]:
    """config.env settings for a CPU training job of ``steps`` steps: per node one actor rank (a logical GPU), one
    agent-loop worker and one environment server, the tiny policy, the shop's rows (all with verifier_metadata)."""
    return {
        "MODEL_PATH": policy,
        "TRAIN_FILES": rows[0],
        "VAL_FILES": rows[1],
        "LOG_DIR": tmp_path / "logs",
        "CHECKPOINT_DIR": tmp_path / "checkpoints",
        "GPUS_PER_NODE": 1,
        "AGENT_WORKERS_PER_NODE": 1,
        "ROLLOUT_N": 2,
        "TRAIN_BATCH_SIZE": 2,
        "PPO_MINI_BATCH_SIZE": 2,
        "MAX_PROMPT_LENGTH": 1536,
        "MAX_RESPONSE_LENGTH": 2048,
        "MAX_TOKEN_LEN_PER_GPU": 3584,
        "MAX_ASSISTANT_TURNS": 6,
        "ROLLOUT_TP": 1,
        "TOTAL_EPOCHS": 1,
        "ENV_SERVERS_PER_NODE": 1,
        # `ray start` gets the logical resources the CPU backend's ray_init overrides give a private Ray
        "RAY_NUM_GPUS": 1,
        "RAY_NUM_CPUS": 16,
        "JUDGE_ENABLE": 0,
        "LOGGER": "console,file",
        "SAVE_FREQ": steps,
        "TEST_FREQ": 100,
    }


def write_config_env(
    path: Path, settings: dict[str, object], exports: dict[str, str] | None = None, *, cpu_run: bool = True
) -> Path:
    """``path`` as a config.env: ``KEY=value`` per setting, then ``export KEY=value`` per export. With ``cpu_run``
    (the default) a CPU run on this test process's Python first, as ``submit_fixtures.CPU_RUN_SETTINGS`` and
    ``CPU_RUN_EXPORTS`` say; what ``settings`` and ``exports`` give wins."""
    if cpu_run:
        settings = {**CPU_RUN_SETTINGS, **settings}
        exports = {**CPU_RUN_EXPORTS, **(exports or {})}
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines += [f"export {key}={value}" for key, value in (exports or {}).items()]
    path.write_text("\n".join(lines) + "\n")
    return path
