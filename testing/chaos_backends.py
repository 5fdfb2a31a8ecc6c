"""The servers a chaos run drives, and how faults reach them.

:class:`FakeBackend`: in-process fake servers, faults injected by the fake itself (scale, offline).
:class:`ProxiedBackend`: any servers behind :class:`~nemo_gym_browser.local.faults.proxy.FaultProxy` (the real
NeMo Gym server; the fake too, to test the proxy path offline); killing a server stops its proxy, restarts the
server behind it through a callback, and starts the proxy again. :func:`local_environment_backend` is the real
server behind a proxy. Either way every call is asked about by one :class:`~nemo_gym_browser.local.faults.kinds.Rule`
per server, which records it as a :class:`Hit` and carries out the fault the run aims at it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..gym_contract.session_ids import parse_session_id
from ..local.environment_server.server import InProcessEnvironmentServer
from ..local.faults.kinds import HANG_LIMIT_S, Fault, Rule, SeenRequest
from ..local.faults.proxy import FaultProxy


@dataclass(frozen=True)
class Hit:
    """A call a server (or its proxy) saw, with the fault it got."""

    server: int
    session_id: str | None
    endpoint: str
    at: float  # when the server (or its proxy) received the call
    fault: str | None


Targeting = Callable[[int, str | None, str], str | None]  # (server, session id, endpoint) -> fault kind or None


class Backend:
    """What a chaos run needs from the servers. Subclasses: :class:`FakeBackend`, :class:`ProxiedBackend`."""

    urls: list[str]
    hits: list[Hit]

    def __init__(self) -> None:
        self.hits = []
        self.targeting: Targeting | None = None
        self.slow_s = 0.0  # how long a "slow" call waits before it is handled (below the per-call timeout)
        self.hang_s = HANG_LIMIT_S  # how long a "hang" holds its call: past any per-call timeout
        self._bursting: set[int] = set()

    def fault_for(self, server: int, session_id: str | None, endpoint: str) -> str | None:
        if server in self._bursting:
            return "burst"
        return self.targeting(server, session_id, endpoint) if self.targeting is not None else None

    def rule(self, server: int) -> Rule:
        """The one fault rule of ``server``: records every call it is asked about and fails those the run aims at."""

        def rule(request: SeenRequest) -> Fault | None:
            kind = self.fault_for(server, request.session_id, request.endpoint)
            self.hits.append(Hit(server, request.session_id, request.endpoint, request.received_at, kind))
            return None if kind is None else self._fault_of(kind)

        return rule

    def _fault_of(self, kind: str) -> Fault:
        """The fault a planned ``kind`` is: the same value whether a fake server or a proxy carries it out."""
        return {
            "status": Fault.status(503),
            "burst": Fault.status(503),
            "hang": Fault.hang(self.hang_s),
            "slow": Fault.hang(self.slow_s),
            "drop": Fault.drop_connection(),
            "lose_session": Fault.lose_session(),
            "fail_seed": Fault.fail_seed(),
        }[kind]

    @contextlib.contextmanager
    def bursting(self, server: int) -> Iterator[None]:
        """Inside the block every call to ``server`` answers 503."""
        self._bursting.add(server)
        try:
            yield
        finally:
            self._bursting.discard(server)

    async def kill_and_restart(self, server: int) -> None:
        raise NotImplementedError

    def open_session_ids(self, server: int) -> tuple[str, ...]:
        raise NotImplementedError

    async def sessions_left_open(self) -> tuple[dict[str, int], int]:
        """What the servers still hold after the run: counts by what was measured, and the number of sessions."""
        raise NotImplementedError

    def uninjected_failures(self) -> set[str]:
        """Sessions that got a 5xx or lost a call (other than a close) without an injected fault, where the backend
        can tell (the proxy can; the fakes fail only when told to)."""
        return set()

    def seed_answered_at(self) -> dict[str, float]:
        """When each session's seed was answered (where the backend can tell; else when it was received)."""
        return {h.session_id: h.at for h in self.hits if h.endpoint == "seed_session" and h.session_id}

    def attempt_spans(self) -> dict[str, float]:
        """Per attempt (``<rollout id>.<attempt>``, :func:`attempt_key`): from the seed answer of its first session to
        the first verify or close of its last one, i.e. the episode the deadline bounds, with any resume's new sessions
        and replays inside it (a replaced session's close, sent in the background, does not end the attempt).

        A session never verified nor closed (a leak) is measured to its last call.
        """
        start = self.seed_answered_at()
        end: dict[str, float] = {}
        last: dict[str, float] = {}
        for hit in self.hits:
            if hit.session_id in start:
                last[hit.session_id] = hit.at
                if hit.endpoint in ("verify", "close_session"):
                    end.setdefault(hit.session_id, hit.at)
        attempts: dict[str, list[str]] = {}
        for session in sorted(start, key=start.__getitem__):
            attempts.setdefault(attempt_key(session), []).append(session)
        return {
            key: max(0.0, end.get(sessions[-1], last.get(sessions[-1], start[sessions[-1]])) - start[sessions[0]])
            for key, sessions in attempts.items()
        }

    def sessions_per_attempt(self) -> dict[str, int]:
        """How many sessions each attempt seeded (more than one: it tried to resume)."""
        seeded = {h.session_id for h in self.hits if h.endpoint == "seed_session" and h.session_id}
        return dict(collections.Counter(attempt_key(s) for s in seeded))


def attempt_key(session_id: str) -> str:
    """The attempt a session belongs to: its id less the session number (``<rollout id>.<attempt>``)."""
    return session_id.rsplit(".", 1)[0] if parse_session_id(session_id) else session_id


class FakeBackend(Backend):
    """``count`` in-process fake servers with ``latency_s`` per call."""

    def __init__(self, count: int, *, latency_s: float = 0.0, hang_s: float = 30.0, downtime_s: float = 0.3) -> None:
        super().__init__()
        self.servers = [InProcessEnvironmentServer(latency_s=latency_s) for _ in range(count)]
        self.hang_s = hang_s
        self.downtime_s = downtime_s

    async def __aenter__(self) -> FakeBackend:
        for index, server in enumerate(self.servers):
            await server.start()
            server.set_rule(self.rule(index))
        self.urls = [server.url for server in self.servers]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for server in self.servers:
            await server.stop()

    async def kill_and_restart(self, server: int) -> None:
        fake = self.servers[server]
        await fake.stop(lose_state=True)  # the process dies with its browsers
        await asyncio.sleep(self.downtime_s)
        await fake.start()

    def open_session_ids(self, server: int) -> tuple[str, ...]:
        return self.servers[server].open_session_ids

    async def sessions_left_open(self) -> tuple[dict[str, int], int]:
        counts = {
            "open sessions": sum(s.open_sessions for s in self.servers),
            "orphaned browsers": sum(s.orphaned_browsers for s in self.servers),
        }
        return counts, sum(counts.values())


class ProxiedBackend(Backend):
    """Servers behind fault proxies. ``restart(i)`` restarts server ``i`` behind its proxy (killing its browsers);
    ``leftovers()`` reports what the servers still hold (every value should be 0)."""

    def __init__(
        self,
        upstreams: Sequence[str],
        *,
        restart: Callable[[int], Awaitable[None]],
        leftovers: Callable[[], Awaitable[dict[str, int]]],
        upstream_timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        self.proxies = [FaultProxy(url, upstream_timeout_s=upstream_timeout_s) for url in upstreams]
        self._restart = restart
        self._leftovers = leftovers

    async def __aenter__(self) -> ProxiedBackend:
        for index, proxy in enumerate(self.proxies):
            await proxy.start()
            proxy.set_rule(self.rule(index))
        self.urls = [proxy.url for proxy in self.proxies]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for proxy in self.proxies:
            await proxy.close()

    async def kill_and_restart(self, server: int) -> None:
        proxy = self.proxies[server]
        await proxy.stop()  # connections cut, port refuses: what clients see of a dead server
        await self._restart(server)
        proxy.forget_sessions()  # the restarted server holds none of them
        await proxy.start()

    def open_session_ids(self, server: int) -> tuple[str, ...]:
        return self.proxies[server].open_session_ids

    async def sessions_left_open(self) -> tuple[dict[str, int], int]:
        counts = {"open sessions (seen through the proxies)": sum(len(p.open_session_ids) for p in self.proxies)}
        counts.update(await self._leftovers())
        return counts, max(counts.values())  # several measures of the same browsers

    def uninjected_failures(self) -> set[str]:
        return {
            entry.request.session_id
            for proxy in self.proxies
            for entry in proxy.log
            if entry.fault is None
            and entry.request.session_id
            and entry.request.endpoint != "close_session"
            and (entry.status is None or entry.status >= 500)
        }

    def seed_answered_at(self) -> dict[str, float]:
        return {
            entry.request.session_id: entry.finished_at
            for proxy in self.proxies
            for entry in proxy.log
            if entry.request.endpoint == "seed_session" and entry.request.session_id and entry.status == 200
        }


@contextlib.asynccontextmanager
async def local_environment_backend(**environment_kwargs: Any) -> AsyncIterator[ProxiedBackend]:
    """The real NeMo Gym 0.7.0 server (``launch_environment.LocalEnvironment``) behind a fault proxy.

    Killing it stops the proxy, stops the server and its Chromium (every browser dies), starts a new one on the
    same port and reopens the proxy. What is left open afterwards is read from the server's browser state.
    """
    from ..launch_environment import LocalEnvironment

    current = [await asyncio.to_thread(LocalEnvironment(**environment_kwargs).start)]

    async def restart(server: int) -> None:
        port = current[0].port
        await asyncio.to_thread(current[0].stop)
        current[0] = await asyncio.to_thread(LocalEnvironment(**{**environment_kwargs, "port": port}).start)

    async def leftovers() -> dict[str, int]:
        state = await asyncio.to_thread(current[0].wait_for_idle, 20.0)
        return {
            "browser contexts": state.contexts or 0,
            "pages": state.pages or 0,
            "playwright drivers": state.drivers,
            "browsers": state.browsers,
        }

    try:
        async with ProxiedBackend([current[0].url], restart=restart, leftovers=leftovers) as backend:
            yield backend
    finally:
        await asyncio.to_thread(current[0].stop)
