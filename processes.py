"""Processes on Linux as ``/proc`` shows them: finding a process tree, and stopping the groups a launcher started.

A :class:`Proc` carries its start time, so a PID the kernel reused for another process is never taken for the one
seen before (:func:`is_alive`). :func:`die_with_parent` asks the kernel to SIGKILL a child when its parent dies,
even by SIGKILL; :func:`stop_process_group` ends a group with SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a live process from a reused PID


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (shared pages split among their users); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def machine_used_bytes() -> int:
    """MemTotal - MemAvailable: what every process on the machine holds, page cache it could drop left out."""
    fields = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return fields.get("MemTotal", 0) - fields.get("MemAvailable", 0)


def read_proc(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may contain spaces
    if fields[0] == "Z":  # a zombie holds nothing; its parent reaps it
        return None
    return Proc(pid=pid, ppid=int(fields[1]), start_ticks=int(fields[19]))


def all_processes() -> list[Proc]:
    """Every live process (zombies left out)."""
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := read_proc(int(entry))) is not None:
            procs.append(proc)
    return procs


def cmdline(pid: int) -> str:
    """The command line of ``pid`` with spaces between arguments, or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def executable_name(pid: int) -> str:
    """The file name of the executable ``pid`` runs, or "" when it is gone or not ours to read."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def descendants(root_pids: set[int], procs: list[Proc]) -> list[Proc]:
    """Every process of ``procs`` below one of ``root_pids``, however deep."""
    children: dict[int, list[Proc]] = {}
    for proc in procs:
        children.setdefault(proc.ppid, []).append(proc)
    found, frontier = [], list(root_pids)
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child.pid)
    return found


def is_alive(proc: Proc) -> bool:
    """Whether ``proc`` still runs (the same process, not another one under its reused PID)."""
    current = read_proc(proc.pid)
    return current is not None and current.start_ticks == proc.start_ticks


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when we die, even by SIGKILL (no atexit, no finally).

    Only from the main thread: the kernel ties the signal to the thread that forked, and a worker thread that
    ends would take a healthy server with it.
    """
    if threading.current_thread() is not threading.main_thread() or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_parent_death_signal


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_process_group(popen: subprocess.Popen[bytes], name: str, grace_s: float) -> None:
    """SIGTERM the group ``popen`` leads, wait up to ``grace_s``, then SIGKILL it."""
    if popen.poll() is None:
        logger.debug("stopping %s (pid %s) with SIGTERM", name, popen.pid)
        signal_group(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %s) ignored SIGTERM for %.0f s; sending SIGKILL", name, popen.pid, grace_s)
    # The leader may be gone while members live on (Chromium's zygotes, a Playwright driver).
    signal_group(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=grace_s)
