"""Per-step ``env/*`` training metrics from the per-sample flags the browser agent loop writes.

Contract: :func:`episode_metrics` (V1's TransferQueue ``extra_fields`` records) and :func:`metrics_from_columns`
(the legacy trainer's ``non_tensor_batch`` columns) reduce a batch's flags to scalars: the invalid rate, the failure
kinds of failed attempts and of samples still invalid, attempts, resampled and recovered rates, failures before and
after the policy acted, deadline hits, the verify/judge split, refused navigations, browsing, episode wall time and
``env/seed_failed_rate``. Rollouts the drop switch removed (:mod:`dropped_rollouts`) count as the invalid samples
they were, so every rate is over all the step's rollouts and does not depend on the switch
(``env/dropped_count``). Pure Python over mappings and numpy columns: no torch, no verl.

The recipe's trainer wiring adds these to each step's data metrics; verl 0.9.1 itself aggregates the numeric
copies under ``reward_extra_info`` into validation metrics. Every key: ``docs/estimator-and-wiring.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..agent_attempt.sample_flags import FLAG_KEYS, INVALID_KEY, SampleFlags
from ..gym_contract.failures import FAILURE_KINDS, FailureKind


def episode_metrics(rows: Iterable[Mapping[str, Any] | None], dropped: Sequence[SampleFlags] = ()) -> dict[str, float]:
    """Step metrics over the samples' extra fields and the step's dropped rollouts (their flags, all invalid).

    Samples without flags (other agent loops) are skipped. Returns ``{}`` when no sample carries flags and nothing
    was dropped, so a batch of another recipe adds nothing. In step-wise mode every step sample carries its
    episode's flags: only each episode's final step is counted (:attr:`SampleFlags.stands_for_episode`), so every
    rate is over episodes, and ``env/step_samples`` and ``env/steps/*`` say how many step samples there were.
    """
    samples = [flags for flags in map(SampleFlags.from_extra_fields, rows) if flags is not None]
    flagged = [flags for flags in samples if flags.stands_for_episode] + list(dropped)
    if not flagged:
        return {}
    n = len(flagged)
    invalid = [flags.invalid for flags in flagged]
    attempts = [flags.attempts for flags in flagged]
    resampled = [a > 1 for a in attempts]
    wall = [flags.episode_wall_s for flags in flagged]
    failed_attempts: Counter[str] = Counter()
    after_action: Counter[str] = Counter()
    resumed: Counter[str] = Counter()
    final_kinds: Counter[str] = Counter()
    for flags in flagged:
        failed_attempts.update(flags.failed_attempt_kinds)
        after_action.update(flags.failed_after_action_kinds)
        resumed.update(flags.resumed_kinds)
        if flags.invalid and flags.failure_kind:
            final_kinds[flags.failure_kind] += 1
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
        # Failures under a browser call or verify repaired in a new session, the policy's sample kept (resumes);
        # those given up on because the replayed page differed; episodes re-run after the policy acted all the same.
        "env/resumed_rate": sum(bool(flags.resumed_kinds) for flags in flagged) / n,
        "env/resumes/mean": resumed.total() / n,
        "env/resume_diverged_rate": sum(flags.resume_diverged > 0 for flags in flagged) / n,
        "env/rerun_after_action_rate": sum(bool(flags.failed_after_action_kinds) for flags in flagged) / n,
        "env/deadline_hit_rate": sum(flags.deadline_hit for flags in flagged) / n,
        "env/reward_source/verify": sum(flags.reward_source == "verify" for flags in flagged) / n,
        "env/reward_source/judge": sum(flags.reward_source == "judge" for flags in flagged) / n,
        "env/refused_navigations/mean": sum(flags.refused_navigations for flags in flagged) / n,
        # Over the episodes' final attempts: how often the policy used the browser before it answered.
        "env/browsed_rate": sum(flags.browser_actions > 0 for flags in flagged) / n,
        "env/browser_actions/mean": sum(flags.browser_actions for flags in flagged) / n,
        "env/episode_wall_s/mean": sum(wall) / n,
        "env/episode_wall_s/max": max(wall),
    }
    for kind in FAILURE_KINDS:
        metrics[f"env/failed_attempts/{kind}"] = float(failed_attempts.get(kind, 0))
        metrics[f"env/invalid/{kind}"] = float(final_kinds.get(kind, 0))
        metrics[f"env/failed_after_action/{kind}"] = float(after_action.get(kind, 0))
        metrics[f"env/resumed/{kind}"] = float(resumed.get(kind, 0))
    lengths = [flags.steps for flags in flagged if flags.steps is not None]
    if lengths:  # step-wise samples present
        metrics["env/step_samples"] = float(sum(1 for flags in samples if flags.steps is not None))
        metrics["env/steps/mean"] = sum(lengths) / len(lengths)
        metrics["env/steps/max"] = float(max(lengths))
    return metrics


def validation_exclusion_metrics(dropped: Sequence[SampleFlags], invalid: int, kept: int) -> dict[str, float]:
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
    if INVALID_KEY not in columns:
        return {}
    keys = [key for key in FLAG_KEYS if key in columns]
    size = len(columns[INVALID_KEY])
    rows = []
    for index in range(size):
        if columns[INVALID_KEY][index] is None:
            rows.append(None)
            continue
        rows.append({key: columns[key][index] for key in keys})
    return episode_metrics(rows)
