"""The loopback fault proxy forwards the interactive_browser contract untouched and fails it on demand.

Driven with the recipe's own environment client through the proxy, in front of the fake server, so each fault is
asserted both as the client classifies it and as the server behind the proxy saw it (or did not).
"""

from __future__ import annotations

import base64
import itertools
import json

import aiohttp
import pytest

from nemo_gym_browser.gym_contract.environment import EnvironmentClient, EnvironmentConfig
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure, FailureKind
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.environment_server.wire import COOKIE_NAME
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.faults.proxy import FaultProxy, session_id_from_cookie

ABOUT = {"url_contains": "about.html"}
_rollouts = itertools.count()


@pytest.fixture
async def fake():
    async with InProcessEnvironmentServer() as server:
        yield server


@pytest.fixture
async def proxy(fake):
    async with FaultProxy(fake.url, upstream_timeout_s=10) as front:
        yield front


def client_of(url: str) -> EnvironmentClient:
    # Seconds, not tenths: on a loaded machine (event loops waking a second or two late) only a hung call may time
    # out, never the calls before or after it; every hang here outlasts them.
    config = EnvironmentConfig(
        server_urls=(url,),
        call_timeout_s=3.0,
        verify_timeout_s=3.0,
        seed_timeout_s=2,
        close_timeout_s=2,
        retry_backoff_s=0.01,
    )
    return EnvironmentClient(config)


@pytest.fixture
async def client(proxy):
    async with client_of(proxy.url) as env:
        yield env


def session(client):
    return client.session(
        rollout_id=f"proxy-{next(_rollouts)}",
        attempt=1,
        task_id="t",
        initial_url="site/index.html",
        verifier_metadata=ABOUT,
    )


def faulting(endpoint: str, fault: Fault):
    return lambda request: fault if request.endpoint == endpoint else None


async def test_a_whole_episode_passes_through_with_its_session_cookie_and_is_tracked_until_verified(
    proxy, fake, client
):
    async with session(client) as s:
        observation = (await s.observe()).observation
        assert proxy.open_session_ids == (s.session_id,)
        await s.click(1)
        assert (await s.finish("x")).done
        assert (await s.verify()).reward == 1.0
        assert proxy.open_session_ids == ()

    assert "TITLE: Home" in observation
    assert fake.events(s.session_id) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert [entry.request.session_id for entry in proxy.log] == [s.session_id] * 6
    assert fake.open_sessions == 0


async def test_rules_see_the_task_a_session_was_seeded_for_on_every_later_request(proxy, client):
    seen = []
    proxy.set_rule(lambda request: seen.append((request.endpoint, request.task_id)))

    async with session(client) as s:
        await s.observe()
        await s.verify()

    assert seen == [("seed_session", "t"), ("browser_observe", "t"), ("verify", "t"), ("close_session", "t")]


async def test_a_5xx_fault_is_answered_by_the_proxy_and_never_reaches_the_server(proxy, fake, client):
    proxy.set_rule(faulting("browser_click", Fault.status(503)))

    async with session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is FailureKind.SERVER_ERROR and "HTTP 503" in failure.value.reason
    assert fake.calls("browser_click") == 0
    assert [e.fault for e in proxy.log if e.request.endpoint == "browser_click"] == ["status"]
    assert fake.open_sessions == 0


async def test_a_dropped_connection_is_unreachable_and_the_request_is_not_forwarded(proxy, fake, client):
    proxy.set_rule(faulting("browser_click", Fault.drop_connection(None)))

    async with session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is FailureKind.UNREACHABLE
    assert fake.calls("browser_click") == 0
    assert proxy.log[-2].request.endpoint == "browser_click" and proxy.log[-2].status is None


async def test_a_hang_is_cut_by_the_client_timeout_and_never_forwarded(proxy, fake, client):
    proxy.set_rule(faulting("browser_click", Fault.hang()))

    async with session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is FailureKind.TIMEOUT
    assert fake.calls("browser_click") == 0
    assert fake.open_sessions == 0  # the close after the hang went through


async def test_a_lost_session_is_reported_as_such_and_the_typed_close_still_releases_the_browser(proxy, fake, client):
    proxy.set_rule(faulting("browser_click", Fault.lose_session()))

    async with session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is FailureKind.SESSION_LOST
    assert fake.open_sessions == 0 and proxy.open_session_ids == ()
    assert fake.events(s.session_id)[-1] == "close"


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (Fault.status(503), FailureKind.VERIFY_UNAVAILABLE),
        (Fault.lose_session(), FailureKind.SESSION_LOST),
        (Fault.hang(), FailureKind.VERIFY_UNAVAILABLE),
    ],
)
async def test_each_fault_at_verify_is_a_failure_to_grade_never_a_zero_and_the_close_still_releases_the_browser(
    fault, kind, proxy, fake, client
):
    proxy.set_rule(faulting("verify", fault))

    async with session(client) as s:
        await s.observe()
        assert (await s.finish("x")).done
        with pytest.raises(EnvironmentFailure) as failure:
            await s.verify()

    assert failure.value.kind is kind
    assert fake.events(s.session_id)[-1] == "close" and fake.open_sessions == 0


async def test_a_regraded_verify_reaches_the_client_with_the_planted_reward_and_still_releases_the_browser(
    proxy, fake, client
):
    proxy.set_rule(faulting("verify", Fault.regrade(1.0)))

    async with session(client) as s:
        await s.observe()
        assert (await s.finish("a wrong answer, on the home page")).done
        result = await s.verify()

    assert result.reward == 1.0  # the fake graded 0: the task asks for the about page
    assert result.raw["reward"] == 1.0 and "response" in result.raw  # the server's own answer otherwise
    assert fake.events(s.session_id)[-2:] == ["verify", "close"]
    assert fake.open_sessions == 0 and proxy.open_session_ids == ()
    assert [e.fault for e in proxy.log if e.request.endpoint == "verify"] == ["regrade"]


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (Fault.status(503), FailureKind.SERVER_ERROR),
        (Fault.hang(), FailureKind.TIMEOUT),
        (Fault.drop_connection(), FailureKind.UNREACHABLE),
        (Fault.lose_session(), FailureKind.SESSION_LOST),
    ],
    ids=["status", "hang", "drop", "lose_session"],
)
@pytest.mark.parametrize("where", ["fake", "proxy"])
async def test_one_fault_value_fails_a_click_the_same_way_from_inside_the_fake_and_through_the_proxy(
    fault, kind, where, proxy, fake
):
    if where == "fake":
        fake.inject("browser_click", fault, on_call=1)
    else:
        proxy.set_rule(faulting("browser_click", fault))

    async with client_of(fake.url if where == "fake" else proxy.url) as client, session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is kind
    assert fake.open_sessions == 0


def test_the_proxy_refuses_a_fault_that_needs_the_inside_of_the_server_and_accepts_every_other_kind():
    with pytest.raises(ValueError, match=r"cannot inject a 'crash_browser' fault: the browser lives inside the server"):
        FaultProxy.check(Fault.crash_browser())
    others = [Fault.status(503), Fault.hang(), Fault.drop_connection(), Fault.lose_session(), Fault.regrade(1.0)]
    assert [FaultProxy.check(fault) for fault in others] == others


async def test_a_rule_that_answers_a_refused_fault_gets_a_500_naming_it_and_the_request_is_never_forwarded(
    proxy, fake, client
):
    proxy.set_rule(faulting("browser_click", Fault.crash_browser()))

    async with session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is FailureKind.SERVER_ERROR and "crash_browser" in failure.value.reason
    assert fake.calls("browser_click") == 0
    assert [(e.fault, e.status) for e in proxy.log if e.request.endpoint == "browser_click"] == [("crash_browser", 500)]
    assert fake.open_sessions == 0


async def test_a_drop_with_a_partial_answer_cuts_the_body_short_and_the_request_is_not_forwarded(proxy, fake, client):
    proxy.set_rule(faulting("browser_click", Fault.drop_connection()))

    async with session(client) as s:
        await s.observe()
        with pytest.raises(EnvironmentFailure) as failure:
            await s.click(1)

    assert failure.value.kind is FailureKind.UNREACHABLE
    assert fake.calls("browser_click") == 0


async def test_a_stopped_proxy_refuses_connections_and_serves_again_on_the_same_port_after_start(proxy, client):
    port = proxy.port
    await proxy.stop()
    with pytest.raises(EnvironmentFailure) as failure:
        async with session(client):
            pass
    await proxy.start()
    async with session(client) as s:
        result = await s.observe()

    assert failure.value.kind is FailureKind.UNREACHABLE
    assert proxy.port == port and result.error is None


async def test_a_dead_upstream_answers_bad_gateway(fake, proxy):
    await fake.stop()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/browser_observe", json={}, timeout=aiohttp.ClientTimeout(total=5)) as r:
            status = r.status
    assert status == 502


def test_session_ids_are_read_from_the_fake_cookie_and_from_a_starlette_signed_cookie():
    payload = base64.b64encode(json.dumps({"session_id": "r7-abc.1.0"}).encode()).decode()
    starlette = f"{COOKIE_NAME}={payload}.ZmFrZQ.c2lnbmF0dXJl"

    assert session_id_from_cookie(starlette) == "r7-abc.1.0"
    assert session_id_from_cookie(f"{COOKIE_NAME}=not-base64") is None
    assert session_id_from_cookie(None) is None


async def test_the_fake_servers_own_cookie_carries_the_session_id_the_proxy_reads(fake, proxy, client):
    async with session(client) as s:
        await s.observe()
    observe = next(e for e in proxy.log if e.request.endpoint == "browser_observe")
    assert observe.request.session_id == s.session_id
