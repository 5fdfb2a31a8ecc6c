"""verl's real ``main_ppo`` with this recipe on one machine: the command, the process, its metrics, injected faults.

What it owns
    * :class:`RunSpec`: one short training run (model folder, data files, environment servers, sizes, estimator,
      checkpointing) and :func:`hydra_overrides` / :func:`process_environment`, the exact ``main_ppo`` command line
      and environment it implies: ``configs/webvoyager_grpo.yaml`` (the recipe's own trainer config, as
      ``submit_webvoyager.sh`` uses it), small sizes, and, unless ``rollout_name`` says otherwise, the CPU backend of
      :mod:`nemo_gym_browser.local.cpu_backend` in place of vLLM.
    * :func:`run_main_ppo`: ``python -m verl.trainer.main_ppo`` as a child process in its own process group, its
      output in ``main_ppo.log``, its per-step metrics read back from verl's own ``file`` logger
      (``metrics.jsonl``); on timeout or interruption the whole group is stopped (it is ours: Ray's processes
      included).
    * :class:`InjectedFaults`: the project's fault proxy (:mod:`nemo_gym_browser.testing.fault_proxy`) between the
      trainer's rollouts and a real environment server, in a background thread, with deterministic rules:
      :func:`random_faults` (a share of sessions fails at one endpoint, verify by default), :func:`browser_call_faults`
      (each browser action call fails on its own, so exposure grows with browsing), :func:`planned_faults` (per row);
      :class:`FaultSpec` (``RunSpec.faults``, the CLI's ``--fault-*``) names the first two.

The stock arm (``estimator="grpo"``) is verl's GRPO as it ships: the recipe's trainer wiring is switched off
(``NEMO_GYM_BROWSER_PATCHES=0``), each rollout gets one attempt and a failure enters its group as a zero.

Layout of ``RunSpec.output_dir``: ``command.txt``, ``main_ppo.log``, ``metrics.jsonl`` (verl's per-step metrics),
``advantages.jsonl`` (every sample's flag, score and advantage per step; recipe arm only), ``checkpoints/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..task_rows import DATA_SOURCE
from ..testing.background_loop import BackgroundLoop
from ..wiring import ESTIMATOR_NAME

logger = logging.getLogger(__name__)

RECIPE_DIR = Path(__file__).resolve().parent.parent
CONFIG_DIR = RECIPE_DIR / "configs"
METRICS_FILE = "metrics.jsonl"
ADVANTAGES_FILE = "advantages.jsonl"  # wiring.ADVANTAGE_LOG_ENV: every sample's flag, score and advantage per step
LOG_FILE = "main_ppo.log"
CHECKPOINT_DIR = "checkpoints"
STOCK_ESTIMATOR = "grpo"
CPU_ROLLOUT = "hfcpu"  # cpu_backend.ROLLOUT_NAME, not imported here so that building a command imports nothing
RECIPE_ESTIMATOR = ESTIMATOR_NAME
# A stopped run's process group gets this long after SIGTERM (Ray shuts its workers down) before SIGKILL.
STOP_GRACE_S = 20.0
# Where injected faults strike: "verify" spoils a share of sessions after the policy acted (random_faults);
# "browser-call" fails each browser action call on its own (browser_call_faults).
FAULT_POINTS = ("verify", "browser-call")
# What a faulted call meets (Fault kinds), each an infrastructure failure the loop resamples. At a browser call /
# at verify the loop records: "status" (a 503) server_error / verify_unavailable; "lose_session" (the session cookie
# stripped: the server no longer knows the session) session_lost / session_lost; "hang" (held until the client gives
# up) timeout after environment.call_timeout_s / verify_unavailable after verify_timeout_s. Not "drop": observe and
# navigate are retried on a dropped connection, each retry a call of its own, so their failure rate would not be the
# rate asked for.
FAULT_KINDS = ("status", "lose_session", "hang")


def _check_rate(rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"the fault rate must be in [0, 1], not {rate}")


@dataclass(frozen=True)
class FaultSpec:
    """The infrastructure failures the fault proxy injects into a run's training sessions (see :meth:`rule`)."""

    rate: float = 0.0  # "verify": the share of sessions faulted; "browser-call": each browser call's chance
    at: str = "verify"  # one of FAULT_POINTS
    kind: str = "status"  # one of FAULT_KINDS

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if self.at not in FAULT_POINTS:
            raise ValueError(f"faults strike at one of {FAULT_POINTS}, not {self.at!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"the fault kind must be one of {FAULT_KINDS}, not {self.kind!r}")

    def rule(self, seed: int, spare_tasks: frozenset[str] = frozenset()) -> Callable[[Any], Any]:
        """The proxy rule: :func:`random_faults` at verify or :func:`browser_call_faults`, sparing ``spare_tasks``."""
        if self.at == "browser-call":
            return browser_call_faults(self.rate, seed, kind=self.kind, spare_tasks=spare_tasks)
        return random_faults(self.rate, seed, spare_tasks=spare_tasks, kind=self.kind)


@dataclass(frozen=True)
class RunSpec:
    """One short ``main_ppo`` run. Sizes are small on purpose: a CPU step should take seconds, not minutes."""

    model_path: Path
    train_file: Path
    val_file: Path
    server_urls: tuple[str, ...]
    output_dir: Path
    steps: int = 2
    prompts_per_step: int = 2
    group_size: int = 4  # rollout.n: episodes per task, one GRPO group
    max_prompt_length: int = 1536
    max_response_length: int = 2048
    max_assistant_turns: int = 8  # the longest shop task takes 4 (observe, click, click, finish); room to err
    lr: float = 1e-4
    estimator: str = RECIPE_ESTIMATOR
    max_attempts: int = 3
    drop_invalid: bool = False
    episode_deadline_s: float = 300.0
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = False
    resume: bool = False
    temperature: float = 1.0
    seed: int = 0
    rollout_name: str = CPU_ROLLOUT  # the CPU backend; "vllm" on a GPU machine (scripts/gpu_check.sh)
    agent_workers: int = 1
    extra_overrides: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # What the driver's fault proxy injects. main_ppo never sees it: whoever starts the proxy builds its rule from it.
    faults: FaultSpec = FaultSpec()
    # environment.call_timeout_s; None keeps configs/agent_loop.yaml's. A "hang" fault at a browser call costs this.
    call_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.call_timeout_s is not None and self.call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be positive, not {self.call_timeout_s}")
        if self.estimator not in (RECIPE_ESTIMATOR, STOCK_ESTIMATOR):
            raise ValueError(f"estimator must be {RECIPE_ESTIMATOR!r} or {STOCK_ESTIMATOR!r}, not {self.estimator!r}")
        if not self.server_urls:
            raise ValueError("at least one environment server URL is needed")
        if self.steps < 1 or self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError("steps, prompts_per_step and group_size must be at least 1")

    @property
    def stock(self) -> bool:
        return self.estimator == STOCK_ESTIMATOR

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / METRICS_FILE

    @property
    def advantages_path(self) -> Path:
        return self.output_dir / ADVANTAGES_FILE

    @property
    def log_path(self) -> Path:
        return self.output_dir / LOG_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / CHECKPOINT_DIR

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)


def _hydra_string(value: str | Path) -> str:
    """A hydra override value quoted so that commas, colons and brackets in paths and URLs stay literal."""
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def hydra_overrides(spec: RunSpec) -> list[str]:
    """The ``main_ppo`` overrides on top of ``configs/webvoyager_grpo.yaml`` for ``spec``, one per element."""
    tokens = spec.max_prompt_length + spec.max_response_length
    urls = ",".join(_hydra_string(url) for url in spec.server_urls)
    overrides = [
        f"actor_rollout_ref.model.path={_hydra_string(spec.model_path)}",
        f"data.train_files={_hydra_string(spec.train_file)}",
        f"data.val_files={_hydra_string(spec.val_file)}",
        f"data.train_batch_size={spec.prompts_per_step}",
        f"data.max_prompt_length={spec.max_prompt_length}",
        f"data.max_response_length={spec.max_response_length}",
        "data.dataloader_num_workers=0",
        f"data.seed={spec.seed}",
        f"actor_rollout_ref.actor.optim.lr={spec.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec.prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={tokens}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={tokens}",
        f"actor_rollout_ref.rollout.n={spec.group_size}",
        f"actor_rollout_ref.rollout.temperature={spec.temperature}",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={spec.max_assistant_turns}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={_hydra_string(CONFIG_DIR / 'browser_tool.yaml')}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={_hydra_string(CONFIG_DIR / 'agent_loop.yaml')}",
        f"actor_rollout_ref.rollout.agent.num_workers={spec.agent_workers}",
        f"algorithm.adv_estimator={spec.estimator}",
        "+ray_kwargs.ray_init.address=local",  # a private Ray instance, never a cluster already running here
        f"nemo_gym_browser.environment.server_urls=[{urls}]",
        f"nemo_gym_browser.episode_deadline_s={spec.episode_deadline_s}",
        f"nemo_gym_browser.max_attempts={1 if spec.stock else spec.max_attempts}",
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={spec.steps}",
        f"trainer.save_freq={spec.save_freq}",
        f"trainer.test_freq={spec.test_freq}",
        f"trainer.val_before_train={spec.val_before_train}",
        f"trainer.resume_mode={'auto' if spec.resume else 'disable'}",
        f"trainer.default_local_dir={_hydra_string(spec.checkpoint_dir)}",
        "trainer.project_name=nemo_gym_browser_local",
        f"trainer.experiment_name={spec.output_dir.name}",
    ]
    if spec.rollout_name == CPU_ROLLOUT:
        overrides += _cpu_backend().cpu_overrides()
    else:
        overrides += [
            f"actor_rollout_ref.rollout.name={spec.rollout_name}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            # the inference engine sizes its cache for the model's whole context unless told the run's
            f"actor_rollout_ref.rollout.max_model_len={tokens}",
            "trainer.nnodes=1",
            "trainer.n_gpus_per_node=1",
            "+ray_kwargs.ray_init._node_ip_address=127.0.0.1",
            "+ray_kwargs.ray_init.include_dashboard=False",
        ]
    if spec.call_timeout_s is not None:  # ++: the key is not in webvoyager_grpo.yaml's nemo_gym_browser section
        overrides.append(f"++nemo_gym_browser.environment.call_timeout_s={spec.call_timeout_s}")
    return overrides + list(spec.extra_overrides)


def _cpu_backend() -> Any:
    from . import cpu_backend

    return cpu_backend


def process_environment(spec: RunSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the ``main_ppo`` process (its local Ray cluster's workers inherit it)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(p for p in (str(RECIPE_DIR), env.get("PYTHONPATH", "")) if p),
            "VERL_FILE_LOGGER_PATH": str(spec.metrics_path),
            "NEMO_GYM_BROWSER_ADVANTAGE_LOG": str(spec.advantages_path),
            "NEMO_GYM_BROWSER_DROP_INVALID": "1" if spec.drop_invalid and not spec.stock else "0",
            "NEMO_GYM_BROWSER_PATCHES": "0" if spec.stock else "1",
            "HYDRA_FULL_ERROR": "1",
            "RAY_USAGE_STATS_ENABLED": "0",  # Ray would otherwise report usage to an outside server
            "VLLM_NO_USAGE_STATS": "1",  # and so would vLLM
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray keeps a 127.0.0.1 node address
            "RAY_DEDUP_LOGS": "0",
        }
    )
    if spec.rollout_name == CPU_ROLLOUT:
        env.update(_cpu_backend().cpu_env())
    env.update(spec.extra_env)
    return env


def main_ppo_command(spec: RunSpec, python: str = sys.executable) -> list[str]:
    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={CONFIG_DIR}",
        "--config-name=webvoyager_grpo",
        *hydra_overrides(spec),
    ]


# --------------------------------------------------------------------------------------------- the trainer's metrics
@dataclass(frozen=True)
class RunResult:
    returncode: int
    elapsed_s: float
    peak_memory_bytes: int  # the most the run's process tree held at once (PSS: shared pages counted once)
    steps: dict[int, dict[str, Any]]  # training step -> the metrics verl logged for it
    advantages: dict[int, list[dict[str, Any]]]  # training step -> every sample's flag, score and advantage
    log_path: Path

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
    (spec.output_dir / "command.txt").write_text(" \\\n  ".join(command) + "\n")
    started = time.monotonic()
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
        reader.start()
        memory = _MemorySampler(process.pid)
        # A SIGTERM to this process must stop the run's process group too (Ray's processes are in it), not orphan it.
        on_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main_thread else None
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.error("main_ppo ran past %.0f s; stopping its process group %d", timeout_s, process.pid)
            _stop_group(process)
            returncode = -signal.SIGKILL
        except BaseException:
            _stop_group(process)
            raise
        finally:
            if on_main_thread:
                signal.signal(signal.SIGTERM, previous)
            memory.stop()
            reader.join(timeout=10)
    return RunResult(
        returncode,
        time.monotonic() - started,
        memory.peak_bytes,
        read_step_metrics(spec.metrics_path),
        read_advantages(spec.advantages_path),
        spec.log_path,
    )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class _MemorySampler:
    """Samples the proportional set size of a process and all its descendants (Ray's workers) every second."""

    _INTERVAL_S = 1.0

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ..processes import all_processes, descendants

        while not self._stop.wait(self._INTERVAL_S):
            pids = [self.root_pid, *(p.pid for p in descendants({self.root_pid}, all_processes()))]
            self.peak_bytes = max(self.peak_bytes, sum(_pss_bytes(pid) for pid in pids))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _copy_lines(stream: Any, log: Any, on_line: Callable[[str], None] | None) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        if on_line is not None:
            on_line(raw.decode(errors="replace").rstrip("\n"))
    stream.close()


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the run's process group (it is ours: started with a new session), SIGKILL after the grace."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# ------------------------------------------------------------------------------------------------- injected faults
class InjectedFaults:
    """The fault proxy in front of ``upstream``, on its own event loop in a daemon thread.

    ``with InjectedFaults(env.url, rule) as faults: ... faults.url ...``; after the run, ``open_session_ids`` are
    the sessions seeded through the proxy that no verify or close released, and ``counts()`` what was injected.
    """

    _TIMEOUT_S = 30.0

    def __init__(self, upstream: str, rule: Callable[[Any], Any] | None = None) -> None:
        from ..testing.fault_proxy import FaultProxy

        self._loop = BackgroundLoop("fault-proxy")
        self._proxy = FaultProxy(upstream)
        self._rule = rule

    def __enter__(self) -> InjectedFaults:
        self._loop.open()
        try:
            self._loop.run(self._proxy.start(), timeout_s=self._TIMEOUT_S)
        except BaseException:
            self._loop.close()
            raise
        self._proxy.set_rule(self._rule)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._loop.run(self._proxy.close(), timeout_s=self._TIMEOUT_S)
        finally:
            self._loop.close()

    @property
    def url(self) -> str:
        return self._proxy.url

    @property
    def open_session_ids(self) -> tuple[str, ...]:
        return self._proxy.open_session_ids

    @property
    def log(self) -> list[Any]:
        return list(self._proxy.log)

    def counts(self) -> dict[str, int]:
        from ..testing.fault_proxy import fault_counts

        return fault_counts(self.log)


@dataclass(frozen=True)
class RowFault:
    """Break ``endpoint`` on the given attempts of ``rollouts`` rollouts of a dataset row, in the order they reach
    the proxy: the first ``rollouts`` of them, or those after the first ``skip``. ``fault="regrade"`` does not
    break the call: it plants a verify reward of 1.0 (a success the policy did not have to earn)."""

    endpoint: str  # "seed_session", "verify", "browser_click", ...
    attempts: tuple[int, ...]
    rollouts: int
    fault: str = "status"  # "status" (503), "drop", "lose_session", "hang", "regrade"
    skip: int = 0


def proxy_fault(name: str) -> Any:
    """The :class:`~nemo_gym_browser.testing.faults.Fault` a rule here answers with, by ``name``."""
    from ..testing.faults import Fault

    make = {
        "status": lambda: Fault.status(503),
        "drop": lambda: Fault.drop_connection(None),
        "lose_session": Fault.lose_session,
        "hang": Fault.hang,  # held until the client gives up (its call timeout), then never forwarded
        "regrade": lambda: Fault.regrade(1.0),
    }
    if name not in make:
        raise ValueError(f"unknown fault {name!r}; expected one of {sorted(make)}")
    return make[name]()


def _unit_draw(*parts: object) -> float:
    """A number in [0, 1) that is a hash of ``parts``: the same every run, whatever the order of the requests."""
    import hashlib

    digest = hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def planned_faults(plan: Mapping[int, RowFault | Sequence[RowFault]]) -> Callable[[Any], Any]:
    """A proxy rule from a plan keyed by dataset row index (the ``index`` column), deterministic whatever the timing.

    Rollouts are told apart by the id the loop gives each (``r<index>-<hex>``) and numbered in the order they first
    reach the proxy, whichever of the group's episodes they are; a row's fault hits the rollouts numbered
    ``skip`` .. ``skip + rollouts - 1``. A row may carry several faults (for different rollouts or endpoints).
    """
    from ..testing.chaos_harness import parse_session_id

    faults = {index: (f,) if isinstance(f, RowFault) else tuple(f) for index, f in plan.items()}
    for row_fault in (f for row in faults.values() for f in row):
        proxy_fault(row_fault.fault)  # an unknown name fails here, not mid-run
    seen: dict[int, list[str]] = {}  # per row, its rollouts in the order they first reached the proxy
    lock = threading.Lock()

    def rule(request: Any) -> Any:
        parsed = parse_session_id(request.session_id)
        if parsed is None:
            return None
        index, attempt = parsed
        if index not in faults:
            return None
        rollout = request.session_id.split(".", 1)[0]
        with lock:
            order = seen.setdefault(index, [])
            if rollout not in order:
                order.append(rollout)
            position = order.index(rollout)
        for row_fault in faults[index]:
            chosen = row_fault.skip <= position < row_fault.skip + row_fault.rollouts
            if chosen and request.endpoint == row_fault.endpoint and attempt in row_fault.attempts:
                return proxy_fault(row_fault.fault)
        return None

    return rule


def random_faults(
    rate: float,
    seed: int,
    endpoint: str = "verify",
    spare_tasks: frozenset[str] = frozenset(),
    kind: str = "status",
) -> Callable[[Any], Any]:
    """A proxy rule that fails ``endpoint`` for a fraction ``rate`` of all sessions (each attempt drawn anew).

    The draw is a hash of the session id and ``seed``, so it does not depend on request order or timing; over many
    sessions the fraction converges to ``rate``. A fault at verify spoils an episode after the policy acted, however
    much it browsed: the recipe re-runs it (a 503 is ``verify_unavailable``, see ``FAULT_KINDS``), stock GRPO scores
    it 0. Sessions of ``spare_tasks`` (e.g. the held-back tasks validation runs) are never faulted, so validation
    measures the policy alone. ``kind`` names the :func:`proxy_fault` (default ``status``, a 503).
    """
    _check_rate(rate)
    proxy_fault(kind)

    def rule(request: Any) -> Any:
        if request.endpoint != endpoint or not request.session_id or request.task_id in spare_tasks:
            return None
        return proxy_fault(kind) if _unit_draw(seed, request.session_id) < rate else None

    return rule


def browser_call_faults(
    rate: float, seed: int, kind: str = "status", spare_tasks: frozenset[str] = frozenset()
) -> Callable[[Any], Any]:
    """A proxy rule that fails each browser action call (observe, navigate, click, type) with probability ``rate``.

    Real infrastructure fails while the browser works, so an episode is exposed in proportion to the browser calls
    it makes, and one that answers at once (``finish`` first) is never hit: seed, finish, verify and close are never
    faulted. Each call is drawn on its own, from a hash of ``seed``, the session id and the call's index among its
    session's browser calls (counted by the rule, per session), so the draw depends neither on timing nor on other
    sessions' traffic. The loop records ``kind`` (see ``FAULT_KINDS``) as ``server_error`` (status), ``session_lost``
    (lose_session) or ``timeout`` (hang, after the client's ``call_timeout_s``), ends the attempt and re-runs the
    rollout in a new session, which is drawn anew. Sessions of ``spare_tasks`` are never faulted.
    """
    from ..environment import TOOL_NAMES

    _check_rate(rate)
    proxy_fault(kind)
    browser_calls = frozenset(TOOL_NAMES) - {"browser_finish"}
    calls: dict[str, int] = {}  # session id -> its browser calls so far; forgotten at its close
    lock = threading.Lock()

    def rule(request: Any) -> Any:
        if not request.session_id or request.task_id in spare_tasks:
            return None
        if request.endpoint == "close_session":
            with lock:
                calls.pop(request.session_id, None)
            return None
        if request.endpoint not in browser_calls:
            return None
        with lock:
            index = calls.get(request.session_id, 0)
            calls[request.session_id] = index + 1
        return proxy_fault(kind) if _unit_draw(seed, request.session_id, index) < rate else None

    return rule


def metric(steps: Mapping[int, Mapping[str, Any]], step: int, key: str) -> float:
    """One logged metric of one step as a float; NaN when it was not logged."""
    value = steps.get(step, {}).get(key)
    return float(value) if value is not None else math.nan


__all__ = [
    "FAULT_KINDS",
    "FAULT_POINTS",
    "FaultSpec",
    "InjectedFaults",
    "RowFault",
    "RunResult",
    "RunSpec",
    "browser_call_faults",
    "hydra_overrides",
    "main_ppo_command",
    "metric",
    "planned_faults",
    "process_environment",
    "proxy_fault",
    "random_faults",
    "read_advantages",
    "read_step_metrics",
    "run_main_ppo",
]


# ------------------------------------------------------------------------------------------------------------ CLI
# The compact per-step line the CLI prints: (metric key, column title, format).
SUMMARY_COLUMNS = (
    ("timing_s/step", "step s", "{:7.1f}"),
    ("timing_s/gen", "gen s", "{:6.1f}"),
    ("critic/score/mean", "reward", "{:6.3f}"),
    ("env/browsed_rate", "browsed", "{:7.3f}"),
    ("env/invalid_rate", "invalid", "{:7.3f}"),
    ("env/resampled_rate", "resampled", "{:9.3f}"),
    ("grpo_env_aware/invalid_fraction", "flagged", "{:7.3f}"),
    (f"val-core/{DATA_SOURCE}/reward/mean@1", "held-back success", "{:17.3f}"),
)


def summary_header() -> str:
    widths = [len(fmt.format(0.0)) for _, _, fmt in SUMMARY_COLUMNS]
    return "step " + " ".join(title.rjust(width) for (_, title, _), width in zip(SUMMARY_COLUMNS, widths, strict=True))


def summary_line(step: int, metrics: Mapping[str, Any]) -> str:
    cells = []
    for key, _, fmt in SUMMARY_COLUMNS:
        value = metrics.get(key)
        cells.append(fmt.format(float(value)) if value is not None else "-".rjust(len(fmt.format(0.0))))
    return f"{step:4d} " + " ".join(cells)


def prepare_task_rows(workdir: Path, train_tasks: Path, val_tasks: Path) -> tuple[Path, Path]:
    """Rows for ``main_ppo`` from two WebVoyager-format task files (``data-train/``, ``data-val/`` in ``workdir``)."""
    from ..prepare_webvoyager_data import prepare_rows

    return prepare_rows(train_tasks, workdir / "data-train"), prepare_rows(val_tasks, workdir / "data-val")


def tiny_policy_folder(workdir: Path, seed: int = 0) -> Path:
    """The warm-started tiny policy for the shop tasks, built once per ``workdir`` (about a minute on 2 cores)."""
    from . import tiny_policy

    folder = workdir / f"tiny-policy-seed{seed}"
    if not (folder / tiny_policy.REPORT_FILE).exists():
        tiny_policy.build(folder, warm=tiny_policy.WarmStartSpec(seed=seed))
    return folder


def deal_policy_folder(workdir: Path, seed: int = 0) -> Path:
    """The tiny policy warm-started for the deal tasks: the shipped ``local/deal_policy/`` for seed 0 (built by
    ``tiny_policy build-deal``, about 15 minutes), else built once per ``workdir`` with that seed."""
    from . import tiny_policy

    if seed == 0 and (tiny_policy.DEAL_POLICY_DIR / tiny_policy.REPORT_FILE).exists():
        return tiny_policy.DEAL_POLICY_DIR
    folder = workdir / f"deal-policy-seed{seed}"
    if not (folder / tiny_policy.REPORT_FILE).exists():
        tiny_policy.build_deal(folder, seed=seed)
    return folder


@contextlib.contextmanager
def shop_environment(kind: str = "real") -> Iterator[str]:
    """The URL of an ``interactive_browser`` serving the Corner Shop: nemo-gym 0.7.0 with Chromium on 127.0.0.1
    (``real``, the site served on its fixed port) or the fake server in a thread (``fake``: the same observations,
    checked against Chromium by the integration tier, for the CPU's sake)."""
    from . import shop_tasks

    if kind == "fake":
        from ..testing.fake_environment import FakeEnvironmentServer

        with FakeEnvironmentServer(site=shop_tasks.fake_site()).run_in_thread() as fake:
            yield fake.url
    elif kind == "real":
        from ..launch_environment import LocalEnvironment

        with shop_tasks.serve(), LocalEnvironment() as real:
            yield real.url
    else:
        raise ValueError(f"environment must be 'real' or 'fake', not {kind!r}")


def _parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.training_run",
        description="Train a policy for a few steps with verl's real main_ppo and this recipe, on this machine: the "
        "local Corner Shop site, a real nemo-gym interactive_browser with headless Chromium on 127.0.0.1, the fault "
        "proxy injecting infrastructure failures, BrowserToolAgentLoop and grpo_env_aware. Prints one line per step.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
examples:
  # two steps of the warm-started tiny policy on the CPU backend (a few minutes on 2 cores)
  python -m nemo_gym_browser.local.training_run --workdir /tmp/train

  # 30 % of training episodes spoiled by the environment (verify answers 503; never the held-back tasks that
  # validation runs), stock GRPO instead of the recipe
  python -m nemo_gym_browser.local.training_run --workdir /tmp/stock --fault-rate 0.3 --estimator grpo

  # each browser call (observe, navigate, click, type) of a training episode loses its session with chance 0.1:
  # an episode that browses more fails more often, one that finishes at once never
  python -m nemo_gym_browser.local.training_run --workdir /tmp/calls --fault-rate 0.1 --fault-at browser-call \\
      --fault-kind lose_session

  # browser calls that never answer, each cut after 15 s instead of the recipe's 120 s
  python -m nemo_gym_browser.local.training_run --workdir /tmp/hangs --fault-rate 0.1 --fault-at browser-call \\
      --fault-kind hang --call-timeout 15

  # one GPU with vLLM (see scripts/gpu_check.sh)
  python -m nemo_gym_browser.local.training_run --workdir /tmp/gpu --rollout vllm \\
      --model /models/Qwen2.5-0.5B-Instruct

injected faults: the fault proxy between the trainer and the environment server fails training sessions (never
those of the held-back tasks), each fault an infrastructure failure the recipe re-runs and stock GRPO scores 0.
  --fault-at verify        a share --fault-rate of sessions fails at verify, after the policy acted however much
                           it browsed (the default; the draw is per session)
  --fault-at browser-call  each observe, navigate, click and type call fails with chance --fault-rate, drawn per
                           call; seed, finish, verify and close never fail
  --fault-kind             what the faulted call meets, and what the loop records (at a browser call / at verify):
      status               the proxy answers 503 (the default): server_error / verify_unavailable
      lose_session         the proxy strips the session cookie, so the server no longer knows the session:
                           session_lost / session_lost
      hang                 the call is held until the client gives up: timeout after --call-timeout /
                           verify_unavailable after the verify timeout (60 s). No quicker form is recorded as
                           timeout, so a hang costs a whole call timeout: lower --call-timeout with it
The draws are hashes of --seed and the session id (and the call's place in its session), so they depend neither
on timing nor on other sessions; the proxy's counts are printed at the end.

what is written to --workdir: the task rows, the tiny policy (unless --model), and run/ with main_ppo.log,
metrics.jsonl (verl's own per-step metrics), advantages.jsonl (every sample's flag, score and advantage) and
checkpoints/.

The CPU backend (rollout hfcpu) stands in for vLLM on machines without a GPU; it is never meant for GPU nodes.
exit status: 0 trained, 1 training failed, 2 usage error.""",
    )
    parser.add_argument(
        "--workdir", type=Path, required=True, metavar="DIR", help="where the rows, the policy and run/ go (see below)"
    )
    parser.add_argument(
        "--suite",
        choices=("lookup", "deal"),
        default="lookup",
        help="the Corner Shop tasks: lookup (act on the element the task names, out of the tiny policy's reach; "
        "default) or deal (name the fruit a board marks on sale, by reading the board or from memory: learnable)",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps (default %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="GRPO groups per step (default %(default)s)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per group, rollout.n (default %(default)s)")
    parser.add_argument(
        "--estimator",
        choices=(RECIPE_ESTIMATOR, STOCK_ESTIMATOR),
        default=RECIPE_ESTIMATOR,
        help=f"{RECIPE_ESTIMATOR} (the recipe, default) or {STOCK_ESTIMATOR} (stock verl GRPO: the recipe's wiring "
        "off, one attempt, failures scored 0)",
    )
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="chance of an injected fault, per session (--fault-at verify) or per browser call (browser-call); "
        "default 0, none",
    )
    parser.add_argument(
        "--fault-at",
        choices=FAULT_POINTS,
        default=FaultSpec.at,
        help="where faults strike: verify (default) or every browser action call (see below)",
    )
    parser.add_argument(
        "--fault-kind",
        choices=FAULT_KINDS,
        default=FaultSpec.kind,
        help="what a faulted call meets: status (503, default), lose_session or hang (see below)",
    )
    parser.add_argument(
        "--call-timeout",
        type=float,
        metavar="S",
        help="seconds a browser call may take before it is an infrastructure timeout (default: configs/"
        "agent_loop.yaml's 120); each hang fault at a browser call costs this long",
    )
    parser.add_argument("--lr", type=float, default=RunSpec.lr, help="default %(default)s")
    parser.add_argument(
        "--test-freq", type=int, default=-1, help="validate on the held-back tasks every N steps (default: never)"
    )
    parser.add_argument(
        "--val-tasks", type=int, metavar="N", help="validate on the first N held-back tasks only (default: all)"
    )
    parser.add_argument("--rollout", default=CPU_ROLLOUT, help="rollout backend: hfcpu (CPU, default) or vllm")
    parser.add_argument("--model", type=Path, help="a model folder (default: build and warm-start the tiny policy)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the warm start, the data order and the fault draw")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds before the run is stopped (default %(default)s)"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra hydra override for main_ppo, repeatable (e.g. nemo_gym_browser.trajectory_dir=DIR)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..launch_environment import LocalEnvironment
    from . import shop_tasks

    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompts_per_step < 1 or args.group_size < 1:
        parser.error("--steps, --prompts-per-step and --group-size must be at least 1")
    try:
        faults_spec = FaultSpec(rate=args.fault_rate, at=args.fault_at, kind=args.fault_kind)
    except ValueError as exc:
        parser.error(f"--fault-rate/--fault-at/--fault-kind: {exc}")
    if args.call_timeout is not None and args.call_timeout <= 0:
        parser.error("--call-timeout must be positive")
    if args.val_tasks is not None and args.val_tasks < 1:
        parser.error("--val-tasks must be at least 1")
    if args.rollout != CPU_ROLLOUT and args.model is None:
        # the CPU policy's attention heads (16 wide) are narrower than vLLM's FlashInfer and Triton backends take
        parser.error(f"--rollout {args.rollout} needs --model (scripts/gpu_check.sh builds a policy vLLM can serve)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    train, val = prepare_task_rows(workdir, *shop_tasks.SUITE_FILES[args.suite])
    if args.val_tasks is not None:
        lines = val.read_text(encoding="utf-8").splitlines(keepends=True)
        val.write_text("".join(lines[: args.val_tasks]), encoding="utf-8")
    if args.model is None and not (args.suite == "deal" and args.seed == 0):  # seed 0's deal policy is shipped
        print(f"building and warm-starting the tiny policy for the {args.suite} tasks ...", flush=True)
    policy_folder = deal_policy_folder if args.suite == "deal" else tiny_policy_folder
    model = args.model.resolve() if args.model else policy_folder(workdir, args.seed)
    print(f"model {model}; tasks {train} / held back {val}", flush=True)

    with shop_tasks.serve(), LocalEnvironment() as environment:
        held_back = frozenset(record["id"] for record in shop_tasks.task_records("heldback", suite=args.suite))
        rule = faults_spec.rule(args.seed, spare_tasks=held_back)
        with InjectedFaults(environment.url, rule) as faults:
            spec = RunSpec(
                model_path=model,
                train_file=train,
                val_file=val,
                server_urls=(faults.url,),
                output_dir=workdir / "run",
                steps=args.steps,
                prompts_per_step=args.prompts_per_step,
                group_size=args.group_size,
                estimator=args.estimator,
                lr=args.lr,
                test_freq=args.test_freq,
                val_before_train=args.test_freq > 0,
                seed=args.seed,
                rollout_name=args.rollout,
                extra_overrides=tuple(args.override),
                faults=faults_spec,
                call_timeout_s=args.call_timeout,
            )
            print(f"main_ppo: {spec.log_path}\n{summary_header()}", flush=True)
            result = run_main_ppo(spec, timeout_s=args.timeout, on_line=_step_printer(spec))
            left_open = faults.open_session_ids
            injected = faults.counts()
    print(
        f"main_ppo exited {result.returncode} after {result.elapsed_s:.0f} s, peak memory "
        f"{result.peak_memory_bytes / 2**30:.1f} GiB (PSS of its process tree); sessions left open: {len(left_open)}; "
        f"faults injected at {faults_spec.at}: {injected or 'none'}"
    )
    if not result.ok:
        print(result.log_tail(40), file=sys.stderr)
        return 1
    print(before_and_after(result.steps))
    return 0


def before_and_after(steps: Mapping[int, Mapping[str, Any]]) -> str:
    """One line: held-back success (and how often validation episodes browsed) at the first and last validation."""
    key = f"val-core/{DATA_SOURCE}/reward/mean@1"
    validated = sorted(step for step, metrics in steps.items() if key in metrics)
    if not validated:
        return "no validation ran (--test-freq)"
    first, last = validated[0], validated[-1]
    browsed = f"val-aux/{DATA_SOURCE}/env/browsed/mean@1"

    def at(step: int) -> str:
        share = steps[step].get(browsed)
        return f"{float(steps[step][key]):.3f}" + (
            f" ({float(share):.0%} of episodes browsed)" if share is not None else ""
        )

    return f"held-back success: {at(first)} at step {first} -> {at(last)} at step {last}"


def _step_printer(spec: RunSpec) -> Callable[[str], None]:
    """Prints the summary line of each step as soon as verl logs it (the metrics file has it by then)."""
    import re

    printed: set[int] = set()
    pattern = re.compile(r"\bstep:(\d+) - ")

    def on_line(line: str) -> None:
        match = pattern.search(line)
        if match is None:
            return
        step = int(match.group(1))
        metrics = read_step_metrics(spec.metrics_path).get(step)
        if metrics is not None and step not in printed:
            printed.add(step)
            print(summary_line(step, metrics), flush=True)

    return on_line


if __name__ == "__main__":
    raise SystemExit(main())
