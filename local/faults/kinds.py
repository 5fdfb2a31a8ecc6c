"""One vocabulary of injected faults, for the in-process environment server and the fault proxy alike.

A :class:`Fault` is a value: what happens to one request instead of (or on the way to) its normal answer. Kinds:
``status`` (answer ``http_status`` with ``body``, never handled), ``hang`` (hold the request ``seconds``, at most
:data:`HANG_LIMIT_S`, then handle it unless the client gave up), ``drop`` (status, headers and ``partial_body``, then
abort the connection), ``lose_session`` (the server no longer knows the request's session), ``crash_browser`` (the
session's browser dies; the fake server only) and ``regrade`` (a 200 answer's ``reward`` replaced; the server still
grades and releases the browser).

Two places interpret it: :class:`~nemo_gym_browser.local.environment_server.server.InProcessEnvironmentServer` does
every kind from inside; :class:`~nemo_gym_browser.local.faults.proxy.FaultProxy`, in front of any server, refuses
``crash_browser`` with a ``ValueError`` naming the fault and why. A :data:`Rule` chooses a fault per request from a
:class:`SeenRequest`; the helpers at the bottom carry out the kinds that need nothing of a server, so both
interpreters do them alike. Each kind in both places: ``docs/failures.md#injected-faults``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, get_args

from aiohttp import web

FaultKind = Literal["status", "hang", "drop", "lose_session", "crash_browser", "regrade"]
KINDS: tuple[FaultKind, ...] = get_args(FaultKind)

# Longest a hold may last when nobody cuts it (a test that forgot to): well above any client timeout used here.
HANG_LIMIT_S = 600.0
# What a dropped answer gets out before the cut: the start of an observation, so the client sees JSON cut short.
_PARTIAL_OBSERVATION = b'{"observation": "URL: '
_MALFORMED_OBSERVATION = b'{"observation": "URL: about:blank\\nTITLE'
# Promised beyond the partial body, so the client reads the payload as cut short rather than complete.
_MISSING_BYTES = 64
# A chunked canned answer is sent in pieces of this size.
_CHUNK_BYTES = 64 * 1024


def goto_call_log(action: str, url: str) -> str:
    """A Playwright ``Page.goto`` error message: ``action`` and the call log of a navigation to ``url``."""
    return f'{action}\nCall log:\n  - navigating to "{url}", waiting until "domcontentloaded"\n'


@dataclass(frozen=True)
class Fault:
    """What happens to one request (see the module doc for each ``kind``); build one with the factories below.

    Only the fields of its kind matter: ``http_status``, ``body``, ``content_type`` and ``chunked`` for ``status`` (and
    ``http_status`` for the headers of a ``drop``), ``seconds`` for ``hang``, ``partial_body`` for ``drop``,
    ``reward`` for ``regrade``.
    """

    kind: FaultKind
    http_status: int = 500
    body: bytes = b""
    content_type: str = "application/json"
    seconds: float = 0.0
    partial_body: bytes | None = None
    reward: float = 0.0
    chunked: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {list(KINDS)}")
        if not 100 <= self.http_status <= 599:
            raise ValueError(f"{self.kind} fault: HTTP status {self.http_status} is not in 100..599")
        if self.seconds < 0:
            raise ValueError(f"{self.kind} fault: seconds must not be negative, not {self.seconds}")

    @staticmethod
    def status(status: int = 500, body: object = None, content_type: str = "application/json") -> Fault:
        """Answer ``status`` (5xx, or anything) with ``body``: bytes/str as is, otherwise JSON-encoded.

        The default body is what nemo_gym's exception middleware sends for an exception: ``repr`` as a JSON string.
        """
        if body is None:
            body = json.dumps(repr(RuntimeError(f"injected fault: HTTP {status}")))
        if not isinstance(body, (str, bytes)):
            body = json.dumps(body)
        encoded = body.encode() if isinstance(body, str) else body
        return Fault("status", http_status=status, body=encoded, content_type=content_type)

    @staticmethod
    def respond(body: object, status: int = 200) -> Fault:
        """Answer ``status`` with this JSON body (for example a seed answer without ``resources_session_id``)."""
        return Fault.status(status, json.dumps(body))

    @staticmethod
    def fail_seed(url: str = "http://unreachable.invalid/") -> Fault:
        """The 500 a seed gets when the start page fails to load (no browser is left open): the ``repr`` of
        Playwright's ``Error`` as a JSON string, as the real server sends it."""
        message = goto_call_log(f"Page.goto: net::ERR_NAME_NOT_RESOLVED at {url}", url)
        return Fault.status(500, json.dumps(f"Error({message!r})"))

    @staticmethod
    def malformed_json(body: bytes = _MALFORMED_OBSERVATION, status: int = 200) -> Fault:
        """Answer ``status`` with a complete HTTP response whose JSON body does not parse."""
        return Fault("status", http_status=status, body=body)

    @staticmethod
    def invalid_utf8(status: int = 200) -> Fault:
        """Answer ``status`` with a JSON tool answer whose observation holds bytes that are not UTF-8."""
        return Fault("status", http_status=status, body=b'{"observation": "URL: \xff\xfe\xc3(", "done": false}')

    @staticmethod
    def deep_json(depth: int, status: int = 200) -> Fault:
        """Answer ``status`` with well-formed JSON: an object whose ``observation`` is ``depth`` nested lists."""
        return Fault("status", http_status=status, body=b'{"observation": ' + b"[" * depth + b"]" * depth + b"}")

    @staticmethod
    def oversized(size: int, *, chunked: bool = False, status: int = 200) -> Fault:
        """Answer ``status`` with a well-formed JSON tool answer of ``size`` bytes (``chunked``: no Content-Length)."""
        head, tail = b'{"observation": "', b'", "done": false, "error": null}'
        body = head + b"x" * max(size - len(head) - len(tail), 0) + tail
        return Fault("status", http_status=status, body=body, chunked=chunked)

    @staticmethod
    def hang(seconds: float = HANG_LIMIT_S) -> Fault:
        """Hold the request ``seconds``, then handle it; a client that gives up first cuts it (default: until then)."""
        return Fault("hang", seconds=seconds)

    @staticmethod
    def drop_connection(partial_body: bytes | None = _PARTIAL_OBSERVATION) -> Fault:
        """Send a 200's headers and ``partial_body``, then abort the connection (None: abort before any byte)."""
        return Fault("drop", http_status=200, partial_body=partial_body)

    @staticmethod
    def lose_session() -> Fault:
        """The server no longer knows the request's session (as after a restart); then the request is handled."""
        return Fault("lose_session")

    @staticmethod
    def crash_browser() -> Fault:
        """Kill the session's browser, then handle the request: page calls fail, verify cannot grade."""
        return Fault("crash_browser")

    @staticmethod
    def regrade(reward: float) -> Fault:
        """Handle the request; a 200 answer carrying a ``reward`` reaches the client with ``reward`` in its place."""
        return Fault("regrade", reward=reward)


@dataclass(frozen=True)
class SeenRequest:
    """What a rule may look at."""

    endpoint: str  # the path without its leading slash, e.g. "browser_click"
    session_id: str | None
    received_at: float  # time.monotonic() when the rule was asked
    task_id: str | None = None  # the task the session was seeded for (the typed seed's task_id), when known


Rule = Callable[[SeenRequest], Fault | None]


# ----- carrying out the kinds that need nothing of a server ----------------------------------------------------


def canned_answer(fault: Fault) -> web.Response:
    """The answer of a ``status`` fault (a ``chunked`` one streams its body without declaring its length)."""
    if not fault.chunked:
        return web.Response(status=fault.http_status, body=fault.body, content_type=fault.content_type)

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(fault.body), _CHUNK_BYTES):
            yield fault.body[start : start + _CHUNK_BYTES]

    return web.Response(status=fault.http_status, body=pieces(), content_type=fault.content_type)


async def hold(fault: Fault) -> None:
    """Wait out a ``hang`` fault. Handlers are cancelled when their client goes away, which ends the hold early."""
    await asyncio.sleep(min(fault.seconds, HANG_LIMIT_S))


async def drop_connection(request: web.Request, fault: Fault) -> NoReturn:
    """Carry out a ``drop`` fault on ``request``: headers and the partial body if any, then abort the connection."""
    if fault.partial_body is not None:
        response = web.StreamResponse(status=fault.http_status, headers={"Content-Type": "application/json"})
        response.content_length = len(fault.partial_body) + _MISSING_BYTES
        await response.prepare(request)
        await response.write(fault.partial_body)
        await asyncio.sleep(0)  # let the partial bytes reach the socket before the cut
    if request.transport is not None:
        request.transport.abort()
    # No answer is left to send: end the handler the way a client disconnect does.
    raise asyncio.CancelledError


def with_reward(payload: bytes, reward: float) -> bytes:
    """``payload`` (a JSON object with a ``reward``) with ``reward`` replaced; anything else unchanged."""
    try:
        answer = json.loads(payload)
    except ValueError:
        return payload
    if not isinstance(answer, dict) or "reward" not in answer:
        return payload
    return json.dumps({**answer, "reward": reward}).encode()


__all__ = [
    "HANG_LIMIT_S",
    "KINDS",
    "Fault",
    "FaultKind",
    "Rule",
    "SeenRequest",
    "canned_answer",
    "drop_connection",
    "goto_call_log",
    "hold",
    "with_reward",
]
