"""A fault-injecting HTTP proxy on 127.0.0.1, for putting a real environment server through chaos.

The fake environment server injects its own faults; the real NeMo Gym server cannot. This proxy sits between the
client and any HTTP server (the real ``interactive_browser``, or the fake) and makes the server look as if it
misbehaved, without touching the server:

- :meth:`FaultProxy.stop` / :meth:`FaultProxy.start`: the port closes (connection refused) and every open
  connection is cut, then the port opens again: what a client sees of a server process killed and restarted.
  (Pair it with restarting the upstream itself, which is what loses the sessions.)
- per request, a rule (:meth:`FaultProxy.set_rule`) may choose a :class:`ProxyFault`:
  ``status(503)`` answers a 5xx without forwarding; ``hang(s)`` holds the request (a client that gives up cuts
  it, and it is then never forwarded); ``drop()`` aborts the connection without answering; ``lose_session()``
  forwards the request without its session cookie and strips the cookie the answer sets, so the server serves a
  session it does not know, as after a restart; ``regrade(r)`` forwards a ``/verify`` and hands the client the
  server's own answer with its ``reward`` replaced by ``r`` (a planted grade, so a test can fix a group's scores;
  the server still grades and releases the browser as usual).

Rules see a :class:`ProxiedRequest`: the endpoint and the ``interactive_browser`` session it belongs to (the
typed ``resources_session_id`` of a seed or close body, otherwise the id carried by the Starlette session cookie;
both the real server's and the fake's cookies carry ``{"session_id": ...}`` as base64 JSON before the first dot),
and the task that session was seeded for (the typed seed's ``task_id``).

Bookkeeping: :attr:`FaultProxy.log` lists every request with the fault applied to it and the status the client
got; :attr:`FaultProxy.open_session_ids` are the sessions whose seed succeeded through the proxy and that no
successful verify or close has released since. Everything binds 127.0.0.1; every upstream call has a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie

import aiohttp
from aiohttp import web

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
# A stopped proxy should not wait for requests it is cutting off anyway.
_SHUTDOWN_TIMEOUT_S = 0.05
# Longest a hold may last when nobody cuts it (a test that forgot to): well above any client timeout used here.
_HANG_LIMIT_S = 600.0


@dataclass(frozen=True)
class ProxyFault:
    """What the proxy does to one request instead of (or on the way to) forwarding it."""

    kind: str  # "status", "hang", "drop", "lose_session", "regrade"
    status: int = 503
    seconds: float = 0.0
    reward: float = 0.0

    @staticmethod
    def status_code(status: int = 503) -> ProxyFault:
        """Answer ``status`` with a nemo_gym-style body (an exception repr as a JSON string); never forwarded."""
        return ProxyFault("status", status=status)

    @staticmethod
    def hang(seconds: float = _HANG_LIMIT_S) -> ProxyFault:
        """Hold the request for ``seconds`` (then forward it); a client that times out first cuts it."""
        return ProxyFault("hang", seconds=seconds)

    @staticmethod
    def drop() -> ProxyFault:
        """Abort the connection without answering; the request is never forwarded."""
        return ProxyFault("drop")

    @staticmethod
    def lose_session() -> ProxyFault:
        """Forward without the session cookie and strip the one the answer sets: the server no longer knows it."""
        return ProxyFault("lose_session")

    @staticmethod
    def regrade(reward: float) -> ProxyFault:
        """Forward; a 200 answer carrying a ``reward`` reaches the client with ``reward`` in its place."""
        return ProxyFault("regrade", reward=reward)


@dataclass(frozen=True)
class ProxiedRequest:
    """What a rule may look at."""

    endpoint: str  # the path without its leading slash, e.g. "browser_click"
    session_id: str | None
    received_at: float  # time.monotonic()
    task_id: str | None = None  # the task the session was seeded for (the typed seed's task_id), when known


@dataclass(frozen=True)
class LogEntry:
    request: ProxiedRequest
    fault: str | None
    status: int | None  # what the client got; None when it got no answer (dropped, cut off, upstream down)
    finished_at: float


Rule = Callable[[ProxiedRequest], ProxyFault | None]


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


class FaultProxy:
    """An HTTP/1.1 reverse proxy from ``127.0.0.1:<port>`` to ``upstream``, with faults on demand (see module doc).

    ``upstream_timeout_s`` bounds every forwarded call; ``port`` 0 picks a free port, kept across restarts.
    """

    def __init__(self, upstream: str, *, port: int = 0, upstream_timeout_s: float = 300.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.upstream_timeout_s = upstream_timeout_s
        self.log: list[LogEntry] = []
        self._rule: Rule | None = None
        self._open: dict[str, float] = {}  # session id -> time its seed succeeded
        self._tasks: dict[str, str] = {}  # session id -> task id, from its seed (kept: a few dozen bytes a session)
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    # ----- lifetime --------------------------------------------------------------------------------------------

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the fault proxy has not been started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        """Listen (again, on the same port after a stop). Idempotent."""
        if self._runner is not None:
            return
        if self._client is None:
            self._client = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),  # cookies pass through as headers, never stored here
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=10.0),
            )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        logger.debug("fault proxy %s -> %s", self.url, self.upstream)

    async def stop(self) -> None:
        """Close the port and cut every open connection, requests in flight included. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            await asyncio.sleep(0.01)  # let clients on this loop see the cut before they reuse a pooled connection

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
        proxied = ProxiedRequest(
            endpoint=endpoint,
            session_id=session_id,
            received_at=time.monotonic(),
            task_id=self._tasks.get(session_id) if session_id is not None else None,
        )
        fault = self._rule(proxied) if self._rule is not None else None
        status: int | None = None
        try:
            response = await self._apply(request, body, proxied, fault)
            status = response.status
            return response
        finally:
            self.log.append(LogEntry(proxied, fault.kind if fault else None, status, time.monotonic()))
            if status == 200 and session_id is not None:
                if endpoint == "seed_session" and (fault is None or fault.kind != "lose_session"):
                    self._open.setdefault(session_id, proxied.received_at)
                elif endpoint in _RELEASING:
                    self._open.pop(session_id, None)

    async def _apply(
        self, request: web.Request, body: bytes, proxied: ProxiedRequest, fault: ProxyFault | None
    ) -> web.StreamResponse:
        if fault is not None:
            logger.info("fault proxy: %s on %s (session %s)", fault.kind, proxied.endpoint, proxied.session_id)
        if fault is not None and fault.kind == "status":
            text = json.dumps(repr(RuntimeError(f"injected by the fault proxy: HTTP {fault.status}")))
            return web.Response(status=fault.status, text=text, content_type="application/json")
        if fault is not None and fault.kind == "drop":
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # no response left to send: end the handler as a disconnect does
        if fault is not None and fault.kind == "hang":
            await asyncio.sleep(min(fault.seconds, _HANG_LIMIT_S))
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
                    payload = _with_reward(payload, regrade)
                answer = web.Response(status=upstream.status, body=payload)
                for name, value in upstream.headers.items():
                    lowered = name.lower()
                    if lowered in _HOP_HEADERS or (strip_cookie and lowered == "set-cookie"):
                        continue
                    answer.headers.add(name, value)
                return answer
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # What a reverse proxy says when the server behind it is gone or silent.
            logger.info("fault proxy: upstream %s failed for %s: %s", self.upstream, request.path, type(exc).__name__)
            text = json.dumps(f"bad gateway: {type(exc).__name__}")
            return web.Response(status=502, text=text, content_type="application/json")


def _with_reward(payload: bytes, reward: float) -> bytes:
    """``payload`` (a JSON object with a ``reward``) with ``reward`` replaced; anything else unchanged."""
    try:
        answer = json.loads(payload)
    except ValueError:
        return payload
    if not isinstance(answer, dict) or "reward" not in answer:
        return payload
    return json.dumps({**answer, "reward": reward}).encode()


def fault_counts(log: list[LogEntry]) -> dict[str, int]:
    """How many requests each fault kind hit (for reports)."""
    counts: dict[str, int] = {}
    for entry in log:
        if entry.fault is not None:
            counts[entry.fault] = counts.get(entry.fault, 0) + 1
    return counts


__all__ = ["FaultProxy", "LogEntry", "ProxiedRequest", "ProxyFault", "Rule", "fault_counts", "session_id_from_cookie"]
