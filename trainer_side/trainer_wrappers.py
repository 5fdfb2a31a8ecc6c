"""What the verl functions :mod:`patches` wraps do differently: route flagged batches to ``grpo_env_aware`` and add
the ``env/*`` step metrics. Every other call reaches verl's own function with the very same arguments.

Routing: flags count when at least one sample carries ``env_invalid`` (a sample without it counts as valid and is
left out of the metrics). ``grpo`` with no flag anywhere is forwarded untouched; ``grpo_env_aware`` is always the
env-aware computation, with V1's session handling; any other estimator is forwarded untouched, with one warning per
process when the batch carries flags. The flags come from ``non_tensor_batch`` (legacy trainer) or from the
TransferQueue field ``extra_fields`` (V1), exposed only for the duration of verl's own method.

The metrics are added where each trainer builds its step's data metrics (verl 0.9.1 has no hook that turns a
per-sample field into a training metric); V1 also counts the drop switch's rollouts from
:mod:`dropped_rollouts`. Importing this module imports neither torch nor verl. In full:
``docs/estimator-and-wiring.md``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..agent_attempt.sample_flags import INVALID_INFO_KEY, INVALID_KEY, SampleFlags
from .wiring import (
    ADVANTAGE_LOG_ENV,
    CORE_ALGOS,
    ESTIMATOR_NAME,
    EXTRA_FIELDS_KEY,
    INVALID_FRACTION_METRIC,
    PADDING_TAG,
    RAY_TRAINER,
    PatchError,
)

logger = logging.getLogger(__name__)

# Flags fetched by the V1 _compute_advantage wrapper, read by the multi-trajectory wrapper it calls.
_v1_flags: contextvars.ContextVar[Any] = contextvars.ContextVar("nemo_gym_browser_v1_flags", default=None)


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


def make_compute_advantage_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    # Estimators already warned about; the wrapper is installed once per process, so the warning is said once.
    warned: set[str] = set()

    def warn_ignored_once(adv_estimator: Any) -> None:
        name = _estimator_name(adv_estimator)
        if name not in warned:
            warned.add(name)
            logger.warning(
                "nemo_gym_browser: batch carries %s but estimator %s is not grpo/%s; flags ignored",
                INVALID_KEY,
                name,
                ESTIMATOR_NAME,
            )

    @functools.wraps(original)
    def compute_advantage(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        data, adv_estimator = bound.arguments["data"], bound.arguments["adv_estimator"]
        column = data.non_tensor_batch.get(INVALID_KEY) if data.non_tensor_batch else None
        flags = flags_from_values(column) if column is not None else None
        if flags is None or not _is_grpo_family(adv_estimator):
            if flags is not None:
                warn_ignored_once(adv_estimator)
            return original(*args, **kwargs)
        bound.apply_defaults()
        return _env_aware_advantage(
            data, flags, bound.arguments["norm_adv_by_std_in_grpo"], bound.arguments.get("config")
        )

    return compute_advantage


def _env_aware_advantage(data: Any, flags: Any, norm_adv_by_std_in_grpo: bool, config: Any) -> Any:
    """The legacy GRPO branch of ``compute_advantage`` with ``grpo_env_aware`` in place of stock GRPO."""
    from .. import group_stats

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


def make_multi_trajectories_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
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
            raise PatchError(f"{len(flags)} {INVALID_KEY} flags for a batch of {len(data)} samples")
        data.non_tensor_batch[INVALID_KEY] = flags
        # verl's session handling runs only for "grpo"; the wrapped compute_advantage it calls sees the flags.
        bound.arguments["adv_estimator"] = sys.modules[CORE_ALGOS].AdvantageEstimator.GRPO
        return original(*bound.args, **bound.kwargs)

    return compute_advantage_for_multi_trajectories


def make_v1_compute_advantage_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
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
            real = [not tag.get(PADDING_TAG, False) for tag in batch.tags] if batch.tags else [True] * len(flags)
            # over episodes: a step-wise episode's earlier step samples repeat its final step's flag
            episodes = [_stands_for_episode(row) for row in rows]
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
                INVALID_KEY: None if flags is None else bool(flags[index]),
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


def _stands_for_episode(row: dict[str, Any] | None) -> bool:
    flags = SampleFlags.from_extra_fields(row)
    return flags is None or flags.stands_for_episode


def _flags_of_rows(rows: list[dict[str, Any] | None]) -> Any:
    """``env_invalid`` of every sample of a V1 batch from its ``extra_fields`` dicts; None if no sample has it."""
    import numpy as np

    array = np.empty(len(rows), dtype=object)
    array[:] = [row.get(INVALID_KEY) if row is not None else None for row in rows]
    return flags_from_values(array)


def make_data_metrics_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_data_metrics(*args: Any, **kwargs: Any) -> Any:
        from .episode_metrics import metrics_from_columns
        from .exclusion_watch import observe_step

        metrics = original(*args, **kwargs)
        batch = signature.bind(*args, **kwargs).arguments["batch"]
        env_metrics = metrics_from_columns(batch.non_tensor_batch or {})
        if env_metrics:  # without flags: verl's own dict, untouched
            metrics.update(env_metrics)
            observe_step(env_metrics)
        return metrics

    return compute_data_metrics


def make_v1_compute_metrics_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _compute_metrics(*args: Any, **kwargs: Any) -> Any:
        from . import dropped_rollouts
        from .episode_metrics import episode_metrics
        from .exclusion_watch import observe_step

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
        env_metrics = episode_metrics(real, dropped)  # {} when no real sample carries flags and none was dropped
        metrics.update(env_metrics)
        if env_metrics:
            observe_step(env_metrics)
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


def make_val_metrics_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _val_metrics_update(*args: Any, **kwargs: Any) -> Any:
        from . import dropped_rollouts
        from .episode_metrics import validation_exclusion_metrics

        bound = signature.bind(*args, **kwargs)
        invalid = _leave_out_invalid_samples(bound.arguments)
        result = original(*bound.args, **bound.kwargs)
        groups = {str(uid) for _source, uid in (bound.arguments.get("expected_acc_counts") or {})}
        dropped = dropped_rollouts.take(only=groups) if groups else []
        ours = dropped or invalid is not None
        if ours and isinstance(result, dict):  # another recipe's validation keeps verl's dict untouched
            kept = len(bound.arguments["sample_uids"])
            result.update(validation_exclusion_metrics(dropped, invalid=invalid or 0, kept=kept))
        return result

    return _val_metrics_update


def _leave_out_invalid_samples(arguments: dict[str, Any]) -> int | None:
    """Take the samples flagged ``env_invalid`` out of ``_val_metrics_update``'s per-sample lists (in place).

    A validation rollout the environment never served is no measurement of the policy: scored 0 it would pull the
    held-back success down by the failure rate. Returns how many were left out, or None when no sample carries the
    flag (another recipe's validation, passed through untouched).
    """
    infos = arguments.get("reward_extra_infos_dict") or {}
    flags = infos.get(INVALID_INFO_KEY)
    size = len(arguments.get("sample_uids") or ())
    if flags is None or len(flags) != size:
        return None
    keep = [index for index, flag in enumerate(flags) if not flag]
    if len(keep) == size:
        return 0

    def kept(values: Any) -> Any:
        return [values[index] for index in keep] if values is not None and len(values) == size else values

    arguments["reward_extra_infos_dict"] = {key: kept(values) for key, values in infos.items()}
    for name in ("data_sources", "sample_uids", "sample_turns"):
        if name in arguments:
            arguments[name] = kept(arguments[name])
    return size - len(keep)
