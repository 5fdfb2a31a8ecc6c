"""What a chaos run found, per rollout and in all (:class:`ChaosReport`).

The confusion matrix of cause against the first infrastructure failure the rollout met (the first failure it resumed
from, else its first failed attempt's ``env_failure_kind``; none: a policy outcome), the sessions left open on the
servers, the longest attempt (its first session's seed answered to its last session's verify or close, as the servers
saw them) against the deadline plus one per-call timeout plus the attempt's own replay seconds, the share of rollout
slots that still produced a valid sample, and what resuming did; :meth:`ChaosReport.targets` says which were met.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from ..agent_attempt.sample_flags import SampleFlags
from ..gym_contract.session_ids import parse_session_id
from .chaos_plan import ALL_CAUSES, INFRA, JUDGE_DOWN, POLICY, Cause, ChaosSettings


@dataclass
class RolloutRecord:
    index: int
    cause: Cause
    phase: str
    output: Any = None
    error: str | None = None

    @property
    def flags(self) -> SampleFlags | None:
        """The flags the rollout's sample carries; None without a sample (or one without flags)."""
        return SampleFlags.from_extra_fields(getattr(self.output, "extra_fields", None))

    @property
    def first_attempt(self) -> tuple[str, str | None]:
        """``(INFRA, kind)`` for the first infrastructure failure the rollout met, else ``(POLICY, None)``: the first
        failure it resumed from, if any (faults are aimed at the first attempt), else its first failed attempt's."""
        flags = self.flags
        kinds = (*flags.resumed_kinds, *flags.failed_attempt_kinds) if flags else ()
        return (INFRA, kinds[0]) if kinds else (POLICY, None)

    @property
    def resumed(self) -> bool:
        return bool(self.flags and self.flags.resumed_kinds)

    @property
    def diverged(self) -> bool:
        return bool(self.flags and self.flags.resume_diverged)

    @property
    def rerun_after_action(self) -> bool:
        """An attempt failed after a tool call of the policy's had reached it, and the rollout was re-run."""
        return bool(self.flags and self.flags.failed_after_action_kinds)

    @property
    def valid(self) -> bool:
        return self.output is not None and self.flags is not None and not self.flags.invalid


@dataclass
class ChaosReport:
    target: str
    settings: ChaosSettings
    records: list[RolloutRecord]
    left_open: dict[str, int]  # by what was measured
    left_open_total: int  # sessions still holding a browser
    closes_refused: int  # sessions none of whose closes got through (each answered by an injected fault)
    attempt_seconds: dict[str, float]  # <rollout id>.<attempt> -> first seed answered to last verify/close received
    loop_lag_s: float  # the longest the run's event loop was late to wake a sleeper (its own overload)
    wall_s: float
    unparsed_sessions: list[str] = field(default_factory=list)
    attempt_sessions: dict[str, int] = field(default_factory=dict)  # sessions each attempt seeded (> 1: a resume)
    replay_seconds: dict[str, float] = field(default_factory=dict)  # final attempts that tried to resume: seconds

    @property
    def matrix(self) -> dict[str, collections.Counter[str]]:
        table: dict[str, collections.Counter[str]] = {}
        for record in self.records:
            side, _ = record.first_attempt
            table.setdefault(record.cause.name, collections.Counter())[side] += 1
        return table

    @property
    def misclassified(self) -> list[RolloutRecord]:
        """Rollouts whose first attempt was blamed on the wrong side, or failed with an unexpected kind."""
        wrong = []
        for record in self.records:
            side, kind = record.first_attempt
            if record.error is not None or side != record.cause.side:
                wrong.append(record)
            elif side == INFRA and kind not in record.cause.expected_kinds:
                wrong.append(record)
        return wrong

    @property
    def policy_rows_wrong(self) -> list[RolloutRecord]:
        """Policy outcomes that did not end as their script intends (deadline rows must hit the deadline, ...)."""
        wrong = []
        for record in self.records:
            if record.cause.side != POLICY or record.output is None:
                continue
            flags = record.flags or SampleFlags(invalid=True)
            if record.cause.name == "out of time (deadline)" and not flags.deadline_hit:
                wrong.append(record)
            if record.cause.name == "judged task" and flags.reward_source != "judge":
                wrong.append(record)
        return wrong

    @property
    def longest_attempt(self) -> tuple[str | None, float]:
        if not self.attempt_seconds:
            return None, 0.0
        attempt = max(self.attempt_seconds, key=self.attempt_seconds.__getitem__)
        return attempt, self.attempt_seconds[attempt]

    @property
    def attempt_bound_s(self) -> float:
        """The bound of an attempt that never resumed: a resumed one adds its own replay seconds (off its clock)."""
        return self.settings.episode_deadline_s + self.settings.call_timeout_s

    def bound_of(self, attempt: str) -> float:
        return self.attempt_bound_s + self.replay_seconds.get(attempt, 0.0)

    @property
    def unrecorded_resumes(self) -> list[str]:
        """Attempts that seeded a new session (tried to resume) and were then re-run: no record keeps their replay
        seconds (a trajectory record is the final attempt's), so they are listed, not bounded."""
        return sorted(key for key, n in self.attempt_sessions.items() if n > 1 and key not in self.replay_seconds)

    @property
    def over_bound(self) -> list[tuple[str, float, float]]:
        """``(attempt, seconds, bound)`` of every bounded attempt longer than its bound plus the event loop's lag."""
        skipped = set(self.unrecorded_resumes)
        return [
            (key, span, self.bound_of(key))
            for key, span in self.attempt_seconds.items()
            if key not in skipped and span > self.bound_of(key) + self.loop_lag_s
        ]

    @property
    def resume_tried(self) -> set[int]:
        """Rollouts any of whose attempts tried to resume (seeded a second session, or its flags say so)."""
        indices = {r.index for r in self.records if r.resumed or r.diverged}
        for key, n in self.attempt_sessions.items():
            parsed = parse_session_id(f"{key}.0")  # an attempt key is a session id less its number
            if n > 1 and parsed is not None:
                indices.add(parsed[0])
        return indices

    @property
    def valid_expected(self) -> list[RolloutRecord]:
        """Rollout slots meant to end valid: all but those whose judge stayed down (kept flagged by design)."""
        return [r for r in self.records if r.cause.name != JUDGE_DOWN.name]

    @property
    def valid_fraction(self) -> float:
        expected = self.valid_expected
        return sum(r.valid for r in expected) / len(expected) if expected else 0.0

    def targets(self) -> list[tuple[str, bool]]:
        infra = [r for r in self.records if r.cause.side == INFRA]
        policy = [r for r in self.records if r.cause.side == POLICY]
        infra_right = [r for r in infra if r.first_attempt[0] == INFRA]
        kinds_right = [r for r in infra_right if r.first_attempt[1] in r.cause.expected_kinds]
        policy_blamed = [r for r in policy if r.first_attempt[0] == INFRA]
        scripted = len(policy) - len(self.policy_rows_wrong)
        crashed = sum(r.error is not None for r in self.records)
        policy_resumed = [r for r in policy if r.index in self.resume_tried]
        _, longest = self.longest_attempt
        left = self.left_open_total
        bound = (
            f"longest attempt {longest:.2f} s vs deadline {self.settings.episode_deadline_s:g} s + one per-call "
            f"timeout {self.settings.call_timeout_s:g} s = {self.attempt_bound_s:g} s{self._replay_text()} "
            f"(+ event-loop lag {self.loop_lag_s:.2f} s: every timer of this process fired that late at worst)"
        )
        return [
            (f"infrastructure faults classified infrastructure: {len(infra_right)}/{len(infra)}",
             len(infra_right) == len(infra)),
            (f"failure kinds as expected for them: {len(kinds_right)}/{len(infra)}", len(kinds_right) == len(infra)),
            (f"policy outcomes classified infrastructure: {len(policy_blamed)}/{len(policy)}", not policy_blamed),
            (f"policy outcomes ended as scripted: {scripted}/{len(policy)}", scripted == len(policy)),
            (f"sessions left open on the servers: {left} ({self._left_text()})", left == 0),
            (bound, not self.over_bound),
            (f"rollouts that crashed instead of returning a sample: {crashed}", crashed == 0),
            (f"session ids not attributable to a rollout: {len(self.unparsed_sessions)}", not self.unparsed_sessions),
            (f"policy outcomes resumed (a resume of the policy's mistake): {len(policy_resumed)}/{len(policy)}",
             not policy_resumed),
        ]  # fmt: skip

    def _replay_text(self) -> str:
        """How the bound grows for resumed attempts (nothing when none resumed)."""
        if not self.replay_seconds and not self.unrecorded_resumes:
            return ""
        margin = {k: self.attempt_seconds.get(k, 0.0) - self.bound_of(k) for k in self.replay_seconds}
        closest = max(margin, key=margin.__getitem__, default=None)
        text = f"; a resumed attempt + its own replay seconds ({len(self.replay_seconds)} attempts"
        if closest is not None:
            span = self.attempt_seconds.get(closest, math.nan)
            text += f", the closest to its bound {span:.2f} s vs {self.bound_of(closest):.2f} s"
        unrecorded = self.unrecorded_resumes
        if unrecorded:
            longest = max(self.attempt_seconds.get(k, 0.0) for k in unrecorded)
            text += f"; {len(unrecorded)} re-run after trying, replay unrecorded, not bounded: longest {longest:.2f} s"
        return text + ")"

    @property
    def resumed_count(self) -> int:
        return sum(r.resumed for r in self.records)

    @property
    def diverged_count(self) -> int:
        return sum(r.diverged for r in self.records)

    @property
    def rerun_after_action_count(self) -> int:
        return sum(r.rerun_after_action for r in self.records)

    @property
    def _tried_attempts(self) -> list[str]:
        return [key for key, n in self.attempt_sessions.items() if n > 1]

    def _left_text(self) -> str:
        measures = ", ".join(f"{name} {count}" for name, count in self.left_open.items())
        return f"{measures}; sessions whose every close got a 5xx: {self.closes_refused}"

    def format(self) -> str:
        lines = [f"-- {self.target}: {len(self.records)} rollouts in {self.wall_s:.1f} s"]
        lines.append(
            f"{'injected cause (first attempt)':<58} | {'infra':>6} | {'policy':>6} | {'resumed':>7} | "
            "first env_failure_kind met"
        )
        lines.append("-" * 110)
        kinds: dict[str, collections.Counter[str]] = {}
        for record in self.records:
            side, kind = record.first_attempt
            if side == INFRA:
                kinds.setdefault(record.cause.name, collections.Counter())[kind or "?"] += 1
        matrix = self.matrix
        resumed = collections.Counter(r.cause.name for r in self.records if r.resumed)
        sides = {r.cause.name: r.cause.side for r in self.records}
        known = [c.name for c in ALL_CAUSES]
        for name in [*known, *sorted(set(matrix) - set(known))]:
            if name not in matrix:
                continue
            row = matrix[name]
            kind_text = ", ".join(f"{k} {n}" for k, n in sorted(kinds.get(name, {}).items()))
            label = f"{name} ({'infra' if sides[name] == INFRA else 'policy'})"
            lines.append(f"{label:<58} | {row[INFRA]:>6} | {row[POLICY]:>6} | {resumed[name]:>7} | {kind_text}")
        flags = [r.flags for r in self.records if r.flags is not None]
        resampled = [f for f in flags if f.attempts > 1]
        again = sum(len(f.failed_attempt_kinds) > 1 for f in flags)
        lines.append(
            f"resampled rollouts: {len(resampled)}, of which a later attempt failed again: {again}; "
            f"valid samples: {sum(r.valid for r in self.valid_expected)}/{len(self.valid_expected)} = "
            f"{self.valid_fraction:.1%} (judge-down rows, kept flagged, not counted)"
        )
        lines.append(
            f"resuming (resume.max_per_episode {self.settings.resume_max_per_episode}): rollouts resumed "
            f"{self.resumed_count}, diverged {self.diverged_count}, re-run after the policy acted "
            f"{self.rerun_after_action_count}; attempts that tried to resume {len(self._tried_attempts)}"
        )
        rollout_walls = [f.episode_wall_s for f in flags]
        attempt, longest = self.longest_attempt
        lines.append(
            f"longest attempt: {longest:.2f} s ({attempt}); longest rollout, all attempts and backoffs: "
            f"{max(rollout_walls, default=0.0):.2f} s"
        )
        slow, call = self.settings.slow_call_s, self.settings.call_timeout_s
        lines.append(
            f"slow observes of the deadline rows: {slow:.2f} s each, {call - slow:.2f} s inside the per-call timeout; "
            f"the event loop woke timers up to {self.loop_lag_s:.2f} s late"
        )
        for record in self.misclassified[:10]:
            side, kind = record.first_attempt
            lines.append(
                f"  MISCLASSIFIED #{record.index} {record.cause.name}: recorded {side} {kind or ''} "
                f"{record.error or (record.flags and record.flags.failure_reason) or ''}"[:200]
            )
        for text, ok in self.targets():
            lines.append(f"{'ok  ' if ok else 'MISS'} {text}")
        return "\n".join(lines)
