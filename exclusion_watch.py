"""A warning when the share of episodes kept out of the baseline rises while the environment looks healthy.

An infrastructure failure takes an episode out of its group's baseline, so a policy that finds a way to make its
bad episodes fail "infrastructurally" escapes their negative advantages. Its signature: ``env/invalid_rate`` (the
share of a step's episodes flagged invalid or dropped, i.e. kept out of the baseline) climbs step over step while
the environment's own health holds. Health is read from what fails *before* the policy acted: seeds, start pages,
sessions lost before its first tool call (``env/failed_before_action_rate``); the per-call health checks live in
the environment client, and preflight and the smoke episodes check the servers before the run. A degrading
environment raises that rate too, and then nothing is blamed on the policy.

The rule (:meth:`ExclusionWatch.observe`): warn when the invalid rate rose from the step before and either it has
now risen :data:`CONSECUTIVE_RISES_TO_WARN` steps in a row or this one step's rise is at least
:data:`SINGLE_RISE_TO_WARN`, while ``env/failed_before_action_rate`` is at most
:data:`HEALTHY_BEFORE_ACTION_FAILURE_RATE`. One watch per trainer process (:func:`observe_step`, called where
the ``env/*`` step metrics are made).
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


_watch = ExclusionWatch()


def observe_step(metrics: Mapping[str, float]) -> str | None:
    """:meth:`ExclusionWatch.observe` on the trainer process's one watch."""
    return _watch.observe(metrics)
