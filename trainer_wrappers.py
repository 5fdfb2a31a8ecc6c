"""What the verl functions :mod:`patches` wraps do differently: route flagged batches to ``grpo_env_aware`` and
add the ``env/*`` step metrics. Every other call reaches verl's own function with the very same arguments.

Routing rule
    Flags count when at least one sample carries ``env_invalid``; a sample without it (another agent loop) counts as
    valid for the advantage and is left out of the ``env/*`` metrics (which are not reported at all without flags).
    Estimator ``grpo`` with no flag anywhere: forwarded untouched (stock GRPO). Estimator ``grpo_env_aware``: always
    the env-aware computation, with V1's session handling. Any other estimator: forwarded untouched; if the batch
    carries flags, one warning per process says they are ignored. Cost for an unflagged V1 run: one extra
    TransferQueue read of ``extra_fields`` per step for the metrics, plus one per ``_compute_advantage`` call under
    ``grpo`` (the results stay bit-identical).

Where the flags come from
    - Legacy trainer: its agent-loop manager turns every ``extra_fields`` key into a ``non_tensor_batch`` column, so
      the ``compute_advantage`` wrapper finds ``env_invalid`` there and gives a flagged batch its ``advantages`` and
      ``returns`` from ``grpo_env_aware``.
    - V1 trainer: the ``PPOTrainer._compute_advantage`` wrapper fetches the one TransferQueue field ``extra_fields``
      (``AgentLoopWorkerTQ`` stores each sample's whole ``AgentLoopOutput.extra_fields`` dict there) and exposes its
      ``env_invalid`` values for the duration of verl's own method, which otherwise runs unchanged (KL in reward,
      rollout correction, write-back). The ``compute_advantage_for_multi_trajectories`` wrapper puts those flags into
      ``non_tensor_batch`` and runs verl's session handling under ``grpo`` (verl applies it to no other estimator
      name), so multi-output sessions keep working; each session is judged by its final output's flag, like its
      reward. The V1 wrapper also reports ``grpo_env_aware/invalid_fraction`` (over episodes, padding left out) and,
      when ``NEMO_GYM_BROWSER_ADVANTAGE_LOG`` names a file, appends one JSON line per call with every real sample's
      group, flag, score and advantage.

Step metrics (the ``env/*`` keys of :mod:`episode_metrics`)
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

    Both are logged with verl's own metrics by verl's ``Tracking`` logger, every step, under the same keys; both
    also feed :mod:`exclusion_watch` (its warning when the share kept out of the baseline keeps rising).

    Rollouts the drop switch removed never reach TransferQueue, so V1's metrics also take them from the run's
    ledger (:mod:`dropped_rollouts`): the drops of every prompt group that is no longer waiting in TransferQueue's
    ``train`` partition (the replay buffer removed it: sampled into this step's batch, or evicted), counted as the
    invalid samples they were, plus ``env/dropped_count``. Validation's groups are taken first by
    ``PPOTrainer._val_metrics_update`` (it gets every validation group's uid), which adds
    ``val-aux/env/dropped_count`` and ``val-aux/env/dropped_rate``; verl's own validation averages see the kept
    rollouts only. The legacy trainer cannot drop, so it has nothing to take.

Importing this module imports neither torch nor verl; the wrappers import what they need when called.
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

from .wiring import (
    ADVANTAGE_LOG_ENV,
    CORE_ALGOS,
    ESTIMATOR_NAME,
    EXTRA_FIELDS_KEY,
    FLAG_KEY,
    INVALID_FRACTION_METRIC,
    PADDING_TAG,
    RAY_TRAINER,
    PatchError,
)

logger = logging.getLogger(__name__)

_warned: set[str] = set()
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


def _warn_ignored_once(adv_estimator: Any) -> None:
    key = _estimator_name(adv_estimator)
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "nemo_gym_browser: batch carries %s but estimator %s is not grpo/%s; flags ignored",
            FLAG_KEY,
            _estimator_name(adv_estimator),
            ESTIMATOR_NAME,
        )


def make_compute_advantage_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
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
            raise PatchError(f"{len(flags)} env_invalid flags for a batch of {len(data)} samples")
        data.non_tensor_batch[FLAG_KEY] = flags
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
    flags = infos.get("env/invalid")
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
