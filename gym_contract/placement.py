"""Which environment server a new browser session goes to, and how many sessions each server holds at once.

The rule (:class:`PlacementBook`): a new session goes to the server with the fewest sessions in flight among those
in rotation and under their cap (``max_sessions_per_server``); a server out of rotation gets one only when no server
is, which probes it back in; when every candidate is full the request waits, first come first served. Its hosts
(``EnvironmentConfig.placement``): :class:`ProcessPlacement` counts this process's sessions; :class:`RayPlacement`
counts the whole run's in one :class:`PlacementAuthority` actor (one per node for loopback URLs).

Lifetimes (:class:`RayPlacement`): every slot is a lease whose id the client chose before asking, given back in the
client's ``finally``; a process silent for ``lease_ttl_s`` is taken for dead and its slots count until a live
process has closed its browsers; the authority ends itself after ``idle_exit_s`` without a heartbeat.

Errors: :class:`PlacementUnavailable`. Nothing here speaks HTTP (closing an orphan's browser is the caller's
``reap`` callback) or knows verl; Ray is imported only by :class:`RayPlacement`. In full: ``docs/agent-loop.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from . import named_actors

logger = logging.getLogger(__name__)

AUTHORITY_ROLE = "nemo_gym_browser.gym_contract.placement"
# A waiting request returns empty-handed after this long and asks again, so every call has a bounded wait and a
# request whose process died stops waiting by itself.
_WAIT_POLL_S = 20.0
# Time for the authority to answer anything beyond the wait itself.
_RPC_TIMEOUT_S = 30.0
# The authority exits once it holds nothing and has heard from no process for this long.
_IDLE_EXIT_S = 600.0
# Give-backs that overtook their own request are forgotten after this long (the request has long timed out).
_EARLY_RELEASE_MEMORY_S = 3600.0
# Calls the authority runs at once. Waiting requests hold one each, and a give-back queued behind them would never
# run, so this is far above any number of sessions a run waits for. (Not a separate concurrency group: Ray runs
# each group of an async actor on its own event loop, and the book must live on one.)
_MAX_CONCURRENT_CALLS = 1_000_000


class PlacementUnavailable(RuntimeError):
    """The run's placement authority could not be reached."""


@dataclass(frozen=True)
class SessionTicket:
    """What another process needs to close a session's browser when its owner is gone (the typed close's ids)."""

    session_id: str
    rollout_id: str
    attempt: int


@dataclass(frozen=True)
class Orphan:
    """The browser of a session whose process died: close it on ``server``, then give the lease back."""

    server: str
    ticket: SessionTicket


@dataclass(frozen=True)
class Grant:
    """One slot on ``server``. ``probing``: the server was out of rotation (no server was in rotation)."""

    server: str
    lease_id: str
    probing: bool = False


class Placement(Protocol):
    """What :class:`~nemo_gym_browser.gym_contract.environment.EnvironmentClient` needs from a placement host."""

    async def acquire(self, servers: Sequence[str], cap: int, ticket: SessionTicket) -> Grant: ...

    def release(self, grant: Grant) -> None: ...

    def mark_down(self, server: str, cooldown_s: float) -> None: ...

    def mark_up(self, grant: Grant) -> None: ...

    async def close(self) -> None: ...


# ----- the rule ------------------------------------------------------------------------------------------------


class _Slot:
    __slots__ = ("down_until", "outstanding")

    def __init__(self) -> None:
        self.outstanding = 0
        self.down_until = 0.0


@dataclass
class _Waiter:
    servers: tuple[str, ...]
    cap: int
    future: asyncio.Future[str]


class PlacementBook:
    """Sessions in flight and rotation state per server, the placement rule, and the queue of waiting requests.

    Synchronous and single-threaded: every method runs on one event loop, so a check and the count it changes are
    never separated by another request. Waiting requests get their slot by :meth:`dispatch`, which runs after
    every change that can free one.
    """

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._waiters: list[_Waiter] = []
        self._limits: dict[str, int] = {}  # a lower cap for some servers; absent: the request's

    def outstanding(self) -> dict[str, int]:
        return {server: slot.outstanding for server, slot in self._slots.items()}

    def limit(self, limits: Mapping[str, int]) -> None:
        """Hold at most ``limits[server]`` sessions on each listed server, whatever cap a request names."""
        self._limits = dict(limits)
        self.dispatch()

    def is_down(self, server: str) -> bool:
        return time.monotonic() < self._slot(server).down_until

    def take(self, servers: Sequence[str], cap: int) -> str | None:
        """Count one session on the best server for it, or return None when every candidate is full."""
        now = time.monotonic()
        caps = {server: min(cap, self._limits.get(server, cap)) for server in servers}
        slots = [(server, self._slot(server)) for server in servers if caps[server] > 0]
        healthy = [(server, slot) for server, slot in slots if now >= slot.down_until]
        pool = [(server, slot) for server, slot in (healthy or slots) if slot.outstanding < caps[server]]
        if not pool:
            return None
        server, slot = min(pool, key=lambda item: (item[1].outstanding, item[1].down_until))
        slot.outstanding += 1
        return server

    def wait(self, servers: Sequence[str], cap: int) -> asyncio.Future[str]:
        """A future that :meth:`dispatch` completes with a server once one is free (the count already taken)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.append(_Waiter(tuple(servers), cap, future))
        return future

    def give_back(self, server: str) -> None:
        self._slot(server).outstanding -= 1
        self.dispatch()

    def mark_down(self, server: str, cooldown_s: float) -> None:
        self._slot(server).down_until = time.monotonic() + cooldown_s
        # Whoever waits for a full server in rotation may take this one once its cool-down ends.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_later(cooldown_s, self.dispatch)

    def mark_up(self, server: str) -> None:
        if self.is_down(server):
            self._slot(server).down_until = 0.0
            self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to waiting requests, oldest first."""
        remaining: list[_Waiter] = []
        full: set[tuple[tuple[str, ...], int]] = set()  # requests for what is already known to be full
        for waiter in self._waiters:
            if waiter.future.done():  # cancelled by its request
                continue
            wanted = (waiter.servers, waiter.cap)
            server = None if wanted in full else self.take(waiter.servers, waiter.cap)
            if server is None:
                full.add(wanted)
                remaining.append(waiter)
                continue
            waiter.future.set_result(server)
        self._waiters = remaining

    def _slot(self, server: str) -> _Slot:
        slot = self._slots.get(server)
        if slot is None:
            slot = self._slots[server] = _Slot()
        return slot


async def _await_slot(book: PlacementBook, future: asyncio.Future[str]) -> str:
    """Wait for ``future``; if the wait is abandoned after the slot was handed over, give the slot back."""
    try:
        return await asyncio.shield(future)
    except BaseException:
        if future.done() and not future.cancelled():
            book.give_back(future.result())
        else:
            future.cancel()
        raise


# ----- one process ---------------------------------------------------------------------------------------------


class ProcessPlacement:
    """The rule over this process's sessions only (no Ray)."""

    def __init__(self) -> None:
        self.book = PlacementBook()

    async def acquire(self, servers: Sequence[str], cap: int, ticket: SessionTicket) -> Grant:
        server = self.book.take(servers, cap)
        if server is None:
            server = await _await_slot(self.book, self.book.wait(servers, cap))
        return Grant(server=server, lease_id=ticket.session_id, probing=self.book.is_down(server))

    def release(self, grant: Grant) -> None:
        self.book.give_back(grant.server)

    def mark_down(self, server: str, cooldown_s: float) -> None:
        self.book.mark_down(server, cooldown_s)

    def mark_up(self, grant: Grant) -> None:
        self.book.mark_up(grant.server)

    async def close(self) -> None:
        return None


# ----- the whole run -------------------------------------------------------------------------------------------


@dataclass
class _Lease:
    server: str
    holder: str | None  # None: its process stopped answering; waiting for a live one to close its browser
    ticket: dict[str, Any]


class PlacementAuthority:
    """The run's placement state (a Ray actor, see the module docstring): one book, the leases and their holders."""

    def __init__(self, idle_exit_s: float = _IDLE_EXIT_S) -> None:
        self._book = PlacementBook()
        self._leases: dict[str, _Lease] = {}
        self._waiting: dict[str, asyncio.Future[str]] = {}  # lease id -> the slot its request waits for
        self._released_early: dict[str, float] = {}  # lease id -> when its give-back overtook its request
        self._holders: dict[str, tuple[float, float]] = {}  # holder -> (last heard from, its lease ttl)
        self._idle_exit_s = idle_exit_s
        self._last_heard = time.monotonic()
        self._watch: asyncio.Task[None] | None = None

    def _heard(self, holder: str, ttl_s: float) -> None:
        now = time.monotonic()
        self._holders[holder] = (now, ttl_s)
        self._last_heard = now
        if self._watch is None and named_actors.in_actor():
            self._watch = named_actors.exit_when_idle(self._idle, check_every_s=min(60.0, self._idle_exit_s / 4))

    def _idle(self) -> bool:
        # Every live process heartbeats every lease_ttl_s / 4, so silence this long means the run is over.
        return time.monotonic() - self._last_heard > self._idle_exit_s

    async def acquire(
        self, holder: str, ttl_s: float, lease_id: str, servers: list[str], cap: int, ticket: dict, wait_s: float
    ) -> tuple[str, bool] | None:
        """A server for the lease, or None when none freed up within ``wait_s`` or the lease was given back."""
        self._heard(holder, ttl_s)
        if self._released_early.pop(lease_id, None) is not None:
            return None
        server = self._book.take(servers, cap)
        if server is None:
            future = self._book.wait(servers, cap)
            self._waiting[lease_id] = future
            try:
                await asyncio.wait({future}, timeout=wait_s)
            except BaseException:  # the call itself was cancelled
                if self._waiting.pop(lease_id, None) is not None:
                    self._settle_unclaimed(future)
                raise
            if self._waiting.pop(lease_id, None) is None:  # given back while it waited (the slot went back too)
                return None
            if not future.done():
                future.cancel()
                return None
            server = future.result()
        self._leases[lease_id] = _Lease(server=server, holder=holder, ticket=ticket)
        return server, self._book.is_down(server)

    async def release(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._book.give_back(lease.server)
            return
        future = self._waiting.pop(lease_id, None)
        if future is not None:
            self._settle_unclaimed(future)
            return
        self._released_early[lease_id] = time.monotonic()

    def _settle_unclaimed(self, future: asyncio.Future[str]) -> None:
        if future.done() and not future.cancelled():
            self._book.give_back(future.result())
        else:
            future.cancel()

    async def heartbeat(self, holder: str, ttl_s: float) -> list[tuple[str, str, dict]]:
        """Keep ``holder``'s leases; hand it the orphans to close: ``[(lease id, server, ticket)]``."""
        self._heard(holder, ttl_s)
        self._expire()
        work = []
        for lease_id, lease in self._leases.items():
            if lease.holder is None:
                lease.holder = holder
                work.append((lease_id, lease.server, lease.ticket))
        return work

    def _expire(self) -> None:
        now = time.monotonic()
        dead = {holder for holder, (seen, ttl_s) in self._holders.items() if now - seen > ttl_s}
        for holder in dead:
            del self._holders[holder]
        # Not only the leases of holders found dead just now: a request that was waiting when its process died
        # may have been granted after that process was forgotten.
        for lease_id, lease in self._leases.items():
            if lease.holder is not None and lease.holder not in self._holders:
                logger.warning(
                    "lease %s (session %s on %s): its process stopped answering; its browser will be closed",
                    lease_id,
                    lease.ticket.get("session_id"),
                    lease.server,
                )
                lease.holder = None
        for lease_id, when in list(self._released_early.items()):
            if now - when > _EARLY_RELEASE_MEMORY_S:
                del self._released_early[lease_id]

    async def mark_down(self, server: str, cooldown_s: float) -> None:
        self._book.mark_down(server, cooldown_s)

    async def mark_up(self, server: str) -> None:
        self._book.mark_up(server)

    async def snapshot(self) -> dict[str, Any]:
        """Counts for tests and benchmarks."""
        return {
            "outstanding": self._book.outstanding(),
            "leases": len(self._leases),
            "orphans": sum(lease.holder is None for lease in self._leases.values()),
            "waiting": len(self._waiting),
            "holders": len(self._holders),
        }


def _is_loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RayPlacement:
    """The rule over every session of the run, kept by the shared :class:`PlacementAuthority` actor."""

    def __init__(
        self, servers: Sequence[str], *, lease_ttl_s: float, reap: Callable[[Orphan], Awaitable[None]]
    ) -> None:
        import ray

        loopback = [_is_loopback(url) for url in servers]
        if any(loopback) and not all(loopback):
            logger.warning(
                "server_urls mix loopback and other addresses; sessions are counted per node for all of them"
            )
        self._node_id = ray.get_runtime_context().get_node_id() if any(loopback) else None
        self._ttl_s = lease_ttl_s
        self._reap = reap
        self._holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._heartbeat: asyncio.Task[None] | None = None
        self._reaping: set[asyncio.Task[None]] = set()
        self._down_until: dict[str, float] = {}  # what this process already reported, to report each outage once

    def _actor(self) -> Any:
        return named_actors.job_actor(
            PlacementAuthority, AUTHORITY_ROLE, node_id=self._node_id, max_concurrency=_MAX_CONCURRENT_CALLS
        )

    async def _call(self, method: str, *args: Any, timeout_s: float) -> Any:
        for attempt in range(2):
            try:
                return await asyncio.wait_for(getattr(self._actor(), method).remote(*args), timeout_s)
            except TimeoutError as exc:
                reason = f"the placement authority did not answer {method} in {timeout_s:g}s"
                raise PlacementUnavailable(reason) from exc
            except Exception as exc:
                if not named_actors.actor_died(exc):
                    raise
                named_actors.forget(AUTHORITY_ROLE, self._node_id)  # a new one is created on the next call
                if attempt:
                    raise PlacementUnavailable(f"the placement authority is gone: {type(exc).__name__}") from exc
        raise AssertionError("unreachable")

    def _send(self, method: str, *args: Any) -> None:
        """Fire and forget (a give-back or a health report must not wait, and must never raise)."""
        try:
            getattr(self._actor(), method).remote(*args)
        except Exception as exc:  # the authority is gone; its successor starts from zero
            named_actors.forget(AUTHORITY_ROLE, self._node_id)
            logger.warning("placement: could not send %s: %s", method, exc)

    async def acquire(self, servers: Sequence[str], cap: int, ticket: SessionTicket) -> Grant:
        self._start_heartbeat()
        lease_id = uuid.uuid4().hex
        try:
            while True:
                answer = await self._call(
                    "acquire",
                    self._holder,
                    self._ttl_s,
                    lease_id,
                    list(servers),
                    cap,
                    asdict(ticket),
                    _WAIT_POLL_S,
                    timeout_s=_WAIT_POLL_S + _RPC_TIMEOUT_S,
                )
                if answer is not None:
                    server, probing = answer
                    return Grant(server=server, lease_id=lease_id, probing=probing)
        except BaseException:
            self._send("release", lease_id)  # whatever the authority granted meanwhile goes back
            raise

    def release(self, grant: Grant) -> None:
        self._send("release", grant.lease_id)

    def mark_down(self, server: str, cooldown_s: float) -> None:
        now = time.monotonic()
        if now >= self._down_until.get(server, 0.0):
            self._send("mark_down", server, cooldown_s)
        self._down_until[server] = now + cooldown_s

    def mark_up(self, grant: Grant) -> None:
        self._down_until.pop(grant.server, None)
        if grant.probing:
            self._send("mark_up", grant.server)

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            try:
                work = await self._call("heartbeat", self._holder, self._ttl_s, timeout_s=_RPC_TIMEOUT_S)
            except PlacementUnavailable as exc:
                logger.warning("placement heartbeat failed: %s", exc)
                work = []
            for lease_id, server, ticket in work:
                task = asyncio.get_running_loop().create_task(
                    self._close_orphan(lease_id, Orphan(server, SessionTicket(**ticket)))
                )
                self._reaping.add(task)
                task.add_done_callback(self._reaping.discard)
            await asyncio.sleep(max(0.05, self._ttl_s / 4))

    async def _close_orphan(self, lease_id: str, orphan: Orphan) -> None:
        try:
            await self._reap(orphan)
        except Exception as exc:  # the slot goes back whatever the close did
            logger.warning("could not close orphaned session %s: %s", orphan.ticket.session_id, exc)
        finally:
            self._send("release", lease_id)

    async def close(self) -> None:
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)

    async def snapshot(self) -> dict[str, Any]:
        return await self._call("snapshot", timeout_s=_RPC_TIMEOUT_S)


def make_placement(
    mode: str, servers: Sequence[str], *, lease_ttl_s: float, reap: Callable[[Orphan], Awaitable[None]]
) -> Placement:
    """The host ``mode`` names: ``process``, ``ray``, or ``auto`` (Ray when this process is connected to it)."""
    if mode == "process" or (mode == "auto" and not named_actors.ray_connected()):
        return ProcessPlacement()
    if not named_actors.ray_connected():
        raise ValueError("placement 'ray' needs a process connected to Ray (a Ray worker, or after ray.init)")
    return RayPlacement(servers, lease_ttl_s=lease_ttl_s, reap=reap)
