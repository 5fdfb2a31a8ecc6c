"""Replaying an attempt's browser calls in a new session, so a lost session costs calls, not the policy's sample.

Contract: :func:`replay` calls, in order, every recorded step that reached the browser, with its own arguments, and
checks each answer against what the policy was shown then: an error where the policy read an error, and where it
read a page, the same page (its URL and :func:`page_fingerprint`). It stops at the first difference and returns a
:class:`Replay` saying whether the new session now stands where the old one did. The model is never asked.

:class:`AttemptSessions` holds the sessions of one attempt: the first, and one more per resume, the one it replaces
closed in the background (a server that hangs must not hold the new one up) and all of them closed by
:meth:`AttemptSessions.close`, which the attempt awaits whatever ends it.

Errors: an infrastructure failure of the new session propagates as the :class:`EnvironmentFailure` it is; each
call is bounded by ``call_bound_s``. When to resume, and the budgets: :class:`~.episode.BrowserEpisode`. Why:
``docs/failures.md`` ("Resume").
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from ..gym_contract.environment import BrowserSession, parse_observation
from ..gym_contract.failures import EnvironmentFailure, FailureKind

# Failures a resume can repair: the session or its server broke under a call. A grade the server refused
# (verify_unavailable) or a judge without a verdict is no lost session; a call hung past the hold limit is the
# attempt's own clock, never resumed.
RESUMABLE_KINDS = frozenset(
    {FailureKind.SESSION_LOST, FailureKind.SERVER_ERROR, FailureKind.UNREACHABLE, FailureKind.TIMEOUT}
)


def page_fingerprint(observation: str | None) -> str | None:
    """A short digest of an observation, whitespace collapsed; None for no observation."""
    if not observation:
        return None
    return hashlib.sha256(" ".join(observation.split()).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ReplayedStep:
    """What :func:`replay` needs of one recorded step (:class:`~.episode.Step` is one)."""

    tool: str
    arguments: Mapping[str, Any]
    failed: bool  # the policy read an error
    page: str | None  # the fingerprint of the page it read


@dataclass(frozen=True)
class Replay:
    """How a replay went: ``matched`` when every step answered as before; otherwise ``mismatch`` says where."""

    matched: bool
    calls: int
    seconds: float
    mismatch: str | None = None


async def replay(session: BrowserSession, steps: Sequence[ReplayedStep], call_bound_s: float) -> Replay:
    """Call ``steps`` in order on ``session``; stop at the first answer that differs from what the policy read."""
    started = time.monotonic()
    for number, step in enumerate(steps, start=1):
        try:
            result = await asyncio.wait_for(session.call(step.tool, step.arguments), call_bound_s)
        except TimeoutError:
            raise EnvironmentFailure(
                FailureKind.TIMEOUT, f"replayed {step.tool} did not answer within {call_bound_s:g}s"
            ) from None
        mismatch = None
        if bool(result.error) != step.failed:
            mismatch = "an error where there was none" if result.error else "no error where there was one"
        elif not step.failed and page_fingerprint(result.observation) != step.page:
            url, _, _ = parse_observation(result.observation)
            mismatch = f"another page (now at {url})"
        if mismatch:
            seconds = time.monotonic() - started
            return Replay(False, number, seconds, f"call {number} ({step.tool}): {mismatch}")
    return Replay(True, len(steps), time.monotonic() - started)


class AttemptSessions:
    """The environment sessions of one attempt, opened by ``open_session`` (``EnvironmentClient.session``)."""

    def __init__(self, open_session: Callable[[], AbstractAsyncContextManager[BrowserSession]]) -> None:
        self._open_session = open_session
        self._current: AbstractAsyncContextManager[BrowserSession] | None = None
        self._closing: list[asyncio.Task[object]] = []

    async def open(self) -> BrowserSession:
        """A new seeded session; the one it replaces, if any, is closed in the background."""
        if self._current is not None:
            replaced, self._current = self._current, None
            self._closing.append(asyncio.ensure_future(replaced.__aexit__(None, None, None)))
        opening = self._open_session()
        session = await opening.__aenter__()  # a failed seed cleans up after itself and raises
        self._current = opening
        return session

    async def close(self) -> None:
        """Close the current session and wait for the replaced ones; never raises for a close that failed."""
        if self._current is not None:
            current, self._current = self._current, None
            self._closing.append(asyncio.ensure_future(current.__aexit__(None, None, None)))
        closing, self._closing = self._closing, []
        await asyncio.gather(*closing, return_exceptions=True)
