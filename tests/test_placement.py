"""The per-server session cap holds per server across worker processes, not per process.

Two real Ray actors (two worker processes, as verl's ``AgentLoopWorker``s are) open sessions through their own
``EnvironmentClient`` on one in-process environment server in this process; the server itself counts the browsers open
at once. Leases of a worker that dies are reclaimed and its browsers closed; a cancelled wait leaks no lease. The static
per-worker share holds the cap without any process talking to another (offline: several workers in one loop).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure
from nemo_gym_browser.gym_contract.placement import Grant, PlacementAuthority, SessionTicket
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.settings import EnvironmentConfig
from nemo_gym_browser.testing.static_share import StaticSharePlacement, static_share

START = "site/index.html"
RAY_TIMEOUT_S = 120
SERVER = "http://127.0.0.1:8100"
TICKET = {"session_id": "r1.1.0", "rollout_id": "r1", "attempt": 1}


def session_holder_actor():
    """A Ray actor class (defined here so that Ray ships it by value) that opens sessions like a rollout worker."""
    import ray

    @ray.remote(num_cpus=0)
    class SessionHolder:
        def __init__(self, urls: list[str], cap: int, lease_ttl_s: float) -> None:
            self.config = EnvironmentConfig(
                server_urls=tuple(urls),
                max_sessions_per_server=cap,
                lease_ttl_s=lease_ttl_s,
                close_timeout_s=2.0,
                transient_retries=0,
                server_cooldown_s=60.0,
            )
            self.client: EnvironmentClient | None = None
            self.prefix = f"w{uuid.uuid4().hex[:8]}"

        async def run_sessions(self, count: int, hold_s: float) -> list[float]:
            """Open ``count`` sessions at once, each held ``hold_s``; returns when each got its browser."""
            self.client = self.client or EnvironmentClient(self.config)
            started = time.monotonic()

            async def one(index: int) -> float:
                async with self.client.session(
                    rollout_id=f"{self.prefix}-{index}", attempt=1, task_id="t", initial_url=START
                ):
                    opened = time.monotonic() - started
                    await asyncio.sleep(hold_s)
                return opened

            return list(await asyncio.gather(*(one(index) for index in range(count))))

        async def open_one_by_one(self, count: int) -> list[str]:
            """Open and close ``count`` sessions in turn: the server each went to, or the failure that ended it."""
            self.client = self.client or EnvironmentClient(self.config)
            where = []
            for index in range(count):
                try:
                    async with self.client.session(
                        rollout_id=f"{self.prefix}-s{index}", attempt=1, task_id="t", initial_url=START
                    ) as session:
                        where.append(session.server_url)
                except EnvironmentFailure as failure:
                    where.append(failure.kind.value)
            return where

        async def close(self) -> None:
            if self.client is not None:
                await self.client.close()

    return SessionHolder


# ----- the authority's bookkeeping, as a plain object (what its actor runs) -------------------------------------


async def test_a_give_back_that_overtakes_its_request_makes_the_authority_refuse_that_request():
    authority = PlacementAuthority()

    await authority.release("lease-1")  # the client was cancelled before its request was even seen
    granted = await authority.acquire("w1", 30.0, "lease-1", [SERVER], 1, TICKET, 1.0)

    assert granted is None
    assert (await authority.snapshot())["leases"] == 0
    assert await authority.acquire("w1", 30.0, "lease-2", [SERVER], 1, TICKET, 1.0) == (SERVER, False)


async def test_a_slot_given_back_goes_to_the_oldest_waiting_request():
    authority = PlacementAuthority()
    assert await authority.acquire("w1", 30.0, "first", [SERVER], 1, TICKET, 1.0) == (SERVER, False)
    second = asyncio.create_task(authority.acquire("w2", 30.0, "second", [SERVER], 1, TICKET, 5.0))
    await asyncio.sleep(0.01)
    third = asyncio.create_task(authority.acquire("w3", 30.0, "third", [SERVER], 1, TICKET, 0.2))

    await authority.release("first")

    assert await second == (SERVER, False)
    assert await third is None  # still full when its wait ran out: it asks again
    assert (await authority.snapshot())["outstanding"] == {SERVER: 1}


async def test_the_leases_of_a_silent_holder_stay_counted_until_a_live_one_closed_their_browsers():
    authority = PlacementAuthority()
    await authority.acquire("dead", 0.05, "lease-1", [SERVER], 1, TICKET, 1.0)
    await asyncio.sleep(0.1)  # longer than its lease ttl, without a heartbeat

    orphans = await authority.heartbeat("alive", 30.0)

    assert orphans == [("lease-1", SERVER, TICKET)]
    assert await authority.acquire("alive", 30.0, "lease-2", [SERVER], 1, TICKET, 0.05) is None  # still counted
    assert await authority.heartbeat("alive", 30.0) == []  # handed out once
    await authority.release("lease-1")  # the live holder closed the browser
    assert await authority.acquire("alive", 30.0, "lease-3", [SERVER], 1, TICKET, 0.05) == (SERVER, False)


async def test_a_request_granted_after_its_process_was_taken_for_dead_is_handed_out_as_an_orphan():
    authority = PlacementAuthority()
    await authority.acquire("dead", 0.05, "held", [SERVER], 1, TICKET, 1.0)
    waiting = asyncio.create_task(authority.acquire("dead", 0.05, "waiting", [SERVER], 1, TICKET, 5.0))
    await asyncio.sleep(0.1)  # the process dies while its second request waits for the slot
    assert await authority.heartbeat("alive", 30.0) == [("held", SERVER, TICKET)]

    await authority.release("held")  # closed for the dead process: the slot goes to its own waiting request
    assert await waiting == (SERVER, False)

    assert await authority.heartbeat("alive", 30.0) == [("waiting", SERVER, TICKET)]  # not held forever


async def test_a_server_reported_down_gets_sessions_only_when_no_other_is_in_rotation():
    authority = PlacementAuthority()
    other = "http://127.0.0.1:8101"
    await authority.mark_down(SERVER, 30.0)

    first = await authority.acquire("w1", 30.0, "a", [SERVER, other], 1, TICKET, 0.05)
    full = await authority.acquire("w1", 30.0, "b", [SERVER, other], 1, TICKET, 0.05)
    await authority.mark_down(other, 30.0)
    probe = await authority.acquire("w1", 30.0, "c", [SERVER, other], 1, TICKET, 0.05)

    assert first == (other, False)
    assert full is None  # the server in rotation is full: wait for it rather than use the one out of rotation
    assert probe == (SERVER, True)  # none in rotation: probe it
    await authority.mark_up(SERVER)
    assert await authority.acquire("w1", 30.0, "d", [SERVER, other], 2, TICKET, 0.05) == (SERVER, False)


# ----- two worker processes on one server ----------------------------------------------------------------------


@pytest.fixture
async def server():
    async with InProcessEnvironmentServer() as fake:
        yield fake


async def test_two_worker_processes_never_hold_more_sessions_on_a_server_than_its_cap(tq, server):
    holder = session_holder_actor()
    workers = [holder.remote([server.url], 2, 30.0) for _ in range(2)]

    runs = [worker.run_sessions.remote(4, 0.3) for worker in workers]
    opened = await asyncio.wait_for(asyncio.gather(*runs), RAY_TIMEOUT_S)

    await asyncio.gather(*(worker.close.remote() for worker in workers))
    assert server.peak_open_sessions == 2  # 8 sessions, 2 processes, a cap of 2 for the server
    assert sorted(len(times) for times in opened) == [4, 4]  # every session got its browser, in turn
    assert server.open_sessions == 0


async def test_the_leases_of_a_worker_that_died_come_back_and_its_browsers_are_closed(tq, server):
    import ray

    holder = session_holder_actor()
    doomed, survivor = holder.remote([server.url], 2, 1.0), holder.remote([server.url], 2, 1.0)
    doomed.run_sessions.remote(2, 3600.0)  # takes the whole cap and never gives it back
    deadline = time.monotonic() + RAY_TIMEOUT_S
    while server.open_sessions < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    abandoned = server.open_session_ids
    ray.kill(doomed, no_restart=True)

    opened = await asyncio.wait_for(survivor.run_sessions.remote(2, 0.0), RAY_TIMEOUT_S)
    await survivor.close.remote()

    assert len(opened) == 2
    assert [server.events(session)[-1] for session in abandoned] == ["close", "close"]  # closed for the dead worker
    assert server.peak_open_sessions == 2  # ... before the survivor's browsers were opened
    assert server.open_sessions == 0  # nothing of the dead worker is left open on the server


async def test_a_server_one_worker_found_down_is_out_of_rotation_for_the_other_worker_too(tq):
    async with InProcessEnvironmentServer() as down, InProcessEnvironmentServer() as up:
        holder = session_holder_actor()
        first, second = (holder.remote([down.url, up.url], 4, 30.0) for _ in range(2))
        await down.stop()

        assert await asyncio.wait_for(first.open_one_by_one.remote(1), RAY_TIMEOUT_S) == ["unreachable"]
        await asyncio.sleep(0.5)  # the report that the server is down is sent without waiting for an answer
        where = await asyncio.wait_for(second.open_one_by_one.remote(2), RAY_TIMEOUT_S)

        assert where == [up.url, up.url]  # not the server the first worker found down, though it has fewer sessions
        await asyncio.gather(first.close.remote(), second.close.remote())
    assert up.open_sessions == 0


async def test_a_session_cancelled_while_waiting_for_a_slot_leaks_no_lease(tq, server):
    config = EnvironmentConfig(server_urls=(server.url,), max_sessions_per_server=1, placement="ray")
    async with EnvironmentClient(config) as client:
        holding = asyncio.Event()
        release = asyncio.Event()

        async def first() -> None:
            async with client.session(rollout_id=f"a{uuid.uuid4().hex[:8]}", attempt=1, task_id="t", initial_url=START):
                holding.set()
                await release.wait()

        first_task = asyncio.create_task(first())
        await holding.wait()
        waiting = asyncio.create_task(
            client.session(
                rollout_id=f"b{uuid.uuid4().hex[:8]}", attempt=1, task_id="t", initial_url=START
            ).__aenter__()
        )
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the server is full: it waits for the slot
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await first_task

        async with asyncio.timeout(10):  # the one slot is free again: nothing kept it
            async with client.session(rollout_id=f"c{uuid.uuid4().hex[:8]}", attempt=1, task_id="t", initial_url=START):
                assert server.open_sessions == 1
    assert server.open_sessions == 0


# ----- the static per-worker share (no Ray) --------------------------------------------------------------------

SERVERS = tuple(f"http://127.0.0.1:{8100 + index}" for index in range(4))


def ticket(name: str) -> SessionTicket:
    return SessionTicket(session_id=name, rollout_id=name, attempt=1)


@pytest.mark.parametrize(("cap", "servers", "workers"), [(4, 4, 8), (4, 4, 6), (64, 4, 8), (4, 4, 3), (3, 2, 5)])
def test_the_static_shares_of_all_workers_add_up_to_each_servers_cap(cap, servers, workers):
    urls = SERVERS[:servers]
    shares = [static_share(cap, urls, rank, workers) for rank in range(workers)]

    assert [sum(share[url] for share in shares) for url in urls] == [cap] * servers
    totals = [sum(share.values()) for share in shares]
    assert max(totals) - min(totals) <= 1  # cap * servers / workers each, give or take the remainder


def test_a_workers_static_share_is_spread_over_the_servers_before_doubling_up_on_one():
    two_each = [static_share(4, SERVERS, rank, 8) for rank in range(8)]
    four_each = [static_share(4, SERVERS, rank, 4) for rank in range(4)]

    assert all(sorted(share.values()) == [0, 0, 1, 1] for share in two_each)
    assert all(list(share.values()) == [1, 1, 1, 1] for share in four_each)


def test_a_static_share_without_a_slot_for_every_worker_is_refused():
    with pytest.raises(ValueError, match="cannot give each of 9 workers one"):
        static_share(2, SERVERS, 0, 9)
    with pytest.raises(ValueError, match="rank 8"):
        static_share(4, SERVERS, 8, 8)


async def test_workers_with_static_shares_never_hold_more_sessions_on_a_server_than_its_cap():
    cap, workers, per_worker = 2, 3, 12
    placements = [StaticSharePlacement(rank, workers) for rank in range(workers)]
    held = dict.fromkeys(SERVERS, 0)
    peak = dict.fromkeys(SERVERS, 0)

    async def session(placement: StaticSharePlacement, name: str) -> None:
        grant = await placement.acquire(SERVERS, cap, ticket(name))
        held[grant.server] += 1
        peak[grant.server] = max(peak[grant.server], held[grant.server])
        await asyncio.sleep(0.01)
        held[grant.server] -= 1
        placement.release(grant)

    async with asyncio.timeout(10):
        await asyncio.gather(
            *(
                session(placement, f"w{rank}-{index}")
                for rank, placement in enumerate(placements)
                for index in range(per_worker)
            )
        )

    assert peak == dict.fromkeys(SERVERS, cap)  # every server used to its cap, none beyond it
    assert held == dict.fromkeys(SERVERS, 0)


async def test_a_worker_at_its_static_share_waits_though_other_workers_slots_are_idle():
    placement = StaticSharePlacement(rank=0, workers=8)  # 2 of the 16 slots: one on each of two servers
    first = await placement.acquire(SERVERS, 4, ticket("a"))
    second = await placement.acquire(SERVERS, 4, ticket("b"))
    third = asyncio.create_task(placement.acquire(SERVERS, 4, ticket("c")))
    await asyncio.sleep(0.05)

    assert first.server != second.server
    assert not third.done()  # 14 slots idle on the servers, none of them this worker's
    placement.release(first)
    async with asyncio.timeout(1):
        assert (await third).server == first.server


async def test_a_static_share_goes_to_its_other_server_while_one_is_out_of_rotation():
    placement = StaticSharePlacement(rank=0, workers=8)
    mine = [url for url, slots in static_share(4, SERVERS, 0, 8).items() if slots]
    placement.mark_down(mine[0], 30.0)

    grant: Grant = await placement.acquire(SERVERS, 4, ticket("a"))

    assert grant == Grant(server=mine[1], lease_id="a", probing=False)
