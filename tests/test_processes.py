"""Finding the processes a launcher started through /proc, and stopping their group whatever they do with SIGTERM."""

from __future__ import annotations

import subprocess
import time

from nemo_gym_browser.processes import all_processes, descendants, is_alive, read_proc, stop_process_group


def start_group(script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", script], start_new_session=True)


def wait_for_children(pid: int, count: int, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        found = descendants({pid}, all_processes())
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def gone_soon(procs: list, timeout_s: float = 5.0) -> bool:
    """Whether every process of ``procs`` ends within ``timeout_s`` (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while any(is_alive(proc) for proc in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_grandchild_is_found_below_its_root_and_is_gone_after_the_group_is_stopped() -> None:
    shell = start_group("sh -c 'sleep 30 & wait' & wait")  # shell -> inner shell -> sleep
    try:
        found = wait_for_children(shell.pid, 2)
        assert any(proc.ppid != shell.pid for proc in found), found  # a grandchild, not only children
        assert all(is_alive(proc) for proc in found)
    finally:
        stop_process_group(shell, "test group", grace_s=5.0)

    assert shell.poll() is not None
    assert gone_soon(found)


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period() -> None:
    shell = start_group("trap '' TERM; sleep 30 & wait")
    found = wait_for_children(shell.pid, 1)
    started = time.monotonic()

    stop_process_group(shell, "stubborn group", grace_s=0.5)

    assert time.monotonic() - started < 5.0
    assert shell.poll() is not None
    assert found and gone_soon(found)


def test_a_pid_that_does_not_exist_reads_as_no_process() -> None:
    assert read_proc(2**22 + 12345) is None
