"""Getting the per-sample flags to ``grpo_env_aware`` and to the step metrics inside verl 0.9.1's two PPO trainers.

What this module guarantees
    With the recipe's patching active, a batch whose samples carry ``env_invalid`` and whose configured estimator is
    ``grpo`` (or ``grpo_env_aware``) gets its advantages from ``group_stats.grpo_env_aware``, and every training step
    whose batch carries the flags gets the ``env/*`` metrics of :mod:`episode_metrics` in the metrics dict verl logs
    (whatever the estimator). Every other call is forwarded to verl's own function with the very same arguments, so
    a run whose batches carry no flag, or that uses any other estimator, produces bit-identical tensors (and, without
    flags, the very same metrics) to stock verl. ``install()`` is idempotent, logs one line when it changes
    something, and raises ``PatchError`` naming the installed verl version when a function it wraps is missing or no
    longer has the shape it was written against. Importing this module imports neither torch nor verl.

Why wrappers and not a registered estimator or a V1 trainer mode (what verl 0.9.1 offers, read off its source)
    - ``algorithm.adv_estimator=grpo_env_aware`` alone (``register_adv_est``) is not enough: verl hands a registered
      estimator ``token_level_rewards``, ``response_mask``, ``config``, ``index`` and ``reward_baselines`` only
      (``non_tensor_batch`` goes to ``gdpo`` alone), and the V1 trainer fetches a fixed field list from
      TransferQueue that has no per-sample flag. Worse, V1's ``compute_advantage_for_multi_trajectories`` applies its
      session handling (GRPO over each session's final output, broadcast to the session's other outputs) only when
      the estimator *is* ``grpo``; any other name loses multi-output sessions.
    - A registered V1 trainer mode (``register_trainer`` + ``trainer.v1.trainer_mode``) looks like the supported hook
      but the mode name is also behaviour: ``PPOTrainer`` compares ``trainer_mode`` with ``"sync"`` to choose the
      replay buffer, the refill policy and the off-policy bookkeeping, and reads ``trainer.v1.<mode>`` for its
      settings. A new name would silently switch a sync run to async semantics, and each of ``sync``,
      ``colocate_async`` and ``separate_async`` would need its own subclass. It would also leave the legacy trainer
      uncovered.
    So the recipe wraps the places the flags have to pass through, all of them module attributes verl looks up
    at call time:

    - ``ray_trainer.compute_advantage`` (legacy trainer; ``v1.utils`` binds the same function by name): a batch
      whose ``non_tensor_batch["env_invalid"]`` is set and whose estimator is ``grpo``/``grpo_env_aware`` gets its
      ``advantages`` and ``returns`` from ``grpo_env_aware`` (the legacy agent-loop manager turns every
      ``extra_fields`` key into a ``non_tensor_batch`` column, so the flags are already there).
    - ``PPOTrainer._compute_advantage`` (V1; ``sync``, ``colocate_async`` and ``separate_async`` all inherit it):
      additionally fetches the one TransferQueue field ``extra_fields`` (``AgentLoopWorkerTQ`` stores the whole
      ``AgentLoopOutput.extra_fields`` dict of each sample there) and exposes its ``env_invalid`` values for the
      duration of verl's own method, which otherwise runs unchanged (KL in reward, rollout correction, write-back).
    - ``v1.utils.compute_advantage_for_multi_trajectories`` (``trainer_base`` binds it by name): puts those flags
      into ``non_tensor_batch`` and runs verl's own session handling with ``grpo``, so multi-output sessions keep
      working; each session is judged by its final output's flag, like its reward.
    - ``core_algos``, when imported: registers ``grpo_env_aware`` for explicit use.

Step metrics (the ``env/*`` keys of ``episode_metrics``)
    verl 0.9.1 has no hook that turns a per-sample field into a *training* metric. ``reward_extra_info`` reaches the
    validation metrics only (``_validate``); in training the legacy trainer merely copies it into
    ``non_tensor_batch`` (for ``rollout_data_dir`` dumps) and V1 stores it in TransferQueue unread. ``AgentLoopOutput.
    metrics`` is a closed model of four timings that only the legacy manager averages (``timing_s/agent_loop/*``),
    and the one per-sample column verl does average (``algorithm.gdpo_reward_keys``) is read for ``gdpo`` alone. So
    the metrics are added where each trainer builds its step's data metrics, from the batch it builds them from:

    - ``ray_trainer.compute_data_metrics`` (legacy; ``RayPPOTrainer.fit`` calls this module attribute once per step
      with the step's final batch): its result gains :func:`episode_metrics.metrics_from_columns` of the batch's
      ``non_tensor_batch``, where verl's agent-loop manager put one column per ``extra_fields`` key.
    - ``PPOTrainer._compute_metrics`` (V1, all three modes inherit it; ``fit`` calls it once per step with the whole
      step's batch, after the ``parameter_sync_step`` iterations were aggregated): the ``metrics`` dict gains
      :func:`episode_metrics.episode_metrics` of the samples' TransferQueue ``extra_fields`` dicts, without the
      synthetic padding samples verl appends (tagged ``is_padding``; they copy a real sample's fields).

    Both are logged with verl's own metrics by verl's ``Tracking`` logger, every step, under the same keys.

    Rollouts the drop switch removed never reach TransferQueue, so V1's metrics also take them from the run's
    ledger (:mod:`dropped_rollouts`): the drops of every prompt group that is no longer waiting in TransferQueue's
    ``train`` partition (the replay buffer removed it: sampled into this step's batch, or evicted), counted as the
    invalid samples they were, plus ``env/dropped_count``. Validation's groups are taken first by
    ``PPOTrainer._val_metrics_update`` (it gets every validation group's uid), which adds
    ``val-aux/env/dropped_count`` and ``val-aux/env/dropped_rate``; verl's own validation averages see the kept
    rollouts only. The legacy trainer cannot drop (see below), so it has nothing to take.

    verl's experimental trainers (``fully_async_policy``, ``separation``, ``one_step_off_policy``) are not covered.

Routing rule
    Flags count when at least one sample carries the key; a sample without it (another agent loop) counts as valid
    for the advantage and is left out of the ``env/*`` metrics (which are not reported at all without flags).
    Estimator ``grpo`` with no flag anywhere: forwarded untouched (stock GRPO). Estimator ``grpo_env_aware``: always
    the env-aware computation, with V1's session handling. Any other estimator: forwarded untouched; if the batch
    carries flags, one warning per process says they are ignored. Cost for an unflagged V1 run: one extra
    TransferQueue read of ``extra_fields`` per step for the metrics, plus one per ``_compute_advantage`` call under
    ``grpo`` (the results stay bit-identical).

The drop switch (``NEMO_GYM_BROWSER_DROP_INVALID=1``) and the recipe's default wiring
    With the switch on, a rollout still invalid after its attempts returns ``[]``; the V1 trainer skips it, so its
    prompt group simply shrinks (the legacy trainer needs one output per input and cannot drop). Stock GRPO is right
    for the survivors of a group that keeps two or more samples (the dropped ones are no longer in the baseline),
    but a group left with **one** survivor gets mean 0 and std 1: its **raw reward becomes its advantage**
    (``r / (1 + 1e-6)``, or ``r`` without std normalisation), so a lone survivor that scored 1 is pushed up with
    nothing to compare it against. The recipe's wiring avoids this twice over: its agent loop writes ``env_invalid``
    (``False``) on every sample it keeps, so the batch is flagged and routed to ``grpo_env_aware``, which gives a
    group with fewer than two valid samples advantage 0; and its configs name the estimator explicitly
    (``algorithm.adv_estimator=grpo_env_aware``), which keeps that rule even for a batch without flags and makes a
    process without the wiring fail with verl's "Unknown advantage estimator" instead of running stock GRPO. The
    switch is off by default: invalid samples then stay in the batch, flagged, with advantage 0 and out of their
    group's mean and std, which works in both trainers (the agent loop also zeroes an invalid sample's
    ``response_mask``, so it leaves the loss as well), and a step in which every rollout failed still has a batch
    (verl's sync replay buffer raises when the groups it samples hold no trajectory at all).

Installation
    - ``install()``: eager; imports the four verl modules and patches them now.
    - ``install_on_import()``: lazy; adds an import hook that patches each of those modules when it is first
      imported (and patches the ones already imported). ``sitecustomize.py`` and the ``verl.plugins`` entry point use
      this, so every process (Ray workers included) gets the wiring without importing torch or verl early.
    - ``NEMO_GYM_BROWSER_PATCHES=0`` (also ``false``/``no``/``off``) turns all of it off; both functions then return
      ``False``. verl forwards only some environment variables to Ray workers: export it before ``ray start`` or
      pass it through the Ray runtime environment.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

SWITCH_ENV = "NEMO_GYM_BROWSER_PATCHES"
FLAG_KEY = "env_invalid"
EXTRA_FIELDS_KEY = "extra_fields"  # the single TransferQueue field holding AgentLoopOutput.extra_fields
ESTIMATOR_NAME = "grpo_env_aware"  # == group_stats.ESTIMATOR_NAME; not imported so that this module stays torch-free
REQUIRED_VERL_FILE = "REQUIRED_VERL.txt"  # KEY=VALUE, next to this module; VERL_VERSION is what the patches target
INVALID_FRACTION_METRIC = "grpo_env_aware/invalid_fraction"
# A JSONL path: when set, the V1 trainer appends one line per advantage computation with every sample's group, flag,
# score and advantage, so what the estimator did inside a real run can be checked (and read) sample by sample.
ADVANTAGE_LOG_ENV = "NEMO_GYM_BROWSER_ADVANTAGE_LOG"
PADDING_TAG = "is_padding"  # V1: tag of the synthetic samples verl appends to make the batch divisible

CORE_ALGOS = "verl.trainer.ppo.core_algos"
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
V1_UTILS = "verl.trainer.ppo.v1.utils"
V1_TRAINER_BASE = "verl.trainer.ppo.v1.trainer_base"
TARGETS = (CORE_ALGOS, RAY_TRAINER, V1_UTILS, V1_TRAINER_BASE)  # in verl's own import order

_ORIGINAL_ATTR = "__nemo_gym_browser_original__"
_HOOK_ATTR = "nemo_gym_browser_post_import_hook"
_OFF_VALUES = frozenset({"0", "false", "no", "off"})

_lock = threading.RLock()
_wrappers: dict[Any, Callable[..., Any]] = {}  # original -> its one wrapper, so every binding shares it
_logged: set[str] = set()
# Flags fetched by the V1 _compute_advantage wrapper, read by the multi-trajectory wrapper it calls.
_v1_flags: contextvars.ContextVar[Any] = contextvars.ContextVar("nemo_gym_browser_v1_flags", default=None)


class PatchError(RuntimeError):
    """verl does not have the functions this recipe wraps where and how it expects them."""


def patches_enabled() -> bool:
    """False when ``NEMO_GYM_BROWSER_PATCHES`` switches the recipe's patching off."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in _OFF_VALUES


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
    if getattr(module.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR_NAME), "_nemo_gym_browser_estimator", False):
        return False
    from . import group_stats

    group_stats.register()
    return True


def _patch_ray_trainer(module: ModuleType) -> bool:
    _require(module, "compute_response_mask")
    original = _require(module, "compute_advantage", params=("data", "adv_estimator", "norm_adv_by_std_in_grpo"))
    data_metrics = _require(module, "compute_data_metrics", params=("batch", "use_critic"))
    _require(_require(module, "RayPPOTrainer"), "fit", calls="compute_data_metrics")
    changed = _rebind(module, "compute_advantage", original, _make_compute_advantage_wrapper)
    return _rebind(module, "compute_data_metrics", data_metrics, _make_data_metrics_wrapper) or changed


def _patch_v1_utils(module: ModuleType) -> bool:
    compute_advantage = _require(module, "compute_advantage", params=("data", "adv_estimator"))
    multi = _require(
        module,
        "compute_advantage_for_multi_trajectories",
        params=("data", "batch_keys", "adv_estimator"),
        calls="compute_advantage",
    )
    changed = _rebind(module, "compute_advantage", compute_advantage, _make_compute_advantage_wrapper)
    return _rebind(module, "compute_advantage_for_multi_trajectories", multi, _make_multi_trajectories_wrapper) or (
        changed
    )


def _patch_v1_trainer_base(module: ModuleType) -> bool:
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
    changed = _rebind(module, "compute_advantage_for_multi_trajectories", multi, _make_multi_trajectories_wrapper)
    changed = _rebind(trainer_cls, "_compute_advantage", method, _make_v1_compute_advantage_wrapper) or changed
    changed = _rebind(trainer_cls, "_compute_metrics", step_metrics, _make_v1_compute_metrics_wrapper) or changed
    return _rebind(trainer_cls, "_val_metrics_update", val_metrics, _make_v1_val_metrics_wrapper) or changed


_APPLY: dict[str, Callable[[ModuleType], bool]] = {
    CORE_ALGOS: _patch_core_algos,
    RAY_TRAINER: _patch_ray_trainer,
    V1_UTILS: _patch_v1_utils,
    V1_TRAINER_BASE: _patch_v1_trainer_base,
}


def _is_patched(name: str, module: ModuleType) -> bool:
    if name == CORE_ALGOS:
        registry = getattr(module, "ADV_ESTIMATOR_REGISTRY", {})
        return getattr(registry.get(ESTIMATOR_NAME), "_nemo_gym_browser_estimator", False)
    if name == RAY_TRAINER:
        return _is_ours(getattr(module, "compute_advantage", None)) and _is_ours(
            getattr(module, "compute_data_metrics", None)
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
        logger.info("nemo_gym_browser: patched %s for grpo_env_aware and env/* metrics (verl %s)", name, verl_version())


def _enabled_or_log() -> bool:
    if patches_enabled():
        return True
    if "disabled" not in _logged:
        _logged.add("disabled")
        logger.info("nemo_gym_browser: patching disabled by %s=%s", SWITCH_ENV, os.environ.get(SWITCH_ENV))
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
        f"written for verl {required_verl_version()}; install that version or set {SWITCH_ENV}=0 to run without them."
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
# Wrappers


def _estimator_name(adv_estimator: Any) -> str:
    return str(getattr(adv_estimator, "value", adv_estimator))


def _is_grpo_family(adv_estimator: Any) -> bool:
    return _estimator_name(adv_estimator) in ("grpo", ESTIMATOR_NAME)


def flags_from_values(values: Any) -> Any:
    """Per-sample flag values -> numpy bool array, or None when no sample carries a flag (``None`` = not carried)."""
    import numpy as np

    array = np.asarray(values)
    if array.dtype == object:
        if array.size == 0 or not np.not_equal(array, None).any():
            return None
        return np.equal(array, True)
    return array.astype(bool).reshape(-1)


def _warn_ignored_once(adv_estimator: Any) -> None:
    key = f"ignored:{_estimator_name(adv_estimator)}"
    if key not in _logged:
        _logged.add(key)
        logger.warning(
            "nemo_gym_browser: batch carries %s but estimator %s is not grpo/grpo_env_aware; flags ignored",
            FLAG_KEY,
            _estimator_name(adv_estimator),
        )


def _make_compute_advantage_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_advantage(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        data, adv_estimator = bound.arguments["data"], bound.arguments["adv_estimator"]
        column = data.non_tensor_batch.get(FLAG_KEY) if data.non_tensor_batch else None
        flags = flags_from_values(column) if column is not None else None
        if flags is None or not _is_grpo_family(adv_estimator):
            if flags is not None:
                _warn_ignored_once(adv_estimator)
            return original(*args, **kwargs)
        bound.apply_defaults()
        return _env_aware_advantage(
            data, flags, bound.arguments["norm_adv_by_std_in_grpo"], bound.arguments.get("config")
        )

    return compute_advantage


def _env_aware_advantage(data: Any, flags: Any, norm_adv_by_std_in_grpo: bool, config: Any) -> Any:
    """The legacy GRPO branch of ``compute_advantage`` with ``grpo_env_aware`` in place of stock GRPO."""
    from . import group_stats

    if "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = sys.modules[RAY_TRAINER].compute_response_mask(data)
    advantages, returns = group_stats.compute_grpo_env_aware_advantage(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
        env_invalid=flags,
    )
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


def _make_multi_trajectories_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_advantage_for_multi_trajectories(*args: Any, **kwargs: Any) -> Any:
        import numpy as np

        bound = signature.bind(*args, **kwargs)
        adv_estimator, flags = bound.arguments["adv_estimator"], _v1_flags.get()
        if not _is_grpo_family(adv_estimator) or (flags is None and _estimator_name(adv_estimator) == "grpo"):
            return original(*args, **kwargs)
        data = bound.arguments["data"]
        if flags is None:
            flags = np.zeros(len(data), dtype=bool)
        if len(flags) != len(data):
            raise PatchError(f"{len(flags)} env_invalid flags for a batch of {len(data)} samples")
        data.non_tensor_batch[FLAG_KEY] = flags
        # verl's session handling runs only for "grpo"; the wrapped compute_advantage it calls sees the flags.
        bound.arguments["adv_estimator"] = sys.modules[CORE_ALGOS].AdvantageEstimator.GRPO
        return original(*bound.args, **bound.kwargs)

    return compute_advantage_for_multi_trajectories


def _make_v1_compute_advantage_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _compute_advantage(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        trainer, batch = bound.arguments["self"], bound.arguments["batch"]
        adv_estimator = trainer.config.algorithm.adv_estimator
        if not _is_grpo_family(adv_estimator):
            return original(*args, **kwargs)
        rows = _fetch_v1_extra_fields(batch)
        flags = _flags_of_rows(rows) if rows is not None else None
        if flags is None and _estimator_name(adv_estimator) == "grpo":
            return original(*args, **kwargs)
        token = _v1_flags.set(flags)
        try:
            result = original(*args, **kwargs)
        finally:
            _v1_flags.reset(token)
        metrics = bound.arguments["metrics"]
        if flags is not None and isinstance(metrics, dict):
            from .episode_metrics import is_episode_row

            real = [not tag.get(PADDING_TAG, False) for tag in batch.tags] if batch.tags else [True] * len(flags)
            # over episodes: a step-wise episode's earlier step samples repeat its final step's flag
            episodes = [row is None or is_episode_row(row) for row in rows]
            counted = [flag for flag, keep, ep in zip(flags.tolist(), real, episodes, strict=True) if keep and ep]
            metrics[INVALID_FRACTION_METRIC] = sum(counted) / len(counted) if counted else 0.0
        log_path = os.environ.get(ADVANTAGE_LOG_ENV)
        if log_path:
            _append_advantage_log(log_path, getattr(trainer, "global_steps", None), batch, flags)
        return result

    return _compute_advantage


def _append_advantage_log(path: str, step: Any, batch: Any, flags: Any) -> None:
    """One JSON line: every real sample of the batch with its group, flag, score and advantage (first response token).

    A sample with no response token left (an invalid sample's mask is zeroed by the loop) has advantage 0.
    """
    import json

    import transfer_queue as tq

    fields = ["uid", "rm_scores", "advantages", "response_mask"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    uids = data.get("uid").tolist()
    columns = [data.get(name).unbind() for name in ("rm_scores", "advantages", "response_mask")]
    tags = batch.tags or [{}] * len(batch.keys)
    samples = []
    for index, (key, uid, tag, (scores, advantages, mask)) in enumerate(
        zip(batch.keys, uids, tags, zip(*columns, strict=True), strict=True)
    ):
        if tag.get(PADDING_TAG, False):
            continue
        kept = mask.bool()
        samples.append(
            {
                "key": key,
                "uid": str(uid),
                "env_invalid": None if flags is None else bool(flags[index]),
                "score": float(scores.sum()),
                "advantage": float(advantages[kept][0]) if kept.any() else 0.0,
                "response_tokens": int(kept.sum()),
            }
        )
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps({"step": step, "samples": samples}) + "\n")


def _fetch_v1_extra_fields(batch: Any) -> list[dict[str, Any] | None] | None:
    """Every sample's ``extra_fields`` dict (None where it has none) from TransferQueue; None if the field is absent."""
    import transfer_queue as tq
    from tensordict.tensorclass import NonTensorData

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[EXTRA_FIELDS_KEY])
    if EXTRA_FIELDS_KEY not in data.keys():
        return None
    column = data.get(EXTRA_FIELDS_KEY)
    entries = [column.data] * len(batch.keys) if isinstance(column, NonTensorData) else column.tolist()
    rows = []
    for entry in entries:
        fields = getattr(entry, "data", entry)
        rows.append(fields if isinstance(fields, dict) else None)
    return rows


def _flags_of_rows(rows: list[dict[str, Any] | None]) -> Any:
    """``env_invalid`` of every sample of a V1 batch from its ``extra_fields`` dicts; None if no sample has it."""
    import numpy as np

    array = np.empty(len(rows), dtype=object)
    array[:] = [row.get(FLAG_KEY) if row is not None else None for row in rows]
    return flags_from_values(array)


def _make_data_metrics_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_data_metrics(*args: Any, **kwargs: Any) -> Any:
        from .episode_metrics import metrics_from_columns

        metrics = original(*args, **kwargs)
        batch = signature.bind(*args, **kwargs).arguments["batch"]
        env_metrics = metrics_from_columns(batch.non_tensor_batch or {})
        if env_metrics:  # without flags: verl's own dict, untouched
            metrics.update(env_metrics)
        return metrics

    return compute_data_metrics


def _make_v1_compute_metrics_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _compute_metrics(*args: Any, **kwargs: Any) -> Any:
        from . import dropped_rollouts
        from .episode_metrics import episode_metrics

        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        batch, metrics = bound.arguments["batch"], bound.arguments["metrics"]
        if not isinstance(metrics, dict):
            return result
        rows = _fetch_v1_extra_fields(batch) or []
        tags = batch.tags if batch.tags else [{}] * len(rows)
        real = [row for row, tag in zip(rows, tags, strict=True) if not tag.get(PADDING_TAG, False)]
        waiting = _waiting_train_groups()
        dropped = dropped_rollouts.take(waiting=waiting) if waiting is not None else []
        metrics.update(episode_metrics(real, dropped))  # {} when no real sample carries flags and none was dropped
        return result

    return _compute_metrics


def _waiting_train_groups() -> set[str] | None:
    """The prompt groups still waiting in TransferQueue's ``train`` partition (None when it cannot be listed).

    verl's replay buffer removes a group's prompt key when it samples the group into a batch or evicts it, so a
    dropped rollout whose group is not listed here belongs to this step (or to an evicted group).
    """
    import transfer_queue as tq

    try:
        listing = tq.kv_list(partition_id="train") or {}
    except Exception as exc:  # the drops stay in the ledger for the next step
        logger.warning("nemo_gym_browser: cannot list TransferQueue's train partition: %s", exc)
        return None
    return {key for key, tag in listing.get("train", {}).items() if isinstance(tag, dict) and tag.get("is_prompt")}


def _make_v1_val_metrics_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _val_metrics_update(*args: Any, **kwargs: Any) -> Any:
        from . import dropped_rollouts
        from .episode_metrics import validation_drop_metrics

        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        groups = {str(uid) for _source, uid in (bound.arguments.get("expected_acc_counts") or {})}
        dropped = dropped_rollouts.take(only=groups) if groups else []
        ours = dropped or "env/invalid" in (bound.arguments.get("reward_extra_infos_dict") or {})
        if ours and isinstance(result, dict):  # another recipe's validation keeps verl's dict untouched
            result.update(validation_drop_metrics(dropped, kept=len(bound.arguments["sample_uids"])))
        return result

    return _val_metrics_update


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
