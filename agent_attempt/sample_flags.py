"""The per-sample flags: what the environment did under one sample, made once per sample by the agent loop.

What this module owns
    :class:`SampleFlags` (frozen) and its two crossings of verl: :meth:`SampleFlags.extra_fields` (the
    ``AgentLoopOutput.extra_fields`` entries, with the numeric copy verl's validation averages under
    ``reward_extra_info``) and :meth:`SampleFlags.from_extra_fields` (one sample's fields back, from a V1
    TransferQueue record or a legacy ``non_tensor_batch`` row). The key strings verl, the trainer wiring and the
    metrics see are spelled here and nowhere else; they are a contract with users' dashboards and never change.
    The loop writes the flags, the dropped-rollouts ledger stores them, the metrics read them. Standard library
    only: the trainer wiring imports it at interpreter start-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# verl's extra_fields keys (the first six are the project-wide contract, see docs/failures.md).
INVALID_KEY = "env_invalid"  # also the column the estimator and the trainer wiring read
FAILURE_KIND_KEY = "env_failure_kind"
FAILURE_REASON_KEY = "env_failure_reason"
ATTEMPTS_KEY = "env_attempts"
DEADLINE_HIT_KEY = "deadline_hit"
REWARD_SOURCE_KEY = "reward_source"
FAILED_ATTEMPT_KINDS_KEY = "env_failed_attempt_kinds"
FAILED_AFTER_ACTION_KINDS_KEY = "env_failed_after_action_kinds"
EPISODE_WALL_KEY = "env_episode_wall_s"
REFUSED_NAVIGATIONS_KEY = "env_refused_navigations"
BROWSER_ACTIONS_KEY = "env_browser_actions"
RESUMED_KINDS_KEY = "env_resumed_kinds"
RESUME_DIVERGED_KEY = "env_resume_diverged"
STEP_KEY = "env_step"  # step-wise mode only: this step sample's number, from 1
STEPS_KEY = "env_steps"  # step-wise mode only: the episode's step samples
# The keys every sample of the loop carries (step-wise samples add STEP_KEY and STEPS_KEY).
FLAG_KEYS = (
    INVALID_KEY,
    FAILURE_KIND_KEY,
    FAILURE_REASON_KEY,
    ATTEMPTS_KEY,
    DEADLINE_HIT_KEY,
    REWARD_SOURCE_KEY,
    FAILED_ATTEMPT_KINDS_KEY,
    FAILED_AFTER_ACTION_KINDS_KEY,
    EPISODE_WALL_KEY,
    REFUSED_NAVIGATIONS_KEY,
    BROWSER_ACTIONS_KEY,
    RESUMED_KINDS_KEY,
    RESUME_DIVERGED_KEY,
)
# verl's own extra_fields key whose per-sample numbers it averages into the validation metrics.
REWARD_EXTRA_INFO_KEY = "reward_extra_info"
INVALID_INFO_KEY = "env/invalid"  # the numeric copy of INVALID_KEY, read by the validation wiring
REWARD_SOURCES = ("verify", "judge")


@dataclass(frozen=True)
class SampleFlags:
    """One sample's flags. An invalid sample measures the infrastructure, not the policy."""

    invalid: bool
    attempts: int = 1  # attempts used, 1 when the first one counted
    failure_kind: str | None = None  # a FailureKind value when invalid
    failure_reason: str | None = None  # human-readable, no secrets
    deadline_hit: bool = False  # the episode deadline ended the episode (a policy outcome)
    reward_source: str | None = None  # "verify" | "judge" | None (never set on an invalid sample)
    failed_attempt_kinds: tuple[str, ...] = ()  # kinds of the rollout's failed attempts, oldest first
    failed_after_action_kinds: tuple[str, ...] = ()  # those in which a tool call of the policy's had reached it
    episode_wall_s: float = 0.0  # the rollout's wall time over all its attempts
    refused_navigations: int = 0
    browser_actions: int = 0  # calls that acted on the page (finish not counted), final attempt
    resumed_kinds: tuple[str, ...] = ()  # kinds of the failures the rollout resumed from (same sample, new session)
    resume_diverged: int = 0  # resumes given up on because the replayed page differed from the one the policy read
    step: int | None = None  # step-wise mode: this sample's step number, from 1
    steps: int | None = None  # step-wise mode: the episode's number of step samples

    @property
    def stands_for_episode(self) -> bool:
        """The only sample of a one-sample episode, or a step-wise episode's final step sample (the earlier ones
        repeat its flags): rates over these are rates over episodes."""
        return self.step is None or self.steps is None or self.step == self.steps

    def at_step(self, step: int, steps: int) -> SampleFlags:
        """The episode's flags on its step sample number ``step`` of ``steps``."""
        return dataclasses.replace(self, step=step, steps=steps)

    def reward_extra_info(self) -> dict[str, float]:
        """The numeric copy of the flags that verl's validation metrics average (``val-aux/.../env/...``)."""
        return {
            INVALID_INFO_KEY: float(self.invalid),
            "env/attempts": float(self.attempts),
            "env/deadline_hit": float(self.deadline_hit),
            "env/reward_from_verify": float(self.reward_source == "verify"),
            "env/reward_from_judge": float(self.reward_source == "judge"),
            "env/episode_wall_s": float(self.episode_wall_s),
            "env/browsed": float(self.browser_actions > 0),
            "env/browser_actions": float(self.browser_actions),
            "env/resumed": float(len(self.resumed_kinds)),
        }

    def extra_fields(self) -> dict[str, Any]:
        """What the sample's ``AgentLoopOutput.extra_fields`` gets (JSON types only: lists, not tuples)."""
        fields: dict[str, Any] = {
            INVALID_KEY: self.invalid,
            FAILURE_KIND_KEY: self.failure_kind,
            FAILURE_REASON_KEY: self.failure_reason,
            ATTEMPTS_KEY: self.attempts,
            DEADLINE_HIT_KEY: self.deadline_hit,
            REWARD_SOURCE_KEY: self.reward_source,
            FAILED_ATTEMPT_KINDS_KEY: list(self.failed_attempt_kinds),
            FAILED_AFTER_ACTION_KINDS_KEY: list(self.failed_after_action_kinds),
            EPISODE_WALL_KEY: self.episode_wall_s,
            REFUSED_NAVIGATIONS_KEY: self.refused_navigations,
            BROWSER_ACTIONS_KEY: self.browser_actions,
            RESUMED_KINDS_KEY: list(self.resumed_kinds),
            RESUME_DIVERGED_KEY: self.resume_diverged,
        }
        if self.step is not None:
            fields.update({STEP_KEY: self.step, STEPS_KEY: self.steps})
        fields[REWARD_EXTRA_INFO_KEY] = self.reward_extra_info()
        return fields

    @classmethod
    def from_extra_fields(cls, fields: Any) -> SampleFlags | None:
        """One sample's flags from its extra fields (numpy scalars accepted); None for a sample without them (another
        agent loop's). A missing key reads as its default, as the metrics always have."""
        if not isinstance(fields, Mapping) or fields.get(INVALID_KEY) is None:
            return None
        step, steps = fields.get(STEP_KEY), fields.get(STEPS_KEY)
        return cls(
            invalid=bool(fields[INVALID_KEY]),
            attempts=int(fields.get(ATTEMPTS_KEY) or 1),
            failure_kind=_text(fields.get(FAILURE_KIND_KEY)),
            failure_reason=_text(fields.get(FAILURE_REASON_KEY)),
            deadline_hit=bool(fields.get(DEADLINE_HIT_KEY)),
            reward_source=_text(fields.get(REWARD_SOURCE_KEY)),
            failed_attempt_kinds=_kinds(fields.get(FAILED_ATTEMPT_KINDS_KEY)),
            failed_after_action_kinds=_kinds(fields.get(FAILED_AFTER_ACTION_KINDS_KEY)),
            episode_wall_s=float(fields.get(EPISODE_WALL_KEY) or 0.0),
            refused_navigations=int(fields.get(REFUSED_NAVIGATIONS_KEY) or 0),
            browser_actions=int(fields.get(BROWSER_ACTIONS_KEY) or 0),
            resumed_kinds=_kinds(fields.get(RESUMED_KINDS_KEY)),
            resume_diverged=int(fields.get(RESUME_DIVERGED_KEY) or 0),
            step=int(step) if step is not None else None,
            steps=int(steps) if steps is not None else None,
        )


def _text(value: Any) -> str | None:
    return str(value) if value else None


def _kinds(value: Iterable[Any] | None) -> tuple[str, ...]:
    return () if value is None else tuple(str(kind) for kind in value)
