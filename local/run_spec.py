"""One short ``main_ppo`` run of this recipe on one machine, and the exact command line and environment it implies.

:class:`RunSpec` names the run (model folder, data files, environment servers, sizes, estimator, checkpointing);
:func:`hydra_overrides`, :func:`process_environment` and :func:`main_ppo_command` turn it into
``python -m verl.trainer.main_ppo`` on ``configs/webvoyager_grpo.yaml`` (the recipe's own trainer config, as
``submit_webvoyager.sh`` uses it) with small sizes and, unless ``rollout_name`` says otherwise, the CPU backend of
:mod:`nemo_gym_browser.local.cpu_backend` in place of vLLM. ``rollout_name="vllm-cpu"`` (:data:`VLLM_CPU_ENGINE`)
runs verl's own vLLM rollout on vLLM's CPU build instead (:mod:`nemo_gym_browser.local.vllm_cpu`, in
``.venv-vllm``: :func:`main_ppo_python`). Building a command starts nothing.

The stock arm (``estimator="grpo"``) is verl's GRPO as it ships: the recipe's trainer wiring is switched off
(``NEMO_GYM_BROWSER_PATCHES=0``), each rollout gets one attempt and a failure enters its group as a zero.

Layout of ``RunSpec.output_dir``: ``command.txt``, ``main_ppo.log``, ``metrics.jsonl`` (verl's per-step metrics),
``advantages.jsonl`` (every sample's flag, score and advantage per step; recipe arm only), ``checkpoints/``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..settings import DROP_INVALID_ENV
from ..trainer_side.wiring import ESTIMATOR_NAME
from .faults.injected import FaultSpec

RECIPE_DIR = Path(__file__).resolve().parent.parent
CONFIG_DIR = RECIPE_DIR / "configs"
METRICS_FILE = "metrics.jsonl"
ADVANTAGES_FILE = "advantages.jsonl"  # wiring.ADVANTAGE_LOG_ENV: every sample's flag, score and advantage per step
LOG_FILE = "main_ppo.log"
CHECKPOINT_DIR = "checkpoints"
STOCK_ESTIMATOR = "grpo"
CPU_ROLLOUT = "hfcpu"  # cpu_backend.ROLLOUT_NAME, not imported here so that building a command imports nothing
# verl's own rollout name=vllm, on vLLM's CPU build and verl's cpu platform (local/vllm_cpu); needs .venv-vllm
VLLM_CPU_ENGINE = "vllm-cpu"
VLLM_VENV_ENV = "NEMO_GYM_BROWSER_VLLM_VENV"  # as scripts/setup_vllm.sh reads it; default RECIPE_DIR/.venv-vllm
RECIPE_ESTIMATOR = ESTIMATOR_NAME


# Browsers open at once per core on a machine that also trains: bench/session_capacity.py on 2 cores served 4 at once
# at the best wall time per episode (seed 1.4 s median) and 16 at 14.8 s median, 32 at 34 s (a seed timed out at
# 120 s once main_ppo's generation shared the cores with 48); memory ~0.15 GiB per open browser.
SESSIONS_PER_CORE = 2


def local_session_cap() -> int:
    """How many browsers a local run keeps open at once: :data:`SESSIONS_PER_CORE` per core this process may use."""
    return SESSIONS_PER_CORE * max(1, len(os.sched_getaffinity(0)))


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
    # the CPU backend; VLLM_CPU_ENGINE for verl's vLLM rollout on CPU; "vllm" on a GPU machine (scripts/gpu_check.sh)
    rollout_name: str = CPU_ROLLOUT
    agent_workers: int = 1
    extra_overrides: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # What the driver's fault proxy injects. main_ppo never sees it: whoever starts the proxy builds its rule from it.
    faults: FaultSpec = FaultSpec()  # noqa: RUF009 (frozen, so one shared default is safe)
    # environment.call_timeout_s; None keeps the setting's default. A "hang" fault at a browser call costs this.
    call_timeout_s: float | None = None
    # environment.max_sessions_per_server: sessions wait for a free browser instead of crowding the machine
    max_sessions_per_server: int = field(default_factory=local_session_cap)

    def __post_init__(self) -> None:
        if self.call_timeout_s is not None and self.call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be positive, not {self.call_timeout_s}")
        if self.estimator not in (RECIPE_ESTIMATOR, STOCK_ESTIMATOR):
            raise ValueError(f"estimator must be {RECIPE_ESTIMATOR!r} or {STOCK_ESTIMATOR!r}, not {self.estimator!r}")
        if self.max_sessions_per_server < 1:
            raise ValueError(f"max_sessions_per_server must be at least 1, not {self.max_sessions_per_server}")
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


def hydra_string(value: str | Path) -> str:
    """A hydra override value quoted so that commas, colons and brackets in paths and URLs stay literal."""
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def hydra_overrides(spec: RunSpec) -> list[str]:
    """The ``main_ppo`` overrides on top of ``configs/webvoyager_grpo.yaml`` for ``spec``, one per element."""
    tokens = spec.max_prompt_length + spec.max_response_length
    urls = ",".join(hydra_string(url) for url in spec.server_urls)
    overrides = [
        f"actor_rollout_ref.model.path={hydra_string(spec.model_path)}",
        f"data.train_files={hydra_string(spec.train_file)}",
        f"data.val_files={hydra_string(spec.val_file)}",
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
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={hydra_string(CONFIG_DIR / 'browser_tool.yaml')}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={hydra_string(CONFIG_DIR / 'agent_loop.yaml')}",
        f"actor_rollout_ref.rollout.agent.num_workers={spec.agent_workers}",
        f"algorithm.adv_estimator={spec.estimator}",
        "+ray_kwargs.ray_init.address=local",  # a private Ray instance, never a cluster already running here
        f"nemo_gym_browser.environment.server_urls=[{urls}]",
        f"nemo_gym_browser.episode_deadline_s={spec.episode_deadline_s}",
        f"nemo_gym_browser.environment.max_sessions_per_server={spec.max_sessions_per_server}",
        f"nemo_gym_browser.max_attempts={1 if spec.stock else spec.max_attempts}",
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={spec.steps}",
        f"trainer.save_freq={spec.save_freq}",
        f"trainer.test_freq={spec.test_freq}",
        f"trainer.val_before_train={spec.val_before_train}",
        f"trainer.resume_mode={'auto' if spec.resume else 'disable'}",
        f"trainer.default_local_dir={hydra_string(spec.checkpoint_dir)}",
        "trainer.project_name=nemo_gym_browser_local",
        f"trainer.experiment_name={spec.output_dir.name}",
    ]
    if spec.rollout_name == CPU_ROLLOUT:
        overrides += _cpu_backend().cpu_overrides()
    elif spec.rollout_name == VLLM_CPU_ENGINE:
        overrides += _vllm_cpu().vllm_cpu_overrides(max_model_len=tokens)
        # verl starts 8 reward workers; each imports torch 2.11's CUDA build (~0.5 GB: 3.8 GB of a measured 10 GiB
        # run) to score nothing, since the agent loop scores its own episodes.
        overrides.append("reward.num_workers=1")
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
    from .wide_heads import widened_from  # imports torch: only when a command is built

    source_type = widened_from(spec.model_path)
    if source_type is not None:  # a widened copy keeps its original's chat template (local/wide_heads.py)
        overrides.append(f"++nemo_gym_browser.token_builder_model_type={source_type}")
    if spec.call_timeout_s is not None:  # ++: the key is not in webvoyager_grpo.yaml's nemo_gym_browser section
        overrides.append(f"++nemo_gym_browser.environment.call_timeout_s={spec.call_timeout_s}")
    return overrides + list(spec.extra_overrides)


def _cpu_backend() -> Any:
    from . import cpu_backend

    return cpu_backend


def _vllm_cpu() -> Any:
    from . import vllm_cpu

    return vllm_cpu


def process_environment(spec: RunSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the ``main_ppo`` process (its local Ray cluster's workers inherit it)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(p for p in (str(RECIPE_DIR), env.get("PYTHONPATH", "")) if p),
            "VERL_FILE_LOGGER_PATH": str(spec.metrics_path),
            "NEMO_GYM_BROWSER_ADVANTAGE_LOG": str(spec.advantages_path),
            DROP_INVALID_ENV: "1" if spec.drop_invalid and not spec.stock else "0",
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
    elif spec.rollout_name == VLLM_CPU_ENGINE:
        env.update(_vllm_cpu().vllm_cpu_env())
    env.update(spec.extra_env)
    return env


def main_ppo_python(spec: RunSpec) -> str:
    """The interpreter ``main_ppo`` runs with: ``.venv-vllm``'s for :data:`VLLM_CPU_ENGINE` (vLLM's CPU build needs
    torch 2.11.0, .venv has 2.13.0), this one otherwise."""
    if spec.rollout_name != VLLM_CPU_ENGINE:
        return sys.executable
    venv = Path(os.environ.get(VLLM_VENV_ENV) or RECIPE_DIR / ".venv-vllm")
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(
            f"{python} does not exist: bash scripts/setup_vllm.sh creates the venv for {spec.rollout_name}"
        )
    return str(python)


def main_ppo_command(spec: RunSpec, python: str = sys.executable) -> list[str]:
    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={CONFIG_DIR}",
        "--config-name=webvoyager_grpo",
        *hydra_overrides(spec),
    ]
