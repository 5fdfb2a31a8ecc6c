"""The recipe's one failure vocabulary: why a sample measures the infrastructure and not the policy.

"Environment" here is everything the policy acts on or is graded by: the ``interactive_browser`` server and its
browsers, and the judge. :class:`FailureKind` names what failed (its values are the per-sample
``env_failure_kind`` and the ``env/failure/<kind>`` metrics); :class:`EnvironmentFailure` is the one exception
type that carries a kind and a reason. The environment client, the judge's verdicts, the agent loop and the step
metrics all read the kinds from here. Standard library only.
"""

from __future__ import annotations

import enum


class FailureKind(enum.StrEnum):
    """What part of the environment failed. The values are the recipe's per-sample ``env_failure_kind``."""

    SEED_FAILED = "seed_failed"  # no browser session could be opened for the task
    SESSION_LOST = "session_lost"  # the server no longer knows the session, or its browser is gone
    UNREACHABLE = "unreachable"  # no connection to the server
    SERVER_ERROR = "server_error"  # a 5xx, a malformed answer, or an error the client did not expect
    TIMEOUT = "timeout"  # a call past its timeout, or a session held past its hold limit
    VERIFY_UNAVAILABLE = "verify_unavailable"  # the server could not grade the episode
    JUDGE_UNUSABLE = "judge_unusable"  # the judge gave no usable verdict (or no judge is configured)


FAILURE_KINDS = tuple(kind.value for kind in FailureKind)


class EnvironmentFailure(Exception):
    """The environment failed, so the episode measures nothing about the policy.

    ``kind`` says what failed and ``reason`` says how, in words an operator can act on; neither ever holds a
    secret. ``server_url`` names the environment server when one is to blame.
    """

    def __init__(self, kind: FailureKind, reason: str, *, server_url: str | None = None) -> None:
        self.kind = FailureKind(kind)
        self.reason = reason
        self.server_url = server_url
        super().__init__(f"{self.kind.value}: {reason}")
