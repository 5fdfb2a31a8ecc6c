"""What the benchmarks under ``bench/`` share.

* :func:`header`: the machine a figure was measured on (cores, CPU, load average, Python, torch, verl) and the
  exact command, printed first by every benchmark: a figure is only worth something next to both.
* :func:`write_report`: the same facts and the benchmark's figures as JSON, next to its plot (``bench/<name>.json``):
  the README quotes the committed JSON, so a figure and where it came from travel together.
* :func:`fake_environment_process`: the in-process environment server in a child process, as a deployed server runs
  apart from the rollout workers (its work must not share the measured event loop).
* :class:`LoopFactory`: agent loops built per episode exactly as verl's ``AgentLoopWorker`` builds them.

Importing this module imports neither torch nor verl; :class:`LoopFactory` imports verl when it is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import multiprocessing
import os
import platform
import queue
import shlex
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Machine:
    """The facts a reader needs to compare a benchmark figure with their own run."""

    cores: int
    cpu: str
    python: str
    torch: str
    verl: str
    system: str
    load: str  # 1-minute load average when measured: other work on the machine skews timings

    def lines(self) -> list[str]:
        return [
            f"machine: {self.cores} cores ({self.cpu}), {self.system}, load average {self.load}",
            f"python {self.python}, torch {self.torch}, verl {self.verl}",
        ]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> Machine:
    """Cores usable by this process (its CPU affinity), CPU model, Python, torch, verl, kernel."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return Machine(
        cores=cores,
        cpu=_cpu_model(),
        python=platform.python_version(),
        torch=_version("torch"),
        verl=_version("verl"),
        system=f"{platform.system()} {platform.release()}",
        load=f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown",
    )


def command_line() -> str:
    """The command as it was typed (interpreter and its options included), shell-quoted."""
    return shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))


def header(title: str) -> str:
    """The block a benchmark prints before its results."""
    return "\n".join([f"== {title}", *describe_machine().lines(), f"command: {command_line()}"])


def _plain(value: Any) -> Any:
    """JSON-ready: dataclasses become dicts, paths strings, tuples lists, numpy and torch values Python ones."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Path):  # relative to the working folder when under it: no machine's home in the report
        relative = os.path.relpath(value)
        return relative if not relative.startswith("..") else str(value)
    if callable(getattr(value, "tolist", None)):  # numpy and torch arrays and scalars
        return value.tolist()
    return value


def write_report(path: Path, settings: Mapping[str, Any], figures: Mapping[str, Any]) -> None:
    """Write ``{"machine", "command", "settings", "figures"}`` to ``path`` (pretty JSON, one trailing newline).

    ``settings`` are the knobs the figures depend on (usually ``vars(args)``); ``figures`` what was measured.
    """
    report = {
        "machine": _plain(describe_machine()),
        "command": command_line(),
        "settings": _plain(settings),
        "figures": _plain(figures),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"figures: {os.path.relpath(path)}", flush=True)


# ----- a in-process environment server in its own process ----------------------------------------------------------

# How long the child may take to import and bind, and to shut down when asked.
_CHILD_START_TIMEOUT_S = 60.0
_CHILD_STOP_TIMEOUT_S = 10.0


def _serve_fake_environment(latency_s: float, ports: Any, stop: Any) -> None:
    """Child process body: run a InProcessEnvironmentServer until ``stop`` is set, after sending its port."""
    import asyncio

    from ..local.environment_server.server import InProcessEnvironmentServer

    async def serve() -> None:
        async with InProcessEnvironmentServer(latency_s=latency_s) as server:
            ports.put(server.port)
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    asyncio.run(serve())


@contextlib.contextmanager
def fake_environment_process(latency_s: float) -> Iterator[str]:
    """An :class:`~nemo_gym_browser.local.environment_server.server.InProcessEnvironmentServer` in a child process;
    yields its URL.

    A deployed environment server runs in its own process (usually on another machine), so a benchmark of the
    client must not let the server's work share the client's event loop. The child is stopped on exit (asked
    first, then terminated by its handle).
    """
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    stop = context.Event()
    child = context.Process(
        target=_serve_fake_environment, args=(latency_s, ports, stop), name="fake-environment", daemon=True
    )
    child.start()
    try:
        deadline = time.monotonic() + _CHILD_START_TIMEOUT_S
        while True:
            try:
                port = ports.get(timeout=0.2)
                break
            except queue.Empty:
                if child.exitcode is not None:
                    raise RuntimeError(f"the environment server process exited with code {child.exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the in-process environment server process did not start within {_CHILD_START_TIMEOUT_S:.0f} s"
                    ) from None
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        child.join(_CHILD_STOP_TIMEOUT_S)
        if child.is_alive():
            child.terminate()
            child.join(_CHILD_STOP_TIMEOUT_S)


# ----- agent loops built as verl builds them ----------------------------------------------------------------


class LoopFactory:
    """Builds one agent loop per episode exactly as verl 0.9.1's ``AgentLoopWorker._run_agent_loop`` does.

    verl reads the agent-loop YAML once and calls ``hydra.utils.instantiate`` on the entry for every sample with
    these keyword arguments; so does :meth:`build`. (``in_process_loop.build_loop`` re-reads the YAML on each
    call, which is fine for a test and too slow to measure or to run hundreds of episodes with.)
    """

    def __init__(self, entry: Any, tools: list[Any], trainer_config: Any, tokenizer: Any) -> None:
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

        self.entry = entry
        self.tools = ToolListWrap(list(tools))
        self.trainer_config = DictConfigWrap(config=trainer_config)
        self.data_config = DictConfigWrap(trainer_config.data)
        self.tokenizer = tokenizer

    def build(self, server_manager: Any) -> Any:
        import hydra
        from verl.utils.dataset.rl_dataset import RLHFDataset

        from ..local.in_process_loop import HF_MODEL_TYPE

        return hydra.utils.instantiate(
            config=self.entry,
            trainer_config=self.trainer_config,
            server_manager=server_manager,
            tokenizer=self.tokenizer,
            processor=None,
            hf_model_type=HF_MODEL_TYPE,
            dataset_cls=RLHFDataset,
            data_config=self.data_config,
            tools=self.tools,
        )
