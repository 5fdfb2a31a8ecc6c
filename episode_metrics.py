"""Per-step ``env/*`` training metrics from the per-sample flags the browser agent loop writes.

What this module owns
    The reduction of a batch's per-sample ``extra_fields`` flags (see ``browser_agent_loop``) to scalar
    metrics: the invalid rate, every failure kind (of failed attempts, and of samples still invalid at the end),
    attempts, resampled and recovered rates, failed attempts before and after the policy acted (by kind: a policy
    that learns to fail "infrastructurally" shows there, see :mod:`exclusion_watch`), deadline hits, the
    verify/judge split of rewards, refused navigations and the episode wall time, and the share of episodes that
    never opened their start page (``env/seed_failed_rate``: most of a step there means the nodes do not reach the
    task sites, see :mod:`exclusion_watch`). Pure Python over mappings and numpy columns: no torch, no verl.
    Rollouts the drop switch removed (``dropped_rollouts``) count as what they were, invalid samples: every rate
    is over all the step's rollouts, kept and dropped, so the numbers do not depend on the switch; how many were
    dropped is ``env/dropped_count``.

Where the numbers reach verl
    * Every sample's ``extra_fields`` become one ``non_tensor_batch`` column per key in the legacy trainer and
      one ``extra_fields`` record per sample in the V1 trainer's TransferQueue; :func:`metrics_from_columns`
      and :func:`episode_metrics` read either shape.
    * The loop also copies the numeric flags into ``extra_fields["reward_extra_info"]`` under ``env/...`` keys,
      which verl 0.9.1 itself aggregates into the per-step *validation* metrics (``val-aux/<data source>/env/
      invalid/mean@N``, ...) in both trainers.
    * verl 0.9.1 has no hook that turns a custom per-sample field into a *training* metric; the recipe's trainer
      wiring (``patches.py``) adds these metrics where each trainer builds its step's data metrics:
      :func:`metrics_from_columns` of the batch in the legacy ``compute_data_metrics``, :func:`episode_metrics` of
      the non-padding samples' TransferQueue ``extra_fields`` in V1's ``PPOTrainer._compute_metrics``. They are then
      logged every step with verl's own metrics (same keys in both trainers, unprefixed: ``env/invalid_rate``...).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .failures import FAILURE_KINDS, FailureKind

# The keys the loop writes into every sample's extra_fields (the first six are the project-wide contract).
FLAG_KEYS = (
    "env_invalid",
    "env_failure_kind",
    "env_failure_reason",
    "env_attempts",
    "deadline_hit",
    "reward_source",
    "env_failed_attempt_kinds",
    "env_failed_after_action_kinds",
    "env_episode_wall_s",
    "env_refused_navigations",
    "env_browser_actions",
)


def reward_extra_info(flags: Mapping[str, Any]) -> dict[str, float]:
    """The numeric copy of one sample's flags that verl's validation metrics average."""
    return {
        "env/invalid": float(bool(flags["env_invalid"])),
        "env/attempts": float(flags["env_attempts"]),
        "env/deadline_hit": float(bool(flags["deadline_hit"])),
        "env/reward_from_verify": float(flags["reward_source"] == "verify"),
        "env/reward_from_judge": float(flags["reward_source"] == "judge"),
        "env/episode_wall_s": float(flags["env_episode_wall_s"]),
        "env/browsed": float(int(flags.get("env_browser_actions") or 0) > 0),
        "env/browser_actions": float(flags.get("env_browser_actions") or 0),
    }


def episode_metrics(
    rows: Iterable[Mapping[str, Any] | None], dropped: Sequence[Mapping[str, Any]] = ()
) -> dict[str, float]:
    """Step metrics over the samples' flag dicts and the step's dropped rollouts (their flags, all invalid).

    Samples without flags (other agent loops) are skipped. Returns ``{}`` when no sample carries flags and nothing
    was dropped, so a batch of another recipe adds nothing. In step-wise mode every step sample carries its
    episode's flags: only each episode's final step is counted (:func:`is_episode_row`), so every rate is over
    episodes, and ``env/step_samples`` and ``env/steps/*`` say how many step samples there were.
    """
    samples = [row for row in rows if isinstance(row, Mapping) and "env_invalid" in row]
    flagged = [row for row in samples if is_episode_row(row)] + list(dropped)
    if not flagged:
        return {}
    n = len(flagged)
    invalid = [bool(row["env_invalid"]) for row in flagged]
    attempts = [int(row.get("env_attempts") or 1) for row in flagged]
    resampled = [a > 1 for a in attempts]
    wall = [float(row.get("env_episode_wall_s") or 0.0) for row in flagged]
    failed_attempts: Counter[str] = Counter()
    after_action: Counter[str] = Counter()
    final_kinds: Counter[str] = Counter()
    for row, is_invalid in zip(flagged, invalid, strict=True):
        failed_attempts.update(str(kind) for kind in (row.get("env_failed_attempt_kinds") or ()))
        after_action.update(str(kind) for kind in (row.get("env_failed_after_action_kinds") or ()))
        if is_invalid and row.get("env_failure_kind"):
            final_kinds[str(row["env_failure_kind"])] += 1
    metrics = {
        "env/samples": float(n),
        "env/dropped_count": float(len(dropped)),
        "env/invalid_rate": sum(invalid) / n,
        "env/invalid_count": float(sum(invalid)),
        # Episodes still invalid because no attempt could open the start page: the sites' reach, not the policy's.
        "env/seed_failed_rate": final_kinds.get(FailureKind.SEED_FAILED.value, 0) / n,
        "env/resampled_rate": sum(resampled) / n,
        "env/recovered_rate": sum(r and not i for r, i in zip(resampled, invalid, strict=True)) / n,
        "env/attempts/mean": sum(attempts) / n,
        # Failed attempts over all attempts, split by whether a tool call of the policy's had reached the episode:
        # before it, the environment failed on its own (the health signal); after it, the policy may be the cause.
        "env/failed_before_action_rate": (failed_attempts - after_action).total() / sum(attempts),
        "env/failed_after_action_rate": after_action.total() / sum(attempts),
        "env/attempts/max": float(max(attempts)),
        "env/deadline_hit_rate": sum(bool(row.get("deadline_hit")) for row in flagged) / n,
        "env/reward_source/verify": sum(row.get("reward_source") == "verify" for row in flagged) / n,
        "env/reward_source/judge": sum(row.get("reward_source") == "judge" for row in flagged) / n,
        "env/refused_navigations/mean": sum(int(row.get("env_refused_navigations") or 0) for row in flagged) / n,
        # Over the episodes' final attempts: how often the policy used the browser before it answered.
        "env/browsed_rate": sum(int(row.get("env_browser_actions") or 0) > 0 for row in flagged) / n,
        "env/browser_actions/mean": sum(int(row.get("env_browser_actions") or 0) for row in flagged) / n,
        "env/episode_wall_s/mean": sum(wall) / n,
        "env/episode_wall_s/max": max(wall),
    }
    for kind in FAILURE_KINDS:
        metrics[f"env/failed_attempts/{kind}"] = float(failed_attempts.get(kind, 0))
        metrics[f"env/invalid/{kind}"] = float(final_kinds.get(kind, 0))
        metrics[f"env/failed_after_action/{kind}"] = float(after_action.get(kind, 0))
    lengths = [int(row["env_steps"]) for row in flagged if row.get("env_steps") is not None]
    if lengths:  # step-wise samples present
        metrics["env/step_samples"] = float(sum(1 for row in samples if row.get("env_steps") is not None))
        metrics["env/steps/mean"] = sum(lengths) / len(lengths)
        metrics["env/steps/max"] = float(max(lengths))
    return metrics


def is_episode_row(row: Mapping[str, Any]) -> bool:
    """Whether a sample stands for its episode: the only sample of a one-sample episode, or the final step sample
    of a step-wise one (``env_step == env_steps``; the earlier steps repeat its flags)."""
    step, steps = row.get("env_step"), row.get("env_steps")
    return step is None or steps is None or int(step) == int(steps)


def validation_exclusion_metrics(dropped: Sequence[Mapping[str, Any]], invalid: int, kept: int) -> dict[str, float]:
    """What validation's averages leave out, as counts and shares of all its rollouts: the rollouts dropped, and the
    ones kept but flagged invalid (``kept`` counts the rollouts the averages saw)."""
    total = kept + invalid + len(dropped)
    return {
        "val-aux/env/dropped_count": float(len(dropped)),
        "val-aux/env/dropped_rate": len(dropped) / total if total else 0.0,
        "val-aux/env/invalid_count": float(invalid),
        "val-aux/env/left_out_rate": (invalid + len(dropped)) / total if total else 0.0,
    }


def metrics_from_columns(columns: Mapping[str, Sequence[Any]]) -> dict[str, float]:
    """:func:`episode_metrics` over column-shaped flags (a legacy ``DataProto.non_tensor_batch``)."""
    if "env_invalid" not in columns:
        return {}
    keys = [key for key in FLAG_KEYS if key in columns]
    size = len(columns["env_invalid"])
    rows = []
    for index in range(size):
        if columns["env_invalid"][index] is None:
            rows.append(None)
            continue
        rows.append({key: columns[key][index] for key in keys})
    return episode_metrics(rows)
