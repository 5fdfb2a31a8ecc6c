"""Getting the per-sample flags to ``grpo_env_aware`` and to the step metrics inside verl 0.9.1's two PPO trainers:
installing the wrappers of :mod:`trainer_wrappers` into verl.

Guarantees: a batch whose samples carry ``env_invalid`` under estimator ``grpo`` or ``grpo_env_aware`` gets its
advantages from ``grpo_env_aware``, and every step whose batch carries flags gets the ``env/*`` metrics; every other
call goes to verl's own function with the same arguments, so a run without flags is bit-identical to stock verl.

Lifetimes: ``install()`` patches the four verl modules now; ``install_on_import()`` (``sitecustomize.py``, the
``verl.plugins`` entry point) patches each when it is first imported. Both are idempotent, log one line when they
change something, and do nothing under ``NEMO_GYM_BROWSER_PATCHES=0``. Importing this module imports neither torch
nor verl.

Errors: :class:`~nemo_gym_browser.trainer_side.wiring.PatchError`, naming the installed verl version, when a wrapped
function is missing or no longer has the shape it was written against. What is wrapped and why wrappers:
``docs/estimator-and-wiring.md``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .trainer_side.wiring import (
    CORE_ALGOS,
    ESTIMATOR_MARK,
    ESTIMATOR_NAME,
    PATCHES_ENV,
    RAY_TRAINER,
    TARGETS,
    V1_TRAINER_BASE,
    V1_UTILS,
    PatchError,
)

logger = logging.getLogger(__name__)

REQUIRED_VERL_FILE = "REQUIRED_VERL.txt"  # KEY=VALUE, next to this module; VERL_VERSION is what the patches target

_ORIGINAL_ATTR = "__nemo_gym_browser_original__"
_HOOK_ATTR = "nemo_gym_browser_post_import_hook"
_OFF_VALUES = frozenset({"0", "false", "no", "off"})

_lock = threading.RLock()
_wrappers: dict[Any, Callable[..., Any]] = {}  # original -> its one wrapper, so every binding shares it
_logged: set[str] = set()


def patches_enabled() -> bool:
    """False when ``NEMO_GYM_BROWSER_PATCHES`` switches the recipe's patching off."""
    return os.environ.get(PATCHES_ENV, "1").strip().lower() not in _OFF_VALUES


def verl_version() -> str:
    import importlib.metadata  # not at module top: this module is imported at interpreter start-up

    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get("verl"), "__version__", "unknown")


def install() -> bool:
    """Patch verl's trainers now (imports them). Idempotent; returns False when the switch turns patching off."""
    if not _enabled_or_log():
        return False
    modules = [importlib.import_module(name) for name in TARGETS]
    with _lock:
        changed = [name for name, module in zip(TARGETS, modules, strict=True) if _APPLY[name](module)]
    if changed and "install" not in _logged:
        _logged.add("install")
        logger.info("nemo_gym_browser: trainer wiring installed on verl %s (%s)", verl_version(), changed)
    return True


def install_on_import() -> bool:
    """Patch each target verl module when it is imported; patch already-imported ones now. Idempotent."""
    if not _enabled_or_log():
        return False
    with _lock:
        if not any(getattr(finder, _HOOK_ATTR, False) for finder in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())
        for name in TARGETS:
            module = sys.modules.get(name)
            if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
                _apply_logged(name, module)
    return True


def installed_targets() -> list[str]:
    """The target modules whose wiring is in place in this process (for checks and tests)."""
    done = []
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None and _is_patched(name, module):
            done.append(name)
    return done


# ---------------------------------------------------------------------------------------------------------------
# Per-module patches. Each returns True when it changed something and is a no-op the second time.


def _patch_core_algos(module: ModuleType) -> bool:
    for name in ("register_adv_est", "ADV_ESTIMATOR_REGISTRY", "AdvantageEstimator"):
        _require(module, name)
    if _registers_ours(module.ADV_ESTIMATOR_REGISTRY):
        return False
    from . import group_stats

    group_stats.register()
    return True


def _patch_ray_trainer(module: ModuleType) -> bool:
    from .trainer_side import trainer_wrappers as wrap

    _require(module, "compute_response_mask")
    original = _require(module, "compute_advantage", params=("data", "adv_estimator", "norm_adv_by_std_in_grpo"))
    data_metrics = _require(module, "compute_data_metrics", params=("batch", "use_critic"))
    trainer_cls = _require(module, "RayPPOTrainer")
    _require(trainer_cls, "fit", calls="compute_data_metrics")
    val_metrics = _require(
        trainer_cls, "_val_metrics_update", params=("self", "sample_uids", "reward_extra_infos_dict")
    )
    _require(trainer_cls, "_validate", calls="_val_metrics_update")
    changed = _rebind(module, "compute_advantage", original, wrap.make_compute_advantage_wrapper)
    changed = _rebind(trainer_cls, "_val_metrics_update", val_metrics, wrap.make_val_metrics_wrapper) or changed
    return _rebind(module, "compute_data_metrics", data_metrics, wrap.make_data_metrics_wrapper) or changed


def _patch_v1_utils(module: ModuleType) -> bool:
    from .trainer_side import trainer_wrappers as wrap

    compute_advantage = _require(module, "compute_advantage", params=("data", "adv_estimator"))
    multi = _require(
        module,
        "compute_advantage_for_multi_trajectories",
        params=("data", "batch_keys", "adv_estimator"),
        calls="compute_advantage",
    )
    changed = _rebind(module, "compute_advantage", compute_advantage, wrap.make_compute_advantage_wrapper)
    multi_changed = _rebind(
        module, "compute_advantage_for_multi_trajectories", multi, wrap.make_multi_trajectories_wrapper
    )
    return multi_changed or changed


def _patch_v1_trainer_base(module: ModuleType) -> bool:
    from .trainer_side import trainer_wrappers as wrap

    trainer_cls = _require(module, "PPOTrainer")
    method = _require(
        trainer_cls,
        "_compute_advantage",
        params=("self", "batch", "metrics"),
        calls="compute_advantage_for_multi_trajectories",
    )
    multi = _require(module, "compute_advantage_for_multi_trajectories", params=("data", "batch_keys", "adv_estimator"))
    step_metrics = _require(trainer_cls, "_compute_metrics", params=("self", "batch", "metrics"))
    _require(trainer_cls, "fit", calls="_compute_metrics")
    val_metrics = _require(
        trainer_cls,
        "_val_metrics_update",
        params=("self", "sample_uids", "reward_extra_infos_dict", "expected_acc_counts"),
    )
    _require(trainer_cls, "_validate", calls="_val_metrics_update")
    changed = _rebind(module, "compute_advantage_for_multi_trajectories", multi, wrap.make_multi_trajectories_wrapper)
    changed = _rebind(trainer_cls, "_compute_advantage", method, wrap.make_v1_compute_advantage_wrapper) or changed
    changed = _rebind(trainer_cls, "_compute_metrics", step_metrics, wrap.make_v1_compute_metrics_wrapper) or changed
    return _rebind(trainer_cls, "_val_metrics_update", val_metrics, wrap.make_val_metrics_wrapper) or changed


_APPLY: dict[str, Callable[[ModuleType], bool]] = {
    CORE_ALGOS: _patch_core_algos,
    RAY_TRAINER: _patch_ray_trainer,
    V1_UTILS: _patch_v1_utils,
    V1_TRAINER_BASE: _patch_v1_trainer_base,
}


def _registers_ours(registry: dict[str, Any]) -> bool:
    """Whether verl's estimator registry holds this recipe's estimator under its name (group_stats marks it)."""
    return getattr(registry.get(ESTIMATOR_NAME), ESTIMATOR_MARK, False)


def _is_patched(name: str, module: ModuleType) -> bool:
    if name == CORE_ALGOS:
        return _registers_ours(getattr(module, "ADV_ESTIMATOR_REGISTRY", {}))
    if name == RAY_TRAINER:
        return (
            _is_ours(getattr(module, "compute_advantage", None))
            and _is_ours(getattr(module, "compute_data_metrics", None))
            and _is_ours(getattr(getattr(module, "RayPPOTrainer", None), "_val_metrics_update", None))
        )
    if name == V1_UTILS:
        return _is_ours(getattr(module, "compute_advantage", None)) and _is_ours(
            getattr(module, "compute_advantage_for_multi_trajectories", None)
        )
    trainer_cls = getattr(module, "PPOTrainer", None)
    return (
        _is_ours(getattr(trainer_cls, "_compute_advantage", None))
        and _is_ours(getattr(trainer_cls, "_compute_metrics", None))
        and _is_ours(getattr(trainer_cls, "_val_metrics_update", None))
        and _is_ours(getattr(module, "compute_advantage_for_multi_trajectories", None))
    )


def _apply_logged(name: str, module: ModuleType) -> None:
    if _APPLY[name](module) and name not in _logged:
        _logged.add(name)
        logger.info(
            "nemo_gym_browser: patched %s for %s and env/* metrics (verl %s)", name, ESTIMATOR_NAME, verl_version()
        )


def _enabled_or_log() -> bool:
    if patches_enabled():
        return True
    if "disabled" not in _logged:
        _logged.add("disabled")
        logger.info("nemo_gym_browser: patching disabled by %s=%s", PATCHES_ENV, os.environ.get(PATCHES_ENV))
    return False


def _require(owner: Any, name: str, *, params: tuple[str, ...] = (), calls: str | None = None) -> Any:
    """``owner.name``, checked to still take ``params`` and (when given) to still call ``calls`` by name."""
    where = f"{getattr(owner, '__name__', owner)}.{name}"
    target = getattr(owner, name, None)
    if target is None:
        raise PatchError(_mismatch(f"{where} is missing"))
    original = getattr(target, _ORIGINAL_ATTR, target)
    if params:
        try:
            found = list(inspect.signature(original).parameters)
        except (TypeError, ValueError) as exc:
            raise PatchError(_mismatch(f"{where} is not a function")) from exc
        missing = [param for param in params if param not in found]
        if missing:
            raise PatchError(_mismatch(f"{where} no longer takes {missing} (has {found})"))
    if calls is not None and calls not in getattr(getattr(original, "__code__", None), "co_names", ()):
        raise PatchError(_mismatch(f"{where} no longer calls {calls}"))
    return target


def required_verl_version() -> str:
    """``VERL_VERSION`` from the recipe's ``REQUIRED_VERL.txt``."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), REQUIRED_VERL_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            pairs = dict(line.strip().split("=", 1) for line in handle if "=" in line)
    except OSError:
        return "unknown"
    return pairs.get("VERL_VERSION", "unknown").strip()


def _mismatch(detail: str) -> str:
    return (
        f"nemo_gym_browser cannot install its trainer wiring into verl {verl_version()}: {detail}. The patches were "
        f"written for verl {required_verl_version()}; install that version or set {PATCHES_ENV}=0 to run without them."
    )


def _is_ours(target: Any) -> bool:
    return getattr(target, _ORIGINAL_ATTR, None) is not None


def _rebind(owner: Any, name: str, current: Any, make: Callable[[Any], Callable[..., Any]]) -> bool:
    if _is_ours(current):
        return False
    wrapper = _wrappers.get(current)
    if wrapper is None:
        wrapper = make(current)
        setattr(wrapper, _ORIGINAL_ATTR, current)
        _wrappers[current] = wrapper
    setattr(owner, name, wrapper)
    return True


# ---------------------------------------------------------------------------------------------------------------
# Import hook: run the matching patch right after a target module has executed.


class _PostImportLoader:
    """Delegates to the real loader; after the module body ran, applies this recipe's patch to it."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if patches_enabled():
            with _lock:
                _apply_logged(self._name, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder:
    """A ``sys.meta_path`` finder that only wraps the loader of the target modules; it never finds code itself."""

    nemo_gym_browser_post_import_hook = True

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _APPLY:
            return None
        for finder in sys.meta_path:
            if getattr(finder, _HOOK_ATTR, False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PostImportLoader):
                    spec.loader = _PostImportLoader(spec.loader, fullname)
                return spec
        return None

    def invalidate_caches(self) -> None:
        return None
