"""A fault-injecting HTTP proxy on 127.0.0.1, for putting a real environment server through chaos.

Contract: :class:`FaultProxy` sits between the client and any HTTP server (the real ``interactive_browser`` or the
fake) and makes the server look as if it misbehaved without touching it: :meth:`FaultProxy.stop` /
:meth:`FaultProxy.start` close the port and cut every connection, then open it again (a killed and restarted
process, as the client sees it); a rule (:meth:`FaultProxy.set_rule`) chooses a
:class:`~nemo_gym_browser.local.faults.kinds.Fault` per request from a
:class:`~nemo_gym_browser.local.faults.kinds.SeenRequest` (the endpoint, the session from the typed body or the
session cookie, and its task).

Errors: a fault that needs the inside of the server (``crash_browser``) is refused: :meth:`FaultProxy.check`
raises a ``ValueError`` naming it; a rule that answers one anyway gets its request answered 500 (logged, never
forwarded). Bookkeeping: :attr:`FaultProxy.log` (every request, its fault, the status the client got) and
:attr:`FaultProxy.open_session_ids`. Everything binds 127.0.0.1; every upstream call has a timeout. How each kind
plays through the proxy: ``docs/failures.md#injected-faults``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie

import aiohttp
from aiohttp import web

from ..loopback import LoopbackServer
from .kinds import Fault, FaultKind, Rule, SeenRequest, canned_answer, drop_connection, hold, with_reward

logger = logging.getLogger(__name__)

# Headers that belong to one hop (RFC 9110 7.6.1) or that aiohttp recomputes for the body it sends.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Endpoints whose successful answer releases the browser (the server forgets the session's browser).
_RELEASING = frozenset({"verify", "close_session"})
# The fault kinds a proxy cannot carry out, and why: they need to reach inside the server.
_NEEDS_THE_SERVER: dict[FaultKind, str] = {
    "crash_browser": "the browser lives inside the server, out of a proxy's reach "
    "(inject it into a InProcessEnvironmentServer instead)",
}


@dataclass(frozen=True)
class LogEntry:
    request: SeenRequest
    fault: FaultKind | None
    status: int | None  # what the client got; None when it got no answer (dropped, cut off, upstream down)
    finished_at: float


def session_id_from_cookie(cookie_header: str | None) -> str | None:
    """The ``session_id`` a Starlette-style session cookie carries (base64 JSON before the first dot), if any."""
    if not cookie_header:
        return None
    try:
        cookies = SimpleCookie(cookie_header)
    except CookieError:
        return None
    for morsel in cookies.values():
        head = morsel.value.split(".", 1)[0]
        padded = head + "=" * (-len(head) % 4)
        for decode in (base64.urlsafe_b64decode, base64.b64decode):
            try:
                payload = json.loads(decode(padded))
            except (binascii.Error, ValueError):
                continue
            if isinstance(payload, dict) and isinstance(payload.get("session_id"), str):
                return payload["session_id"]
    return None


def _json_object(body: bytes) -> dict | None:
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _typed_session_id(body: bytes) -> str | None:
    payload = _json_object(body) or {}
    session_id = payload.get("resources_session_id")
    return session_id if isinstance(session_id, str) else None


def _typed_task_id(body: bytes) -> str | None:
    """``task_id.task_id`` of a typed seed body."""
    task = (_json_object(body) or {}).get("task_id")
    task_id = task.get("task_id") if isinstance(task, dict) else None
    return task_id if isinstance(task_id, str) else None


class FaultProxy(LoopbackServer):
    """An HTTP/1.1 reverse proxy from ``127.0.0.1:<port>`` to ``upstream``, with faults on demand (see module doc).

    ``upstream_timeout_s`` bounds every forwarded call; ``port`` 0 picks a free port, kept across restarts.
    Lifetime (:class:`~nemo_gym_browser.local.loopback.LoopbackServer`): ``start`` opens the upstream connection
    pool and listens, ``stop`` cuts every connection and keeps the pool, ``close`` (and leaving ``async with``) stops
    and releases the pool.
    """

    description = "the fault proxy"

    def __init__(self, upstream: str, *, port: int = 0, upstream_timeout_s: float = 300.0) -> None:
        super().__init__(port=port)
        self.upstream = upstream.rstrip("/")
        self.upstream_timeout_s = upstream_timeout_s
        self.log: list[LogEntry] = []
        self._rule: Rule | None = None
        self._open: dict[str, float] = {}  # session id -> time its seed succeeded
        self._tasks: dict[str, str] = {}  # session id -> task id, from its seed (kept: a few dozen bytes a session)
        self._client: aiohttp.ClientSession | None = None

    # ----- lifetime --------------------------------------------------------------------------------------------

    def _application(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self._handle)
        return app

    async def start(self) -> None:
        """Open the upstream connection pool if need be, then listen (again, on the same port after a stop).
        Idempotent."""
        if self._client is None:
            self._client = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),  # cookies pass through as headers, never stored here
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=10.0),
            )
        await super().start()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def close(self) -> None:
        """Stop and release the upstream connection pool."""
        await self.stop()
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    # ----- faults and bookkeeping --------------------------------------------------------------------------------

    def set_rule(self, rule: Rule | None) -> None:
        """Consult ``rule`` for every request from now on (None: forward everything untouched)."""
        self._rule = rule

    @staticmethod
    def check(fault: Fault) -> Fault:
        """``fault`` if a proxy can carry it out; otherwise a ``ValueError`` naming the fault and why not."""
        why = _NEEDS_THE_SERVER.get(fault.kind)
        if why is not None:
            raise ValueError(f"the fault proxy cannot inject a {fault.kind!r} fault: {why}")
        return fault

    @property
    def open_session_ids(self) -> tuple[str, ...]:
        return tuple(self._open)

    def forget_sessions(self) -> None:
        """Drop the open-session bookkeeping (after the upstream was restarted and lost every browser)."""
        self._open.clear()

    # ----- one request -----------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        endpoint = request.path.lstrip("/")
        session_id = None
        if endpoint in ("seed_session", "close_session"):
            session_id = _typed_session_id(body)
        if session_id is None:
            session_id = session_id_from_cookie(request.headers.get("Cookie"))
        if endpoint == "seed_session" and session_id is not None:
            task_id = _typed_task_id(body)
            if task_id is not None:
                self._tasks[session_id] = task_id
        proxied = SeenRequest(
            endpoint=endpoint,
            session_id=session_id,
            received_at=time.monotonic(),
            task_id=self._tasks.get(session_id) if session_id is not None else None,
        )
        fault = self._rule(proxied) if self._rule is not None else None
        status: int | None = None
        try:
            response = self._refusal(fault, proxied) or await self._apply(request, body, proxied, fault)
            status = response.status
            return response
        finally:
            self.log.append(LogEntry(proxied, fault.kind if fault else None, status, time.monotonic()))
            if status == 200 and session_id is not None:
                if endpoint == "seed_session" and (fault is None or fault.kind != "lose_session"):
                    self._open.setdefault(session_id, proxied.received_at)
                elif endpoint in _RELEASING:
                    self._open.pop(session_id, None)

    def _refusal(self, fault: Fault | None, proxied: SeenRequest) -> web.Response | None:
        """The 500 a request gets when its rule chose a fault the proxy cannot do (the error logged), else None."""
        if fault is None:
            return None
        try:
            self.check(fault)
        except ValueError as exc:
            logger.error("fault proxy: %s (%s, session %s)", exc, proxied.endpoint, proxied.session_id)
            return web.Response(status=500, text=json.dumps(repr(exc)), content_type="application/json")
        return None

    async def _apply(
        self, request: web.Request, body: bytes, proxied: SeenRequest, fault: Fault | None
    ) -> web.StreamResponse:
        """Carry out ``fault`` (None: forward untouched)."""
        if fault is not None:
            logger.info("fault proxy: %s on %s (session %s)", fault.kind, proxied.endpoint, proxied.session_id)
        if fault is not None and fault.kind == "status":
            return canned_answer(fault)
        if fault is not None and fault.kind == "drop":
            await drop_connection(request, fault)
        if fault is not None and fault.kind == "hang":
            await hold(fault)
        strip_cookie = fault is not None and fault.kind == "lose_session"
        regrade = fault.reward if fault is not None and fault.kind == "regrade" else None
        return await self._forward(request, body, strip_cookie=strip_cookie, regrade=regrade)

    async def _forward(
        self, request: web.Request, body: bytes, *, strip_cookie: bool, regrade: float | None = None
    ) -> web.StreamResponse:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        if strip_cookie:
            headers.pop("Cookie", None)
            headers.pop("cookie", None)
        try:
            async with self._client.request(
                request.method,
                f"{self.upstream}{request.path_qs}",
                data=body or None,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.upstream_timeout_s),
            ) as upstream:
                payload = await upstream.read()
                if regrade is not None and upstream.status == 200:
                    payload = with_reward(payload, regrade)
                answer = web.Response(status=upstream.status, body=payload)
                for name, value in upstream.headers.items():
                    lowered = name.lower()
                    if lowered in _HOP_HEADERS or (strip_cookie and lowered == "set-cookie"):
                        continue
                    answer.headers.add(name, value)
                return answer
        except (TimeoutError, aiohttp.ClientError) as exc:
            # What a reverse proxy says when the server behind it is gone or silent.
            logger.info("fault proxy: upstream %s failed for %s: %s", self.upstream, request.path, type(exc).__name__)
            text = json.dumps(f"bad gateway: {type(exc).__name__}")
            return web.Response(status=502, text=text, content_type="application/json")


def fault_counts(log: list[LogEntry]) -> dict[str, int]:
    """How many requests each fault kind hit (for reports)."""
    counts: dict[str, int] = {}
    for entry in log:
        if entry.fault is not None:
            counts[entry.fault] = counts.get(entry.fault, 0) + 1
    return counts


__all__ = ["FaultProxy", "LogEntry", "fault_counts", "session_id_from_cookie"]
