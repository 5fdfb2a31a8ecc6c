"""verl's ``main_ppo`` for a :class:`~.run_spec.RunSpec` as a child process, and the metrics it leaves behind.

:func:`run_main_ppo` starts ``python -m verl.trainer.main_ppo`` in its own process group, copies its output to
``main_ppo.log`` (and to a caller's ``on_line``), samples the memory of the caller's whole process tree (the
environment server and Chromium it started included) and of the machine, and reads back the per-step
metrics of verl's own ``file`` logger (``metrics.jsonl``) and the recipe's ``advantages.jsonl``. On timeout,
interruption or SIGTERM the whole group is stopped (it is ours: Ray's processes included): SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .run_spec import VLLM_CPU_ENGINE, RunSpec, main_ppo_command, process_environment

logger = logging.getLogger(__name__)

# A stopped run's process group gets this long after SIGTERM (Ray shuts its workers down) before SIGKILL.
STOP_GRACE_S = 20.0
# How long the run's group may outlive main_ppo itself (Ray shutting down) before what is left is stopped.
LEFTOVER_GRACE_S = 15.0


@dataclass(frozen=True)
class RunResult:
    returncode: int
    elapsed_s: float
    # the most the caller's process tree held at once: this process, main_ppo and Ray's workers, and whatever else the
    # caller started (environment server, Chromium); PSS, shared pages counted once
    peak_memory_bytes: int
    steps: dict[int, dict[str, Any]]  # training step -> the metrics verl logged for it
    advantages: dict[int, list[dict[str, Any]]]  # training step -> every sample's flag, score and advantage
    log_path: Path
    machine_peak_used_bytes: int = 0  # MemTotal - MemAvailable at its highest while the run ran: everything on it

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def read_advantages(path: Path) -> dict[int, list[dict[str, Any]]]:
    """``advantages.jsonl`` by training step: the samples of each advantage computation (see ``patches.py``)."""
    steps: dict[int, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps.setdefault(int(record["step"]), []).extend(record["samples"])
    return steps


def read_step_metrics(path: Path) -> dict[int, dict[str, Any]]:
    """The metrics verl's ``file`` logger wrote, by step; several records of one step (training, validation) merge."""
    steps: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            steps.setdefault(int(record["step"]), {}).update(record["data"])
    return steps


def metric(steps: Mapping[int, Mapping[str, Any]], step: int, key: str) -> float:
    """One logged metric of one step as a float; NaN when it was not logged."""
    value = steps.get(step, {}).get(key)
    return float(value) if value is not None else math.nan


def run_main_ppo(
    spec: RunSpec,
    *,
    timeout_s: float,
    python: str = sys.executable,
    on_line: Callable[[str], None] | None = None,
) -> RunResult:
    """Run ``main_ppo`` for ``spec`` to the end (or ``timeout_s``) and return what it logged.

    ``on_line`` sees every line of the trainer's output as it comes (progress for a CLI); everything also goes to
    ``spec.log_path``. The metrics file is truncated first by verl itself, so a result never mixes two runs.
    """
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    spec.advantages_path.unlink(missing_ok=True)  # appended to by the trainer: start empty, like metrics.jsonl
    command = main_ppo_command(spec, python)
    started_wall = time.time()
    (spec.output_dir / "command.txt").write_text(" \\\n  ".join(command) + "\n")
    started = time.monotonic()
    # A SIGTERM to this process must stop the run's process group too (Ray's processes are in it), not orphan it:
    # the handler is in place before the group exists, so a SIGTERM while it starts is not missed.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main_thread else None
    try:
        return _run_and_collect(spec, command, timeout_s, on_line, started, started_wall)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run_and_collect(
    spec: RunSpec,
    command: list[str],
    timeout_s: float,
    on_line: Callable[[str], None] | None,
    started: float,
    started_wall: float,
) -> RunResult:
    with open(spec.log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            cwd=spec.output_dir,
            env=process_environment(spec),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert process.stdout is not None
        reader = threading.Thread(target=_copy_lines, args=(process.stdout, log, on_line), daemon=True)
        memory: _MemorySampler | None = None
        try:  # from here on, whatever ends this call stops the group first
            reader.start()
            memory = _MemorySampler(os.getpid())
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.error("main_ppo ran past %.0f s; stopping its process group %d", timeout_s, process.pid)
            _stop_group(process)
            returncode = -signal.SIGKILL
        except BaseException:
            _stop_group(process)
            raise
        finally:
            if memory is not None:
                memory.stop()
            if reader.is_alive():
                reader.join(timeout=10)
            # Ray's workers outlive main_ppo by a moment, a signalled one until the kernel schedules its end: the
            # run is over when its whole group is, and what still runs after LEFTOVER_GRACE_S is stopped.
            if not _wait_for_group_to_end(process.pid, timeout_s=LEFTOVER_GRACE_S):
                logger.warning("main_ppo's process group %d outlived it; stopping what is left", process.pid)
                _stop_group(process)
            if spec.rollout_name == VLLM_CPU_ENGINE:
                # Ray killed vLLM's engine processes: their message-queue segments stay in /dev/shm unless removed.
                from .vllm_cpu import remove_orphaned_shm

                remove_orphaned_shm(started_wall)
    assert memory is not None  # the wait returned, so the sampler ran
    return RunResult(
        returncode,
        time.monotonic() - started,
        memory.peak_bytes,
        read_step_metrics(spec.metrics_path),
        read_advantages(spec.advantages_path),
        spec.log_path,
        memory.machine_peak_bytes,
    )


def _wait_for_group_to_end(pgid: int, *, timeout_s: float) -> bool:
    """Wait until no process of the group is left (Ray's workers outlive main_ppo by a moment); True if none is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class _MemorySampler:
    """Samples the proportional set size of a process and all its descendants every second, and the machine's use."""

    _INTERVAL_S = 1.0

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.peak_bytes = 0
        self.machine_peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ..processes import all_processes, descendants, machine_used_bytes, pss_bytes

        while not self._stop.wait(self._INTERVAL_S):
            pids = [self.root_pid, *(p.pid for p in descendants({self.root_pid}, all_processes()))]
            self.peak_bytes = max(self.peak_bytes, sum(pss_bytes(pid) for pid in pids))
            self.machine_peak_bytes = max(self.machine_peak_bytes, machine_used_bytes())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _copy_lines(stream: Any, log: Any, on_line: Callable[[str], None] | None) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        if on_line is not None:
            on_line(raw.decode(errors="replace").rstrip("\n"))
    stream.close()


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the run's process group (it is ours: started with a new session), SIGKILL after the grace; returns
    once every process of the group is gone (or after the SIGKILL's own grace)."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait_s)  # reaps the leader: a zombie leader keeps its group alive
        if _wait_for_group_to_end(process.pid, timeout_s=max(0.0, deadline - time.monotonic())):
            return
