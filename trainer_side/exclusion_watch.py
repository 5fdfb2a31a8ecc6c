"""Warnings from a step's ``env/*`` metrics: exclusions rising while the environment looks healthy, and start pages
out of reach.

An infrastructure failure takes an episode out of its group's baseline, so a policy that finds a way to make its
bad episodes fail "infrastructurally" escapes their negative advantages. Its signature: ``env/invalid_rate`` climbs
step over step while the environment's own health holds, read from what fails *before* the policy acted
(``env/failed_before_action_rate``: seeds, start pages, sessions lost before its first tool call). The rule
(:meth:`ExclusionWatch.observe`): the invalid rate rose from the step before and either it has now risen
:data:`CONSECUTIVE_RISES_TO_WARN` steps in a row or this one rise is at least :data:`SINGLE_RISE_TO_WARN`, while
``env/failed_before_action_rate`` is at most :data:`HEALTHY_BEFORE_ACTION_FAILURE_RATE`.

The opposite case (:func:`seed_failure_warning`): at least :data:`SEED_FAILED_SHARE_TO_WARN` of a step's episodes
never opened their start page (``env/seed_failed_rate``), so the step trains on the few that did; from the first
step on, each such step warns, naming the likely cause: the nodes do not reach the task sites. Both run once per
step in the trainer process (:func:`observe_step`, called where the ``env/*`` step metrics are made).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .episode_metrics import FAILURE_KINDS

logger = logging.getLogger(__name__)

# Three rises in a row is a trend: one or two are within a step's sampling noise at a few hundred episodes.
CONSECUTIVE_RISES_TO_WARN = 3
# A jump of ten points of the invalid rate in one step is worth a look on its own.
SINGLE_RISE_TO_WARN = 0.10
# At most this share of attempts failing before the policy acted: the environment counts as healthy.
HEALTHY_BEFORE_ACTION_FAILURE_RATE = 0.05
# Half of a step's episodes without a start page after every attempt is no bad luck of single sites or sessions.
SEED_FAILED_SHARE_TO_WARN = 0.5


class ExclusionWatch:
    """The invalid rate of the previous steps, and how many steps in a row it has risen."""

    def __init__(self) -> None:
        self.history: list[float] = []
        self.rises = 0

    def observe(self, metrics: Mapping[str, float]) -> str | None:
        """Take one training step's ``env/*`` metrics; log and return the warning when the rule holds, else None (a
        step without ``env/invalid_rate`` is not counted)."""
        rate = metrics.get("env/invalid_rate")
        if rate is None:
            return None
        previous = self.history[-1] if self.history else None
        rise = rate - previous if previous is not None else 0.0
        self.rises = self.rises + 1 if rise > 0 else 0
        self.history.append(rate)
        before_action = metrics.get("env/failed_before_action_rate", 0.0)
        healthy = before_action <= HEALTHY_BEFORE_ACTION_FAILURE_RATE
        if not (rise > 0 and healthy and (self.rises >= CONSECUTIVE_RISES_TO_WARN or rise >= SINGLE_RISE_TO_WARN)):
            return None
        warning = (
            f"env/invalid_rate rose {self.rises} step(s) in a row "
            f"({' -> '.join(f'{value:.3f}' for value in self.history[-(self.rises + 1) :])}) while the environment "
            f"looks healthy ({before_action:.3f} of attempts failed before the policy acted): the policy may have "
            "found a way to fail as infrastructure and escape its group's baseline; failed after the policy acted: "
            f"{_after_action_kinds(metrics)}"
        )
        logger.warning("%s", warning)
        return warning


def _after_action_kinds(metrics: Mapping[str, float]) -> str:
    counts = {kind: int(metrics.get(f"env/failed_after_action/{kind}", 0)) for kind in FAILURE_KINDS}
    shown = [f"{kind} {count}" for kind, count in sorted(counts.items(), key=lambda item: -item[1]) if count]
    return ", ".join(shown) or "none"


def seed_failure_warning(metrics: Mapping[str, float]) -> str | None:
    """Log and return the warning when at least :data:`SEED_FAILED_SHARE_TO_WARN` of the step's episodes ended
    ``seed_failed``; None otherwise (and for a step without ``env/seed_failed_rate``)."""
    rate = metrics.get("env/seed_failed_rate")
    if rate is None or rate < SEED_FAILED_SHARE_TO_WARN:
        return None
    failed, episodes = int(metrics.get("env/invalid/seed_failed", 0)), int(metrics.get("env/samples", 0))
    warning = (
        f"{failed} of {episodes} episodes of this step could not open their start page on any "
        f"attempt (env/seed_failed_rate {rate:.3f}) and are kept out of the loss: the nodes may not reach the task "
        "sites (no route to them, or a proxy not set for the environment servers' Chromium); run the dry run's "
        "start-page check (sbatch submit_webvoyager.sh --dry-run, START_PAGE_SAMPLE) and read the agent-loop "
        "workers' 'could not open a session' warnings for the server's own message"
    )
    logger.warning("%s", warning)
    return warning


_watch = ExclusionWatch()


def observe_step(metrics: Mapping[str, float]) -> list[str]:
    """The warnings of one training step's ``env/*`` metrics, each logged: :meth:`ExclusionWatch.observe` on the
    trainer process's one watch, and :func:`seed_failure_warning`."""
    return [warning for warning in (_watch.observe(metrics), seed_failure_warning(metrics)) if warning]
