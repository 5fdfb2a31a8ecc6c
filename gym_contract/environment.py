"""The NeMo Gym 0.7.0 ``interactive_browser`` wire contract, in one place.

Contract: the typed seed (``/seed_session`` with a caller-chosen ``resources_session_id``), the five browser
endpoints, ``/verify`` with the body the server requires, and the typed ``/close_session``, each under an explicit
timeout. Every outcome is either an :class:`EnvironmentFailure` (the infrastructure failed; it carries a
:class:`FailureKind`) or a :class:`ToolResult` whose ``error`` the policy reads. What an answer's bytes and error
text mean is read by :mod:`~nemo_gym_browser.gym_contract.server_answers`, never from text the policy wrote. Sessions
are spread over servers by :mod:`~nemo_gym_browser.gym_contract.placement`.

Lifetimes: ``async with client.session(...) as session`` holds a placement slot, seeds on entry, closes on exit and
gives the slot back, whatever ended the block. ``close()`` sends the typed close even when the seed failed (a seed
given up on may still open a browser, and the close of its id stops it) and never raises. One cookie jar per
session (``CookieJar(unsafe=True)``: aiohttp's default drops cookies of ``127.0.0.1``); connections are pooled.

Retries: only idempotent calls (seed, observe, navigate, finish, close), only on a refused or reset connection, at
most ``transient_retries`` times; never click, type or verify, never a timeout. In full: ``docs/failures.md``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..settings import EnvironmentConfig
from . import session_ids
from .browser_calls import (
    BROWSER_CLICK,
    BROWSER_FINISH,
    BROWSER_NAVIGATE,
    BROWSER_OBSERVE,
    BROWSER_TYPE,
    TOOL_NAMES,
)
from .credentials import redact, secret_values
from .failures import EnvironmentFailure, FailureKind
from .placement import Grant, Orphan, Placement, PlacementUnavailable, SessionTicket, make_placement
from .rows import VERIFIER_KEYS as VERIFIER_KEYS  # re-exported: callers of the client import the rule from here
from .rows import validate_verifier_metadata as validate_verifier_metadata
from .server_answers import (
    NO_SESSION_ERROR,
    MalformedAnswer,
    checked_reward,
    lost_session_reason,
    parse_json,
    read_body,
)
from .text import shorten

logger = logging.getLogger(__name__)

# Calls that are safe to repeat after a transport error (see the module docstring for why).
IDEMPOTENT_TOOLS = frozenset({BROWSER_OBSERVE, BROWSER_NAVIGATE, BROWSER_FINISH})

# What verify's failure_reason says when the session is gone (anything else there: verify could not grade).
_VERIFY_SESSION_NOT_FOUND = "browser session not found at verify"
# A close is tried again on a timeout or a 5xx for up to this many times close_timeout_s in all, pausing at most
# _CLOSE_BACKOFF_CAP_S between tries.
_CLOSE_TRIES = 3
_CLOSE_BACKOFF_CAP_S = 2.0
# A server's answer quoted in a failure reason: enough to act on, short enough for a log line.
_DETAIL_CHARS = 300
# Idle pooled connections are closed after this, below uvicorn's 30 s keep-alive: the client, not the server, closes.
KEEPALIVE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ToolResult:
    """One browser action as the policy sees it. ``error`` set means the policy's action failed, not the server."""

    observation: str
    done: bool = False
    error: str | None = None


@dataclass(frozen=True)
class VerifyResult:
    """A grade the server could actually compute: a finite reward in [0, 1]."""

    reward: float
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        checked_reward(self.reward)  # raises MalformedAnswer (a ValueError): no such grade exists


# ----- wire bodies (pydantic: everything that crosses HTTP) ---------------------------------------------------


class _EpisodeId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt: int = Field(ge=0)


class _TaskId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


class _SeedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resources_session_id: str
    episode_id: _EpisodeId
    task_id: _TaskId
    task_data: dict[str, Any]


class _SeedResponse(BaseModel):
    resources_session_id: str


class _CloseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resources_session_id: str
    episode_id: _EpisodeId


class _ToolAnswer(BaseModel):
    observation: str = ""
    done: bool = False
    error: str | None = None


class _VerifyAnswer(BaseModel):
    model_config = ConfigDict(extra="allow")
    reward: Any  # its type and range are checked by checked_reward, which says what is wrong
    mask_sample: bool = False
    failure_kind: str | None = None
    failure_reason: str | None = None


def _verify_body(rollout_id: str) -> dict[str, Any]:
    """The smallest body the server's ``BaseVerifyRequest`` accepts; the grade comes from seed-time metadata."""
    return {
        "responses_create_params": {"input": []},
        "response": {
            "id": f"resp-{rollout_id}",
            "created_at": 0,
            "model": "policy",
            "object": "response",
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        },
    }


def _brief(text: object) -> str:
    """Server text as a failure reason or log detail: short, and without any credential of this process (a server
    may echo what it was sent or learnt), taken out before the cut."""
    return shorten(redact(str(text), secret_values(os.environ)), _DETAIL_CHARS, one_line=True)


# ----- servers ------------------------------------------------------------------------------------------------


class _Server:
    """One environment server as this process sees it: its URL and this process's sessions on it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outstanding = 0
        self.reported_down_until = 0.0  # to log each outage once per process; rotation itself is placement's


class EnvironmentClient:
    """Opens browser sessions on one or more environment servers. One per process; share it across rollouts.

    Use as ``async with EnvironmentClient(config) as client`` or call :meth:`close`. The connection pool and the
    placement host are created lazily inside the running event loop.
    """

    def __init__(self, config: EnvironmentConfig) -> None:
        self.config = config
        self._servers = {url: _Server(url) for url in config.server_urls}
        self._connector: aiohttp.TCPConnector | None = None
        self._placement: Placement | None = None
        self._counter = itertools.count()

    async def __aenter__(self) -> EnvironmentClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._placement is not None:
            placement, self._placement = self._placement, None
            await placement.close()
        if self._connector is not None:
            connector, self._connector = self._connector, None
            await connector.close()

    @property
    def outstanding(self) -> dict[str, int]:
        """This process's sessions in flight per server URL (for metrics and tests)."""
        return {url: server.outstanding for url, server in self._servers.items()}

    def _pool(self) -> aiohttp.TCPConnector:
        if self._connector is None or self._connector.closed:
            self._connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=KEEPALIVE_TIMEOUT_S, enable_cleanup_closed=True
            )
        return self._connector

    def _placement_host(self) -> Placement:
        if self._placement is None:
            self._placement = make_placement(
                self.config.placement,
                self.config.server_urls,
                lease_ttl_s=self.config.lease_ttl_s,
                reap=self._close_orphan,
            )
        return self._placement

    async def _acquire_server(self, ticket: SessionTicket) -> tuple[_Server, Grant]:
        """A slot for a new session: the healthy server with the fewest sessions in flight, waiting for a free one.

        Servers out of rotation get a session only when no server is healthy (which probes them back in).
        """
        try:
            grant = await self._placement_host().acquire(
                self.config.server_urls, self.config.max_sessions_per_server, ticket
            )
        except PlacementUnavailable as exc:
            raise EnvironmentFailure(
                FailureKind.SEED_FAILED, f"session {ticket.session_id}: no server could be assigned: {exc}"
            ) from exc
        server = self._servers[grant.server]
        server.outstanding += 1
        return server, grant

    def _release_server(self, server: _Server, grant: Grant) -> None:
        server.outstanding -= 1
        self._placement_host().release(grant)

    def _mark_down(self, server: _Server, reason: str) -> None:
        now = time.monotonic()
        if now >= server.reported_down_until:
            logger.warning(
                "environment server %s out of rotation for %.0fs: %s", server.url, self.config.server_cooldown_s, reason
            )
        server.reported_down_until = now + self.config.server_cooldown_s
        self._placement_host().mark_down(server.url, self.config.server_cooldown_s)

    async def _close_orphan(self, orphan: Orphan) -> None:
        """Close the browser of a session whose process died (handed to this process by the placement authority)."""
        server = self._servers.get(orphan.server) or _Server(orphan.server)
        session = BrowserSession(
            self,
            server,
            session_id=orphan.ticket.session_id,
            rollout_id=orphan.ticket.rollout_id,
            attempt=orphan.ticket.attempt,
            task_id="orphan",
            taskset=self.config.taskset,
            initial_url=None,
            verifier_metadata=None,
        )
        logger.warning("session %s on %s: its process died; closing its browser", session.session_id, server.url)
        await session.close()

    @asynccontextmanager
    async def session(
        self,
        *,
        rollout_id: str,
        attempt: int,
        task_id: str,
        initial_url: str | None,
        verifier_metadata: Mapping[str, Any] | None = None,
        taskset: str | None = None,
    ) -> AsyncIterator[BrowserSession]:
        """Seed a browser session, yield it, and close it whatever happens."""
        metadata = validate_verifier_metadata(verifier_metadata)  # before a slot is taken: a bad row holds none
        session_id = session_ids.session_id(rollout_id, attempt, next(self._counter))
        server, grant = await self._acquire_server(
            SessionTicket(session_id=session_id, rollout_id=rollout_id, attempt=attempt)
        )
        session = BrowserSession(
            self,
            server,
            session_id=session_id,
            rollout_id=rollout_id,
            attempt=attempt,
            task_id=task_id,
            taskset=taskset or self.config.taskset,
            initial_url=initial_url,
            verifier_metadata=metadata,
        )
        try:
            await session.seed()
            self._placement_host().mark_up(grant)  # it answered: back in rotation, if it was out
            server.reported_down_until = 0.0
            yield session
        finally:
            try:
                await asyncio.shield(session.close())
            finally:
                self._release_server(server, grant)


class BrowserSession:
    """One seeded browser on one server: the rollout's whole environment. Built by :meth:`EnvironmentClient.session`."""

    def __init__(
        self,
        client: EnvironmentClient,
        server: _Server,
        *,
        session_id: str,
        rollout_id: str,
        attempt: int,
        task_id: str,
        taskset: str,
        initial_url: str | None,
        verifier_metadata: dict[str, Any] | None,
    ) -> None:
        self._client = client
        self._server = server
        self._config = client.config
        self.session_id = session_id
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.task_id = task_id
        self.taskset = taskset
        self.initial_url = initial_url
        self.verifier_metadata = verifier_metadata
        self.closed = False
        self._http: aiohttp.ClientSession | None = None
        self._jar = aiohttp.CookieJar(unsafe=True)  # unsafe=True keeps cookies of IP-address hosts
        self._episode = _EpisodeId(rollout_id=_safe_rollout_id(rollout_id), attempt=attempt)

    @property
    def server_url(self) -> str:
        return self._server.url

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=self._client._pool(),
                connector_owner=False,
                cookie_jar=self._jar,
            )
        return self._http

    # ----- one HTTP exchange ----------------------------------------------------------------------------------

    async def _post(
        self, path: str, body: Any, *, timeout_s: float, retry: bool, call_kind: FailureKind
    ) -> tuple[int, Any]:
        """POST ``body`` and return ``(status, parsed JSON)`` for any answer below 500.

        Raises :class:`EnvironmentFailure` for what the infrastructure did: no connection (``unreachable``), and
        a timeout, a dropped connection, a 5xx or a body that is not well-formed JSON (larger than
        ``max_answer_bytes``, not UTF-8, too deep), all of kind ``call_kind`` (``timeout`` and ``server_error`` for
        tool calls; ``seed_failed`` and ``verify_unavailable`` name those calls).
        """
        url = f"{self._server.url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, self._config.connect_timeout_s))
        attempts = 1 + (self._config.transient_retries if retry else 0)
        generic = call_kind is FailureKind.SERVER_ERROR
        for attempt in range(attempts):
            try:
                async with self._session().post(url, json=body, timeout=timeout) as response:
                    status = response.status
                    raw = await read_body(response, self._config.max_answer_bytes)
            except TimeoutError as exc:
                kind = FailureKind.TIMEOUT if generic else call_kind
                raise self._server_down(self._failure(kind, f"{path} did not answer within {timeout_s:g}s")) from exc
            except (
                aiohttp.ClientConnectorError,
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                aiohttp.ClientPayloadError,
            ) as exc:
                # Refused, reset or cut off: worth a quick retry when the call is idempotent.
                if attempt + 1 < attempts:
                    await asyncio.sleep(self._config.retry_backoff_s * (2**attempt))
                    continue
                if isinstance(exc, aiohttp.ClientConnectorError):
                    reason = f"cannot connect to {self._server.url} for {path}: {_brief(exc)}"
                    raise self._server_down(self._failure(FailureKind.UNREACHABLE, reason)) from exc
                kind = FailureKind.UNREACHABLE if generic else call_kind
                reason = f"connection dropped during {path}: {type(exc).__name__}"
                raise self._server_down(self._failure(kind, reason)) from exc
            except aiohttp.ClientError as exc:
                kind = FailureKind.UNREACHABLE if generic else call_kind
                raise self._failure(kind, f"{path} failed: {type(exc).__name__}: {_brief(exc)}") from exc
            except MalformedAnswer as exc:
                raise self._failure(call_kind, f"{path} answered HTTP {status} with {exc}") from exc
            if status >= 500:
                detail = _brief(raw.decode("utf-8", "replace"))
                raise self._failure(call_kind, f"{path} answered HTTP {status}: {detail}")
            try:
                payload = parse_json(raw)
            except MalformedAnswer as exc:
                detail = _brief(raw[:_DETAIL_CHARS].decode("utf-8", "replace"))
                raise self._failure(call_kind, f"{path} answered HTTP {status} with {exc}: {detail}") from exc
            return status, payload
        raise AssertionError("unreachable")  # the loop always returns or raises

    def _server_down(self, failure: EnvironmentFailure) -> EnvironmentFailure:
        """Take the server out of rotation (unless closing): the resample of this rollout goes to another one."""
        if not self.closed:
            self._client._mark_down(self._server, failure.reason)
        return failure

    def _failure(self, kind: FailureKind, reason: str) -> EnvironmentFailure:
        return EnvironmentFailure(kind, f"session {self.session_id}: {reason}", server_url=self._server.url)

    # ----- lifecycle ------------------------------------------------------------------------------------------

    async def seed(self) -> None:
        """Open the browser at the task's start URL. Any failure here is ``seed_failed`` (or ``unreachable``)."""
        task_data: dict[str, Any] = {}
        if self.initial_url:
            task_data["initial_url"] = self.initial_url
        if self.verifier_metadata:
            task_data["verifier_metadata"] = self.verifier_metadata
        body = _SeedRequest(
            resources_session_id=self.session_id,
            episode_id=self._episode,
            task_id=_TaskId(taskset=self.taskset, task_id=self.task_id),
            task_data=task_data,
        )
        status, payload = await self._post(
            "/seed_session",
            body.model_dump(),
            timeout_s=self._config.seed_timeout_s,
            retry=True,
            call_kind=FailureKind.SEED_FAILED,
        )
        if status != 200:
            raise self._failure(FailureKind.SEED_FAILED, f"seed rejected (HTTP {status}): {_brief(payload)}")
        try:
            answer = _SeedResponse.model_validate(payload)
        except ValidationError as exc:
            raise self._failure(
                FailureKind.SEED_FAILED, f"seed answered an unexpected body: {_brief(payload)}"
            ) from exc
        if answer.resources_session_id != self.session_id:
            raise self._failure(
                FailureKind.SEED_FAILED, f"seed answered for another session id {answer.resources_session_id!r}"
            )
        logger.debug("session %s seeded on %s at %s", self.session_id, self._server.url, self.initial_url)

    async def close(self) -> None:
        """Release the browser. Idempotent; never raises (a failed close is logged)."""
        if self.closed:
            return
        self.closed = True
        body = _CloseRequest(resources_session_id=self.session_id, episode_id=self._episode).model_dump()
        try:
            # Closing is idempotent and the server has no TTL (a close given up on leaves its browser open for
            # good), so a close that times out or answers 5xx is tried again, each try for close_timeout_s, until
            # _CLOSE_TRIES times close_timeout_s have passed. A busy server can take longer than one try to close
            # a browser; it finishes the first close anyway, and the next try then answers at once.
            give_up_at = time.monotonic() + _CLOSE_TRIES * self._config.close_timeout_s
            attempt = 0
            while True:
                try:
                    status, payload = await self._post(
                        "/close_session",
                        body,
                        timeout_s=max(0.1, min(self._config.close_timeout_s, give_up_at - time.monotonic())),
                        retry=True,
                        call_kind=FailureKind.SERVER_ERROR,
                    )
                except EnvironmentFailure as failure:
                    pause = min(self._config.retry_backoff_s * (2**attempt), _CLOSE_BACKOFF_CAP_S)
                    attempt += 1
                    retried = failure.kind in (FailureKind.SERVER_ERROR, FailureKind.TIMEOUT)
                    if retried and time.monotonic() + pause < give_up_at:
                        await asyncio.sleep(pause)
                        continue
                    logger.warning("session %s: close failed, the browser may stay open: %s", self.session_id, failure)
                    break
                if status != 200:
                    logger.warning("session %s: close answered HTTP %s: %s", self.session_id, status, _brief(payload))
                break
        except BaseException:
            logger.warning("session %s: close interrupted, the browser may stay open", self.session_id)
            raise
        finally:
            if self._http is not None:
                http, self._http = self._http, None
                await http.close()

    async def is_released(self) -> bool:
        """After :meth:`close`: ask the server, with this session's cookie, whether it still holds the browser.

        A diagnostic for smoke checks and tests (a released session answers "no active session").
        """
        if not self.closed:
            return False
        async with aiohttp.ClientSession(
            connector=self._client._pool(), connector_owner=False, cookie_jar=self._jar
        ) as http:
            timeout = aiohttp.ClientTimeout(total=self._config.close_timeout_s)
            async with http.post(f"{self._server.url}/{BROWSER_OBSERVE}", json={}, timeout=timeout) as response:
                payload = await response.json(content_type=None)
        return isinstance(payload, dict) and payload.get("error") == NO_SESSION_ERROR

    # ----- tools ----------------------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: Mapping[str, Any] | None = None) -> ToolResult:
        """Run one browser tool. Policy mistakes come back in ``ToolResult.error``; infrastructure raises."""
        if tool not in TOOL_NAMES:
            raise ValueError(f"unknown browser tool {tool!r}; expected one of {TOOL_NAMES}")
        if self.closed:
            raise self._failure(FailureKind.SESSION_LOST, f"{tool} called after the session was closed")
        status, payload = await self._post(
            f"/{tool}",
            dict(arguments or {}),
            timeout_s=self._config.call_timeout_s,
            retry=tool in IDEMPOTENT_TOOLS,
            call_kind=FailureKind.SERVER_ERROR,
        )
        if status == 422:
            return ToolResult(observation="", error=f"invalid arguments for {tool}: {_validation_message(payload)}")
        if status != 200:
            raise self._failure(FailureKind.SERVER_ERROR, f"/{tool} answered HTTP {status}: {_brief(payload)}")
        try:
            answer = _ToolAnswer.model_validate(payload)
        except ValidationError as exc:
            raise self._failure(FailureKind.SERVER_ERROR, f"/{tool} answered an unexpected body") from exc
        lost = lost_session_reason(tool, arguments or {}, answer.error) if answer.error else None
        if lost is not None:
            raise self._failure(FailureKind.SESSION_LOST, _brief(lost))
        return ToolResult(observation=answer.observation, done=answer.done, error=answer.error)

    async def observe(self) -> ToolResult:
        return await self.call(BROWSER_OBSERVE, {})

    async def navigate(self, url: str) -> ToolResult:
        return await self.call(BROWSER_NAVIGATE, {"url": url})

    async def click(self, element_id: int) -> ToolResult:
        return await self.call(BROWSER_CLICK, {"element_id": element_id})

    async def type(self, element_id: int, text: str) -> ToolResult:
        return await self.call(BROWSER_TYPE, {"element_id": element_id, "text": text})

    async def finish(self, answer: str) -> ToolResult:
        return await self.call(BROWSER_FINISH, {"answer": answer})

    async def verify(self) -> VerifyResult:
        """Grade the episode against the seed-time ``verifier_metadata``. The server releases the browser.

        Raises ``verify_unavailable`` (or ``session_lost`` when the server no longer holds the session) whenever
        the server could not grade: a ``failure_reason``, ``mask_sample: true``, a 5xx, a timeout, a rejected body.
        Never a 0.
        """
        if not self.verifier_metadata:
            raise ValueError("this task has no verifier_metadata: score it with the judge, not /verify")
        status, payload = await self._post(
            "/verify",
            _verify_body(self._episode.rollout_id),
            timeout_s=self._config.verify_timeout_s,
            retry=False,
            call_kind=FailureKind.VERIFY_UNAVAILABLE,
        )
        if status != 200:
            raise self._failure(
                FailureKind.VERIFY_UNAVAILABLE, f"verify rejected (HTTP {status}): {_validation_message(payload)}"
            )
        try:
            answer = _VerifyAnswer.model_validate(payload)
        except ValidationError as exc:
            raise self._failure(FailureKind.VERIFY_UNAVAILABLE, "verify answered without a reward") from exc
        if answer.failure_reason:
            kind = (
                FailureKind.SESSION_LOST
                if answer.failure_reason.strip() == _VERIFY_SESSION_NOT_FOUND
                else FailureKind.VERIFY_UNAVAILABLE
            )
            raise self._failure(kind, f"verify could not grade: {_brief(answer.failure_reason)}")
        if answer.mask_sample:
            # Gym's own "do not train on this" (its reward-model servers answer a failed judge this way, reward 0.0
            # beside it): the grade did not happen, whatever the reward field says.
            raise self._failure(FailureKind.VERIFY_UNAVAILABLE, "verify said not to train on it (mask_sample)")
        try:
            reward = checked_reward(answer.reward)
        except MalformedAnswer as exc:
            raise self._failure(FailureKind.VERIFY_UNAVAILABLE, f"verify answered {exc}") from exc
        return VerifyResult(reward=reward, raw=payload)


def _validation_message(payload: Any) -> str:
    """Condense FastAPI's 422 body (``{"detail": [{"loc": [...], "msg": ...}]}``) into one line for the model."""
    if isinstance(payload, dict) and isinstance(payload.get("detail"), list):
        parts = []
        for item in payload["detail"]:
            if isinstance(item, dict):
                path = item.get("loc") if isinstance(item.get("loc"), list) else []
                loc = ".".join(str(p) for p in path if p != "body")
                parts.append(f"{loc or 'body'}: {item.get('msg', 'invalid')}")
        if parts:
            return "; ".join(parts)
    return _brief(payload)


def _safe_rollout_id(rollout_id: str) -> str:
    """Fit any caller id into the server's ``rollout_id`` pattern: safe characters, no reserved ``-a<N>`` suffix."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", rollout_id) or "rollout"
    if not cleaned[0].isalnum():
        cleaned = "r" + cleaned
    if re.search(r"-a[1-9][0-9]*$", cleaned):
        cleaned += "_"
    return cleaned


def parse_observation(observation: str | None) -> tuple[str | None, str | None, str | None]:
    """``(url, title, text)`` of a NeMo Gym observation (``URL:``/``TITLE:``/``ELEMENTS:``/``TEXT:`` sections)."""
    if not observation:
        return None, None, None
    url = re.search(r"^URL: ?(.*)$", observation, flags=re.MULTILINE)
    title = re.search(r"^TITLE: ?(.*)$", observation, flags=re.MULTILINE)
    text = re.search(r"^TEXT:(.*)\Z", observation, flags=re.MULTILINE | re.DOTALL)
    return (
        url.group(1).strip() if url else None,
        title.group(1).strip() if title else None,
        " ".join(text.group(1).split()) if text else None,
    )
