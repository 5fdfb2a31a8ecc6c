"""The ``cpu`` verl platform: what verl's device-agnostic code needs to run with no accelerator at all.

A stand-in for the CUDA platform for tests, CI and the local rehearsal; never a default and never on a GPU node.

Contract: :class:`PlatformCPU`, registered with verl's ``PlatformRegistry`` as ``cpu`` at import, is picked only
through ``VERL_PLATFORM=cpu`` (its ``is_platform_available`` is always false). :class:`CpuDeviceModule` is what
``get_torch_device()`` returns in place of ``torch.cuda``: ``torch.cpu`` plus the memory and RNG calls verl makes,
answered from the process; anything else raises ``AttributeError``, so an unknown verl call site fails loudly.
:func:`install_workarounds` (at import, only under ``VERL_PLATFORM=cpu``) patches two blockers of verl 0.9.1 on CPU:
the duplicate ``cpu:gloo`` process-group backend and ``CPUOffloadPolicy(pin_memory=True)``.

Errors: creating the platform where ``torch.cuda.is_available()`` raises, unless
``NEMO_GYM_BROWSER_CPU_BACKEND_FORCE=1``. Details: ``docs/rehearsal-and-cpu-training.md#the-cpu-backend-in-detail``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from . import FORCE_ENV, PLATFORM_NAME

logger = logging.getLogger(__name__)

__all__ = ["CpuDeviceModule", "PlatformCPU", "cpu_platform_selected", "install_workarounds", "refuse_on_cuda_host"]

# Linux reports ru_maxrss in KiB.
_MAXRSS_UNIT = 1024
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def cpu_platform_selected() -> bool:
    """Whether this process runs verl on the ``cpu`` platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def refuse_on_cuda_host(component: str) -> None:
    """Raise when CUDA is usable here and the operator did not force the CPU backend."""
    if os.environ.get(FORCE_ENV) == "1" or not torch.cuda.is_available():
        return
    raise RuntimeError(
        f"{component} is the CPU stand-in for machines without a GPU, and this host has CUDA: use the cuda platform "
        f"and vLLM here (or set {FORCE_ENV}=1 to debug the CPU backend itself)"
    )


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * _PAGE_SIZE


def _peak_resident_bytes() -> int:
    # The kernel's high-water mark lags the current size by a page or two; a peak is never below the present.
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT, _resident_bytes())


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


class CpuDeviceModule:
    """``torch.cpu`` plus the memory and RNG calls verl makes on ``get_torch_device()``.

    "Device memory" is the host memory of this process: ``memory_allocated`` is the resident set size now and
    ``max_memory_allocated`` its peak over the process lifetime (so ``perf/max_memory_allocated_gb`` reports what
    the worker really used).
    """

    def __getattr__(self, name: str) -> Any:
        # Only called for names not defined below: torch.cpu's own (current_device, synchronize, Stream, ...).
        return getattr(torch.cpu, name)

    def empty_cache(self) -> None:
        """Nothing to do: the CPU allocator keeps no cache to hand back."""

    def memory_allocated(self, device: Any = None) -> int:
        return _resident_bytes()

    def memory_reserved(self, device: Any = None) -> int:
        return _resident_bytes()

    def max_memory_allocated(self, device: Any = None) -> int:
        return _peak_resident_bytes()

    def max_memory_reserved(self, device: Any = None) -> int:
        return _peak_resident_bytes()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return _meminfo_bytes("MemAvailable"), _meminfo_bytes("MemTotal")

    def get_device_name(self, device: Any = None) -> str:
        return "CPU"

    def get_rng_state(self, device: Any = "cpu") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cpu") -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)


_DEVICE_MODULE = CpuDeviceModule()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl's platform interface answered for the host CPU."""

    def __init__(self) -> None:
        refuse_on_cuda_host("the verl 'cpu' platform")

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> CpuDeviceModule:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: the CPU platform is chosen explicitly with VERL_PLATFORM=cpu or not at all.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        # "cpu", as torch.cpu.current_device(): an integer would mean cuda:N to tensor.to().
        return torch.cpu.current_device()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """Nothing to select: there is one CPU device."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU kernels are synchronous."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The settings verl passes (expandable segments) exist only for device allocators."""

    def empty_cache(self) -> None:
        """Nothing to release (see :meth:`CpuDeviceModule.empty_cache`)."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets it for the logical GPU each worker holds; torch on CPU ignores it.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield  # no NVTX without NVIDIA tools

    def profiler_start(self) -> None:
        """No device profiler on CPU."""

    def profiler_stop(self) -> None:
        """No device profiler on CPU."""

    def ray_resource_name(self) -> str:
        # verl's resource pool counts only "GPU"/"NPU" and asks for use_gpu=True: the workers hold a logical GPU
        # (ray.init(num_gpus=N)) that maps to no hardware.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


# ----- the two workarounds, only for the cpu platform


def install_workarounds() -> list[str]:
    """Install the CPU workarounds in this process (idempotent); return the names it patched this time."""
    patched = []
    if _patch_gloo_backend():
        patched.append("initialize_global_process_group_ray")
    if _patch_cpu_offload_policy():
        patched.append("CPUOffloadPolicy")
    if patched:
        logger.info("cpu platform: patched %s for verl on CPU", ", ".join(patched))
    return patched


def _patch_gloo_backend() -> bool:
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_cpu_backend_gloo", False):
        return False

    @functools.wraps(original)
    def initialize_with_gloo(timeout_second: int | None = None, backend: str | None = None) -> Any:
        # verl's default "cpu:gloo,{device}:{backend}" names the cpu device twice on this platform.
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_with_gloo._cpu_backend_gloo = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize_with_gloo
    # Modules that already imported the name by value keep the original unless rebound too.
    for name in ("verl.workers.engine_workers",):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "initialize_global_process_group_ray", None) is original:
            module.initialize_global_process_group_ray = initialize_with_gloo
    return True


def _patch_cpu_offload_policy() -> bool:
    import verl.utils.fsdp_utils as fsdp_utils

    policy = fsdp_utils.CPUOffloadPolicy
    if policy is None or getattr(policy, "_cpu_backend_unpinned", False):
        return False

    class UnpinnedCPUOffloadPolicy(policy):  # type: ignore[misc, valid-type]
        """FSDP2's CPU offload policy without pinned memory, which needs an accelerator to allocate."""

        _cpu_backend_unpinned = True

        def __init__(self, pin_memory: bool = False, **kwargs: Any) -> None:
            super().__init__(pin_memory=False, **kwargs)

    fsdp_utils.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy
    module = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if module is not None and getattr(module, "CPUOffloadPolicy", None) is policy:
        module.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy
    return True


if cpu_platform_selected():
    install_workarounds()
