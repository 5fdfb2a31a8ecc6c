"""The in-process environment server's sessions: which browser each session id holds, their lifetimes, and grading.

Owns the session table (:class:`SessionTable`) and what the real server does with a session behind its HTTP
handlers: open a browser on the start page (a failed load opens nothing; a launch cancelled part-way strands its
browser, counted in :attr:`SessionTable.orphaned_browsers`), bind a typed id to one episode and task, release the
browser at verify, close or a legacy re-seed, run a tool on it and answer in the tool shape, keep the first
``browser_finish``, and grade (:func:`score`). The contract these follow is stated in
:mod:`~nemo_gym_browser.local.environment_server.server`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .site_model import Browser, Site
from .wire import (
    BrowserSeedSessionRequest,
    EpisodeId,
    ResourcesCloseSessionRequest,
    ResourcesSeedSessionRequest,
    TaskId,
    ToolResponse,
)

logger = logging.getLogger(__name__)

__all__ = [
    "NO_SESSION_ERROR",
    "SESSION_NOT_FOUND_AT_VERIFY",
    "ScoringUnavailable",
    "SessionState",
    "SessionTable",
    "score",
]

NO_SESSION_ERROR = "no active session; seed_session must be called first"
SESSION_NOT_FOUND_AT_VERIFY = "browser session not found at verify"
# As the real "no supported scoring key" message lists them (grading tries answer_equals first).
_SCORING_KEYS_IN_MESSAGE = ("final_url", "url_contains", "dom_contains", "answer_equals")


class ScoringUnavailable(RuntimeError):
    """The browser could not be read while grading: verify answers reward 0.0 with this as ``failure_reason``."""


@dataclass
class SessionState:
    browser: Browser
    gt: dict[str, Any]
    answer: str | None = None
    finished_url: str | None = None
    finished_text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finished_url is not None


class SessionTable:
    """Every session with a browser, and the typed ids bound to an episode and task (or closed for good)."""

    def __init__(self) -> None:
        self.orphaned_browsers = 0
        self.peak_open = 0  # the most browsers ever open at once
        self._states: dict[str, SessionState] = {}
        self._typed_identity: dict[str, tuple[EpisodeId, TaskId]] = {}
        self._typed_closed: dict[str, EpisodeId] = {}
        self._typed_locks: dict[str, asyncio.Lock] = {}

    @property
    def open_session_ids(self) -> tuple[str, ...]:
        """Sessions holding a browser (seeded and not released by verify, close, or a legacy re-seed)."""
        return tuple(self._states)

    def task_id(self, session_id: str) -> str | None:
        """The task a typed session is bound to."""
        identity = self._typed_identity.get(session_id)
        return identity[1].task_id if identity is not None else None

    # ----- lifetimes ------------------------------------------------------------------------------------------

    async def seed_typed(self, body: ResourcesSeedSessionRequest, site: Site, *, browser_open_s: float) -> None:
        """Open the typed session's browser, or nothing when the same episode and task seed it again."""
        session_id = body.resources_session_id
        async with self._typed_locks.setdefault(session_id, asyncio.Lock()):
            if session_id in self._typed_closed:
                raise ValueError(f"resources session is already closed: {session_id}")
            identity = self._typed_identity.get(session_id)
            if identity is None:
                spec = BrowserSeedSessionRequest.model_validate(body.task_data)
                await self.open(session_id, spec, site, browser_open_s=browser_open_s)
                self._typed_identity[session_id] = (body.episode_id, body.task_id)
            elif identity != (body.episode_id, body.task_id):
                raise ValueError("resources_session_id is already bound to another episode or task")

    async def open(
        self, session_id: str, spec: BrowserSeedSessionRequest, site: Site, *, browser_open_s: float
    ) -> None:
        """A new browser for ``session_id`` on the start page; raises (opening nothing) when the page fails."""
        initial_url = site.resolve_initial_url(spec.initial_url)
        self.release(session_id)  # a re-seeded id gives its old browser back first
        browser = Browser(site)
        if browser_open_s > 0:
            try:
                await asyncio.sleep(browser_open_s)
            except asyncio.CancelledError:
                # The real open() unwinds on Exception only: a cancelled launch strands its browser.
                self.orphaned_browsers += 1
                logger.warning("environment server: seed of %s cancelled while opening its browser", session_id)
                raise
        if initial_url:
            browser.goto(initial_url)  # raises Error: the seed answers 500 and nothing stays open
        self._states[session_id] = SessionState(browser=browser, gt=dict(spec.verifier_metadata or {}))
        self.peak_open = max(self.peak_open, len(self._states))

    def release(self, session_id: str | None) -> None:
        if session_id is not None:
            self._states.pop(session_id, None)

    async def close_typed(self, typed: ResourcesCloseSessionRequest) -> None:
        """Release the typed session's browser and remember the id as closed; idempotent for the same episode."""
        session_id = typed.resources_session_id
        async with self._typed_locks.setdefault(session_id, asyncio.Lock()):
            closed_episode = self._typed_closed.get(session_id)
            if closed_episode is not None:
                if typed.episode_id != closed_episode:
                    raise ValueError("episode_id does not match the closed resources session")
            else:
                identity = self._typed_identity.get(session_id)
                if identity is not None and typed.episode_id != identity[0]:
                    raise ValueError("episode_id does not match the seeded resources session")
                self.release(session_id)
                self._typed_identity.pop(session_id, None)
                self._typed_closed[session_id] = typed.episode_id

    def lose(self, session_id: str) -> None:
        """Forget a session without closing anything (its browser died with it, so nothing leaks)."""
        if self._states.pop(session_id, None) is not None:
            logger.info("environment server: session %s lost", session_id)
        self._typed_identity.pop(session_id, None)

    def crash_browser(self, session_id: str) -> None:
        """Kill the session's browser; the session stays (and still needs releasing)."""
        state = self._states.get(session_id)
        if state is not None:
            state.browser.crashed = True
            logger.info("environment server: browser of session %s crashed", session_id)

    def forget_everything(self) -> None:
        self._states.clear()
        self._typed_identity.clear()
        self._typed_closed.clear()
        self._typed_locks.clear()

    # ----- tools and grading ----------------------------------------------------------------------------------

    def tool(self, session_id: str, verb: str, act: Callable[[Browser], None], *, max_elements: int) -> ToolResponse:
        """Run ``act`` on the session's browser and re-observe; a page-level failure is an answer, not an error."""
        state = self._states.get(session_id)
        if state is None:
            return ToolResponse(observation="", error=NO_SESSION_ERROR)
        try:
            act(state.browser)
            observation = state.browser.observe(max_elements).render(max_elements)
        except Exception as exc:
            return ToolResponse(observation="", error=f"{verb} failed: {exc}")
        return ToolResponse(observation=observation)

    def finish(self, session_id: str, answer: str) -> ToolResponse:
        state = self._states.get(session_id)
        if state is None:
            return ToolResponse(observation="", error=NO_SESSION_ERROR)
        if not state.finished:  # the first finish wins
            state.answer = answer
            try:
                state.finished_url, state.finished_text = state.browser.finish_snapshot()
            except Exception:
                logger.warning("environment server: no snapshot at finish for session %s", session_id)
        return ToolResponse(observation="", done=True)

    def verify(self, session_id: str) -> tuple[float, str | None]:
        """``(reward, failure_reason)``, releasing the browser whatever happens."""
        state = self._states.get(session_id)
        reward, failure_reason = 0.0, SESSION_NOT_FOUND_AT_VERIFY
        if state is not None:
            failure_reason = None
            try:
                reward = score(state)
            except ScoringUnavailable as exc:
                failure_reason = str(exc)
            finally:
                self.release(session_id)
        return reward, failure_reason


def score(state: SessionState) -> float:
    """Grade against the seed's verifier_metadata; the first supported key present decides."""
    gt = state.gt
    if "answer_equals" in gt:
        return float((state.answer or "").strip() == str(gt["answer_equals"]).strip())
    try:
        if state.finished:
            url, text = state.finished_url or "", state.finished_text or ""
        else:
            url, text = state.browser.finish_snapshot()
        if "final_url" in gt:
            return float(url == gt["final_url"])
        if "url_contains" in gt:
            return float(gt["url_contains"] in url)
        if "dom_contains" in gt:
            return float(str(gt["dom_contains"]).lower() in text.lower())
    except Exception as exc:
        raise ScoringUnavailable(f"browser unreachable while scoring: {type(exc).__name__}: {exc}") from exc
    raise ValueError(
        f"verifier_metadata has no supported scoring key (got {sorted(gt)}; "
        f"expected one of {list(_SCORING_KEYS_IN_MESSAGE)})"
    )
