"""An in-process model of NeMo Gym 0.7.0's ``interactive_browser`` resources server, with faults on demand.

Contract: :class:`InProcessEnvironmentServer` speaks the real server's wire contract as far as a client can observe
it (the cookie session, the typed and legacy seed, the five tools with their 200-with-error and 422 answers, verify
and close, the health paths), with a small in-memory site in place of the browser. Every fact it keeps, and what it
does not model: ``docs/rehearsal-and-cpu-training.md#the-in-process-environment-server``. This module is the HTTP
server (dispatch, handlers, fault application, bookkeeping); :mod:`.wire` the bodies, 422s and cookie;
:mod:`.sessions` the session table and grading; :mod:`.site_model` the pages, the browser and the rendering.

Faults, deterministic: :meth:`~InProcessEnvironmentServer.inject` and :meth:`~InProcessEnvironmentServer.set_rule`
take every :class:`~nemo_gym_browser.local.faults.kinds.Fault` kind; ``stop``/``start``, ``restart``,
``lose_session``, ``crash_browser`` and ``latency_s`` add the rest. Lifetimes for leak tests:
:meth:`~InProcessEnvironmentServer.events`, :attr:`~InProcessEnvironmentServer.open_sessions`,
:attr:`~InProcessEnvironmentServer.orphaned_browsers`. Example::

    async with InProcessEnvironmentServer() as server:
        server.inject("browser_click", Fault.status(503), on_call=2)
        ...  # drive http://127.0.0.1:<port> with CookieJar(unsafe=True)
        assert server.open_sessions == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from ...gym_contract.browser_calls import (
    BROWSER_CLICK,
    BROWSER_FINISH,
    BROWSER_NAVIGATE,
    BROWSER_OBSERVE,
    BROWSER_TYPE,
    NATIVE_TOOL_ACTIONS,
)
from ..background_loop import BackgroundLoop
from ..faults.kinds import Fault, Rule, SeenRequest, canned_answer, drop_connection, hold, with_reward
from ..loopback import LoopbackServer
from .sessions import SessionTable
from .site_model import DEFAULT_MAX_ELEMENTS, Browser, Site
from .wire import (
    CLOSE_BODY,
    COOKIE_NAME,
    ELEMENT_BODY,
    FINISH_BODY,
    NAVIGATE_BODY,
    SEED_BODY,
    SESSION_ID_KEY,
    TYPE_BODY,
    VERIFY_BODY,
    CookieCodec,
    ResourcesCloseSessionRequest,
    ResourcesSeedSessionRequest,
    Unprocessable,
    json_response,
    jsonable,
    parse_body,
)

logger = logging.getLogger(__name__)

__all__ = ["FaultRule", "InProcessEnvironmentServer", "ThreadedEnvironmentServer"]

# uvicorn's keep-alive as nemo_gym configures it: clients must keep theirs below it.
_SERVER_KEEPALIVE_S = 30.0
# uvicorn sets no body limit; aiohttp's default (1 MiB) would turn a long rollout's verify body into a 413.
_MAX_REQUEST_BYTES = 256 * 1024 * 1024
_LIVENESS_PATHS = frozenset({"/", "/health", "/healthz", "/livez", "/readyz"})


# ----------------------------------------------------------------------------------------------------------------
# Calls and injected faults
# ----------------------------------------------------------------------------------------------------------------

# Endpoint name -> event name in the per-session log.
_ENDPOINTS: Mapping[str, str] = {
    "seed_session": "seed",
    "close_session": "close",
    "verify": "verify",
    **NATIVE_TOOL_ACTIONS,
}

_Model = TypeVar("_Model")


@dataclass
class _Call:
    """One request as the server sees it: endpoint, raw body, and the cookie session (mutated by handlers)."""

    endpoint: str
    raw: bytes
    content_type: str | None
    cookie_session: dict[str, str]
    had_cookie_session: bool
    session_id: str = ""
    parsed: Any = None

    @property
    def cookie_session_id(self) -> str:
        return self.cookie_session[SESSION_ID_KEY]

    def body(self, adapter: TypeAdapter[_Model], *, required: bool) -> _Model:
        return parse_body(self.raw, self.content_type, adapter, required=required)


@dataclass
class FaultRule:
    """One injected fault. Counts its own matching calls; ``fired`` says how often it acted."""

    endpoint: str
    fault: Fault
    on_call: int | None = None
    times: int | None = None
    session_id: str | None = None
    seen: int = 0
    fired: int = 0

    def matches(self, endpoint: str, session_id: str) -> bool:
        return self.endpoint in ("*", endpoint) and self.session_id in (None, session_id)

    @property
    def due(self) -> bool:
        """Whether the call just counted in ``seen`` falls in this rule's window."""
        first = self.on_call or 1
        return self.seen >= first and (self.times is None or self.seen < first + self.times)


def _endpoint_name(endpoint: str) -> str:
    name = endpoint.lstrip("/")
    if name != "*" and name not in _ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected '*' or one of {sorted(_ENDPOINTS)}")
    return name


# ----------------------------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------------------------


class InProcessEnvironmentServer(LoopbackServer):
    """An aiohttp server on 127.0.0.1 that answers like a NeMo Gym 0.7.0 ``interactive_browser`` server.

    ``site``: the pages its browsers can load (default: the real server's bundled ``site/``). ``max_elements``:
    the server's element cap. ``latency_s``: a fixed delay before every call (benchmarks). ``browser_open_s``: how
    long a seed spends opening the browser; a seed cancelled during it leaves an orphaned browser, as the real
    server does (counted in :attr:`orphaned_browsers`). ``port``: 0 picks a free one, kept across restarts.

    Lifetime (:class:`~nemo_gym_browser.local.loopback.LoopbackServer`): ``start`` listens, ``stop`` cuts every
    connection and keeps the sessions unless told to lose them, ``close`` (and leaving ``async with``) is ``stop``.
    """

    description = "the in-process environment server"

    def __init__(
        self,
        site: Site | None = None,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        latency_s: float = 0.0,
        browser_open_s: float = 0.0,
        port: int = 0,
    ) -> None:
        self.site = site if site is not None else Site.bundled()
        self.max_elements = max_elements
        self.latency_s = latency_s
        self.browser_open_s = browser_open_s
        super().__init__(port=port)
        self._cookies = CookieCodec(COOKIE_NAME)
        self._sessions = SessionTable()
        self._events: dict[str, list[str]] = {}
        self._calls: dict[str, int] = dict.fromkeys(_ENDPOINTS, 0)
        self._latency: dict[str, float] = {}
        self._rules: list[FaultRule] = []
        self._rule: Rule | None = None
        self._handlers: Mapping[str, Callable[[_Call], Coroutine[Any, Any, web.Response]]] = {
            "seed_session": self._seed_session,
            "close_session": self._close_session,
            "verify": self._verify,
            BROWSER_OBSERVE: self._browser_observe,
            BROWSER_NAVIGATE: self._browser_navigate,
            BROWSER_CLICK: self._browser_click,
            BROWSER_TYPE: self._browser_type,
            BROWSER_FINISH: self._browser_finish,
        }

    # ----- lifetime -------------------------------------------------------------------------------------------

    def _application(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        return app

    def _runner_options(self) -> dict[str, Any]:
        return {"keepalive_timeout": _SERVER_KEEPALIVE_S}

    async def stop(self, *, lose_state: bool = False) -> None:
        """Close the port and every open connection (in-flight requests are cut off). Idempotent.

        ``lose_state=True`` also forgets every session, as a killed server process does; without it the sessions
        are there again after :meth:`start` (a network outage rather than a crash).
        """
        await super().stop()
        if lose_state:
            self._sessions.forget_everything()

    async def restart(self) -> None:
        """A server killed and started again on the same port: every session is gone, cookies still decode."""
        await self.stop(lose_state=True)
        await self.start()

    @contextlib.asynccontextmanager
    async def refusing_connections(self) -> AsyncIterator[InProcessEnvironmentServer]:
        """Inside the block the port is closed (connection refused); sessions survive."""
        await self.stop()
        try:
            yield self
        finally:
            await self.start()

    def run_in_thread(self) -> ThreadedEnvironmentServer:
        """Run this server on its own event loop in a daemon thread, for synchronous code."""
        return ThreadedEnvironmentServer(self)

    # ----- inspection -----------------------------------------------------------------------------------------

    @property
    def open_sessions(self) -> int:
        """Browsers seeded and not yet released (by verify, close, or a legacy re-seed)."""
        return len(self._sessions.open_session_ids)

    @property
    def open_session_ids(self) -> tuple[str, ...]:
        return self._sessions.open_session_ids

    @property
    def peak_open_sessions(self) -> int:
        """The most browsers this server ever held open at once (what a per-server cap bounds)."""
        return self._sessions.peak_open

    @property
    def orphaned_browsers(self) -> int:
        """Seeds cancelled while ``browser_open_s`` was running: the real server strands those browsers."""
        return self._sessions.orphaned_browsers

    def events(self, session_id: str) -> list[str]:
        """Every call this server received for the session, in order: "seed", "observe", ..., "verify", "close"."""
        return list(self._events.get(session_id, ()))

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Every session id a call was attributed to, in first-seen order."""
        return tuple(self._events)

    def calls(self, endpoint: str = "*") -> int:
        """How many requests reached ``endpoint`` (all endpoints for ``"*"``)."""
        name = _endpoint_name(endpoint)
        return sum(self._calls.values()) if name == "*" else self._calls[name]

    # ----- fault injection ------------------------------------------------------------------------------------

    def inject(
        self,
        endpoint: str,
        fault: Fault,
        *,
        on_call: int | None = None,
        times: int | None = None,
        session_id: str | None = None,
    ) -> FaultRule:
        """Make ``endpoint`` (``"browser_click"``, ``"/verify"``, or ``"*"``) misbehave.

        Every rule counts the requests it matches (endpoint, and ``session_id`` when given) from the moment it is
        added. It is due from its ``on_call``-th match on (default: the first) for ``times`` matches (default: 1
        with ``on_call``, otherwise forever). When several rules are due, the one added first acts and the others
        let that call pass; the rule of :meth:`set_rule` is asked only about calls no injected fault acts on. The
        per-call latency applies before any of them.
        """
        if on_call is not None and on_call < 1:
            raise ValueError("on_call counts from 1")
        if times is not None and times < 1:
            raise ValueError("times must be at least 1")
        rule = FaultRule(
            endpoint=_endpoint_name(endpoint),
            fault=fault,
            on_call=on_call,
            times=1 if (times is None and on_call is not None) else times,
            session_id=session_id,
        )
        self._rules.append(rule)
        return rule

    def set_rule(self, rule: Rule | None) -> None:
        """Ask ``rule`` about every call from now on that no injected fault acts on (None: ask nothing).

        The rule sees the call's endpoint, session and the task the session was seeded for, after the per-call
        latency; the :class:`~nemo_gym_browser.local.faults.kinds.Fault` it answers acts on that call.
        """
        self._rule = rule

    def _rule_for(self, endpoint: str, session_id: str) -> FaultRule | None:
        chosen = None
        for rule in self._rules:
            if rule.matches(endpoint, session_id):
                rule.seen += 1
                if chosen is None and rule.due:
                    chosen = rule
        if chosen is not None:
            chosen.fired += 1
        return chosen

    def set_latency(self, seconds: float, endpoint: str = "*") -> None:
        """A fixed delay before each call to ``endpoint`` (``"*"``: the server-wide default)."""
        name = _endpoint_name(endpoint)
        if name == "*":
            self.latency_s = seconds
        else:
            self._latency[name] = seconds

    def lose_session(self, session_id: str) -> None:
        """Forget a session without closing anything, as a restarted server has: tools then answer "no active
        session", verify reports the session not found. Its browser died with it, so nothing leaks."""
        self._sessions.lose(session_id)

    def crash_browser(self, session_id: str) -> None:
        """Kill the session's browser; the session stays (and still needs releasing)."""
        self._sessions.crash_browser(session_id)

    # ----- dispatch -------------------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        cookie_session = self._cookies.decode(request.cookies.get(COOKIE_NAME))
        had_cookie_session = bool(cookie_session)
        # nemo_gym's add_session_id middleware: every request has a session id from here on.
        cookie_session.setdefault(SESSION_ID_KEY, str(uuid.uuid4()))
        call = _Call(
            endpoint=request.path.lstrip("/"),
            raw=b"",
            content_type=request.headers.get("Content-Type"),
            cookie_session=cookie_session,
            had_cookie_session=had_cookie_session,
        )
        if call.endpoint not in _ENDPOINTS or request.method != "POST":
            response = self._not_an_endpoint(request)
            self._set_cookie(response, call)
            return response
        call.raw = await request.read()
        call.session_id = self._attribute(call)
        name = call.endpoint
        self._calls[name] += 1
        self._events.setdefault(call.session_id, []).append(_ENDPOINTS[name])

        delay = self._latency.get(name, self.latency_s)
        if delay > 0:
            await asyncio.sleep(delay)
        fault = self._fault_for(call)
        if fault is not None:
            logger.info("environment server: %s on %s (session %s)", fault.kind, name, call.session_id)
            faulted = await self._apply(fault, call, request)
            if faulted is not None:
                return faulted

        try:
            response = await self._handlers[name](call)
        except Unprocessable as exc:
            response = json_response({"detail": exc.errors}, status=422)
        except Exception as exc:
            # nemo_gym's exception middleware: repr(exc) as a JSON string, outside the session middleware
            # (so no Set-Cookie).
            logger.debug("environment server: %s answered 500: %r", name, exc)
            return json_response(repr(exc), status=500)
        if fault is not None and fault.kind == "regrade" and response.status == 200 and response.body is not None:
            response.body = with_reward(response.body, fault.reward)
        self._set_cookie(response, call)
        return response

    def _fault_for(self, call: _Call) -> Fault | None:
        """The injected fault that is due for this call, else the rule's answer, else None."""
        injected = self._rule_for(call.endpoint, call.session_id)
        if injected is not None:
            return injected.fault
        if self._rule is None:
            return None
        seen = SeenRequest(call.endpoint, call.session_id, time.monotonic(), self._task_id(call))
        return self._rule(seen)

    async def _apply(self, fault: Fault, call: _Call, request: web.Request) -> web.StreamResponse | None:
        """Carry out ``fault`` before the handler: its answer, or None to let the call through to the handler."""
        if fault.kind == "status":
            return canned_answer(fault)
        if fault.kind == "drop":
            await drop_connection(request, fault)
        if fault.kind == "hang":
            await hold(fault)
        elif fault.kind == "lose_session":
            self.lose_session(call.session_id)
        elif fault.kind == "crash_browser":
            self.crash_browser(call.session_id)
        return None  # "regrade" acts on the handler's answer

    def _task_id(self, call: _Call) -> str | None:
        """The task the call's session was seeded for: the typed seed's own, or the one its session is bound to."""
        if isinstance(call.parsed, ResourcesSeedSessionRequest):
            return call.parsed.task_id.task_id
        return self._sessions.task_id(call.session_id)

    @staticmethod
    def _not_an_endpoint(request: web.Request) -> web.Response:
        liveness = request.path in _LIVENESS_PATHS
        if liveness and request.method == "GET":
            return json_response({"status": "ok"})
        if not liveness and request.path.lstrip("/") not in _ENDPOINTS:
            return json_response({"detail": "Not Found"}, status=404)
        response = json_response({"detail": "Method Not Allowed"}, status=405)
        response.headers["Allow"] = "GET" if liveness else "POST"
        return response

    def _attribute(self, call: _Call) -> str:
        """The session a call belongs to: a typed seed's or close's id, otherwise the cookie's."""
        if call.endpoint in ("seed_session", "close_session"):
            try:
                if call.endpoint == "seed_session":
                    call.parsed = call.body(SEED_BODY, required=True)
                    if isinstance(call.parsed, ResourcesSeedSessionRequest):
                        return call.parsed.resources_session_id
                else:
                    call.parsed = call.body(CLOSE_BODY, required=False)
                    typed = ResourcesCloseSessionRequest.model_validate(call.parsed) if call.parsed else None
                    if typed is not None:
                        return typed.resources_session_id
            except (Unprocessable, ValidationError):
                call.parsed = None
        return call.cookie_session_id

    def _set_cookie(self, response: web.Response, call: _Call) -> None:
        self._cookies.set_cookie(response, call.cookie_session, had_session=call.had_cookie_session)

    # ----- lifecycle endpoints --------------------------------------------------------------------------------

    async def _seed_session(self, call: _Call) -> web.Response:
        body = call.parsed if call.parsed is not None else call.body(SEED_BODY, required=True)
        if not isinstance(body, ResourcesSeedSessionRequest):
            await self._sessions.open(call.cookie_session_id, body, self.site, browser_open_s=self.browser_open_s)
            return json_response({})

        session_id = body.resources_session_id
        call.cookie_session[SESSION_ID_KEY] = session_id
        await self._sessions.seed_typed(body, self.site, browser_open_s=self.browser_open_s)
        return json_response({"resources_session_id": session_id, "resources_tools": None, "sandbox_access": None})

    async def _close_session(self, call: _Call) -> web.Response:
        body = call.body(CLOSE_BODY, required=False)
        if not body:
            self._sessions.release(call.cookie_session.get(SESSION_ID_KEY))
            return json_response({"closed": True})
        try:
            typed = ResourcesCloseSessionRequest.model_validate(body)
        except ValidationError as exc:
            # Raised by hand in the real handler, so the errors keep pydantic's `url` and have no `body` prefix.
            raise Unprocessable(jsonable(exc.errors())) from exc
        await self._sessions.close_typed(typed)
        call.cookie_session.pop(SESSION_ID_KEY, None)
        return json_response({"resources_session_id": typed.resources_session_id})

    # ----- tools ----------------------------------------------------------------------------------------------

    def _tool_answer(self, call: _Call, verb: str, act: Callable[[Browser], None]) -> web.Response:
        answer = self._sessions.tool(call.cookie_session_id, verb, act, max_elements=self.max_elements)
        return json_response(answer.model_dump())

    async def _browser_observe(self, call: _Call) -> web.Response:
        return self._tool_answer(call, "observe", lambda browser: None)  # takes no body: anything is accepted

    async def _browser_navigate(self, call: _Call) -> web.Response:
        body = call.body(NAVIGATE_BODY, required=True)
        return self._tool_answer(call, "navigate", lambda browser: browser.goto(body.url))

    async def _browser_click(self, call: _Call) -> web.Response:
        body = call.body(ELEMENT_BODY, required=True)
        return self._tool_answer(call, "click", lambda browser: browser.click(body.element_id))

    async def _browser_type(self, call: _Call) -> web.Response:
        body = call.body(TYPE_BODY, required=True)
        return self._tool_answer(call, "type", lambda browser: browser.type(body.element_id, body.text))

    async def _browser_finish(self, call: _Call) -> web.Response:
        body = call.body(FINISH_BODY, required=True)
        return json_response(self._sessions.finish(call.cookie_session_id, body.answer).model_dump())

    # ----- verify ---------------------------------------------------------------------------------------------

    async def _verify(self, call: _Call) -> web.Response:
        body = call.body(VERIFY_BODY, required=True)
        reward, failure_reason = self._sessions.verify(call.cookie_session_id)
        return json_response(
            {
                "responses_create_params": body.responses_create_params.model_dump(mode="json"),
                "response": body.response.model_dump(mode="json"),
                "reward": reward,
                "mask_sample": False,
                "failure_kind": None,
                "failure_reason": failure_reason,
            }
        )


# ----------------------------------------------------------------------------------------------------------------
# Running in a thread, for synchronous callers
# ----------------------------------------------------------------------------------------------------------------

_T = TypeVar("_T")


class ThreadedEnvironmentServer:
    """A :class:`InProcessEnvironmentServer` on its own event loop in a daemon thread, for synchronous callers.

    ``with InProcessEnvironmentServer().run_in_thread() as env: ...`` then talk to ``env.url``. ``inject`` and the
    inspection members of ``env.server`` are safe to use between requests; the port is closed and reopened with
    :meth:`stop_server`, :meth:`start_server` and :meth:`restart_server`.
    """

    _TIMEOUT_S = 10.0

    def __init__(self, server: InProcessEnvironmentServer) -> None:
        self.server = server
        self._loop: BackgroundLoop | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> ThreadedEnvironmentServer:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Start the thread and the server in it. Idempotent."""
        if self._loop is not None:
            return
        self._loop = BackgroundLoop("environment-server")
        self._loop.open()
        self.run(self.server.start())

    def run(self, coro: Coroutine[Any, Any, _T], *, timeout_s: float = _TIMEOUT_S) -> _T:
        """Run a coroutine on the server's loop and wait for its result."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the in-process environment server thread is not running")
        return self._loop.run(coro, timeout_s=timeout_s)

    def stop_server(self, *, lose_state: bool = False) -> None:
        self.run(self.server.stop(lose_state=lose_state))

    def start_server(self) -> None:
        self.run(self.server.start())

    def restart_server(self) -> None:
        self.run(self.server.restart())

    def close(self) -> None:
        """Stop the server and the thread. Idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            loop.run(self.server.stop(), timeout_s=self._TIMEOUT_S)
        finally:
            loop.close()
