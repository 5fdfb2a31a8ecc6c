"""One contract suite, two servers: the fake (offline tier) and nemo-gym 0.7.0 with Chromium (integration tier).

Every test drives the server only through ``environment.py`` and reads its state only through what a client can
see (answers, and whether a closed session is released), so the fake earns its place by passing the same suite.
Both servers start from the real server's bundled ``site/`` (``site/index.html`` links to About and a form).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure, FailureKind
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.settings import EnvironmentConfig

START = "site/index.html"
# A loopback port nothing listens on: a navigation that fails without any traffic leaving the machine.
DEAD_URL = "http://127.0.0.1:9/"
_rollouts = itertools.count()


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.integration)])
async def server_url(request):
    if request.param == "fake":
        async with InProcessEnvironmentServer() as fake:
            yield fake.url
    else:
        yield request.getfixturevalue("real_environment").url


@pytest.fixture
async def client(server_url):
    config = EnvironmentConfig(server_urls=(server_url,), call_timeout_s=30, seed_timeout_s=60, verify_timeout_s=30)
    async with EnvironmentClient(config) as env:
        yield env


def session(client, verifier=None, initial_url=START):
    return client.session(
        rollout_id=f"contract-{next(_rollouts)}",
        attempt=0,
        task_id="contract",
        initial_url=initial_url,
        verifier_metadata=verifier,
    )


def element_id(observation: str, name: str) -> int:
    for line in observation.splitlines():
        head, _, label = line.strip().partition(": ")
        if head.startswith("[") and label.strip() == name:
            return int(head[1 : head.index("]")])
    raise AssertionError(f"no element named {name!r} in:\n{observation}")


async def observe_until_listed(s, name: str, observations: int = 5) -> str:
    """The page's observation once it lists ``name``. nemo-gym 0.7.0 counts a page's elements once per observation
    and drops any that fail while it reads them, so right after a failed navigation (the browser is still putting up
    its error page) an observation can list no elements although its text is complete; one seen in CI."""
    for _ in range(observations - 1):
        result = await s.observe()
        if any(line.strip().endswith(f": {name}") for line in result.observation.splitlines()):
            return result.observation
        await asyncio.sleep(1.0)
    return (await s.observe()).observation


async def test_the_first_observation_shows_url_title_and_numbered_elements(client):
    async with session(client) as s:
        result = await s.observe()
    lines = result.observation.splitlines()
    assert lines[0].startswith("URL: file://") and lines[0].endswith("/site/index.html")
    assert lines[1] == "TITLE: Home"
    assert lines[2] == "ELEMENTS:"
    assert element_id(result.observation, "About") >= 0
    assert element_id(result.observation, "Go to form") >= 0
    assert result.error is None and result.done is False


async def test_clicking_a_link_changes_the_page_and_the_url_verifier_grades_one(client):
    async with session(client, {"url_contains": "about.html"}) as s:
        home = await s.observe()
        about = await s.click(element_id(home.observation, "About"))
        assert "TITLE: About" in about.observation
        assert (await s.finish("done")).done
        assert (await s.verify()).reward == 1.0
    assert await s.is_released()


@pytest.mark.parametrize(
    ("verifier", "answer", "reward"),
    [
        ({"answer_equals": "ALPHA-42"}, "  ALPHA-42 ", 1.0),
        ({"answer_equals": "ALPHA-42"}, "alpha-42", 0.0),
        ({"dom_contains": "secret code: alpha"}, "x", 1.0),
        ({"dom_contains": "BETA"}, "x", 0.0),
        ({"url_contains": "about.html"}, "x", 1.0),
        ({"url_contains": "form.html"}, "x", 0.0),
    ],
)
async def test_each_verifier_key_grades_the_page_the_policy_finished_on(client, verifier, answer, reward):
    async with session(client, verifier) as s:
        home = await s.observe()
        await s.click(element_id(home.observation, "About"))
        await s.finish(answer)
        assert (await s.verify()).reward == reward


async def test_final_url_compares_the_whole_url(client):
    async with session(client) as probe:
        home = await probe.observe()
        about_url = (await probe.click(element_id(home.observation, "About"))).observation.splitlines()[0][5:]
    for target, reward in ((about_url, 1.0), (about_url + "?x", 0.0)):
        async with session(client, {"final_url": target}) as s:
            home = await s.observe()
            await s.click(element_id(home.observation, "About"))
            await s.finish("x")
            assert (await s.verify()).reward == reward


async def test_the_first_finish_is_the_one_graded(client):
    async with session(client, {"url_contains": "about.html"}) as s:
        home = await s.observe()
        await s.finish("early")
        await s.click(element_id(home.observation, "About"))
        await s.finish("late")
        assert (await s.verify()).reward == 0.0


async def test_typing_into_a_field_is_graded_by_the_page_it_changes(client):
    async with session(client, {"dom_contains": "Welcome neo"}) as s:
        home = await s.observe()
        form = await s.click(element_id(home.observation, "Go to form"))
        field_line = next(line for line in form.observation.splitlines() if line.strip().startswith("[0]"))
        assert "input" in field_line or "textbox" in field_line
        await s.type(0, "neo")
        refreshed = await s.observe()
        await s.click(element_id(refreshed.observation, "Submit"))
        await s.finish("done")
        assert (await s.verify()).reward == 1.0


async def test_policy_mistakes_come_back_as_errors_and_the_session_goes_on(client):
    async with session(client, {"url_contains": "about.html"}) as s:
        before_observe = await s.click(0)
        home = await s.observe()
        not_on_page = await s.click(999)
        bad_name = await s.call("browser_navigate", {"href": "about.html"})
        bad_type = await s.call("browser_click", {"element_id": "About"})
        dead_link = await s.navigate(DEAD_URL)
        await s.navigate(home.observation.splitlines()[0][5:])
        again = await observe_until_listed(s, "About")
        await s.click(element_id(again, "About"))
        await s.finish("done")
        assert (await s.verify()).reward == 1.0
    assert "call browser_observe first" in before_observe.error
    assert "not in last observation" in not_on_page.error
    assert bad_name.error.startswith("invalid arguments for browser_navigate") and "url" in bad_name.error
    assert bad_type.error.startswith("invalid arguments for browser_click")
    assert dead_link.error.startswith("navigate failed")


async def test_a_second_verify_finds_no_session_because_verify_released_it(client):
    async with session(client, {"url_contains": "about.html"}) as s:
        await s.observe()
        await s.verify()
        with pytest.raises(EnvironmentFailure) as caught:
            await s.verify()
    assert caught.value.kind is FailureKind.SESSION_LOST


async def test_a_start_page_that_never_loads_is_seed_failed(client):
    with pytest.raises(EnvironmentFailure) as caught:
        async with session(client, initial_url=DEAD_URL):
            pass
    assert caught.value.kind is FailureKind.SEED_FAILED


async def test_concurrent_sessions_are_isolated_and_all_released(client):
    async def walk(index: int):
        verifier = {"url_contains": "about.html" if index % 2 else "index.html"}
        async with session(client, verifier) as s:
            home = await s.observe()
            if index % 2:
                await s.click(element_id(home.observation, "About"))
            await s.finish("done")
            reward = (await s.verify()).reward
        return reward, await s.is_released()

    results = await asyncio.gather(*(walk(i) for i in range(4)))
    assert results == [(1.0, True)] * 4


async def test_a_closed_session_is_released_without_verify(client):
    async with session(client) as s:
        await s.observe()
    assert await s.is_released()
